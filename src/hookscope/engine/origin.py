"""Private: where a piece of code comes from: an installed library, or the user's own code.

Frameworks change models in two ways hookscope must see through: they wrap a model in a module
of their own (Opacus' ``GradSampleModule`` under ``_module``, DDP under ``module``) and they add
hooks that are part of how the model works (Opacus' per-sample gradient hooks, ``WeightNorm``,
lazy initialisation). Neither is recognised by a list of framework names: a class or a hook
function belongs to a *library* when its top-level package is installed in the interpreter's
library folders (``site-packages``/``dist-packages``, ``sysconfig``'s ``purelib`` and
``platlib``) or is one of the packages named in ``KNOWN_LIBRARIES`` (torch and the frameworks
that are often built from source). The user's code (``__main__``, a script's folder, a
project installed editable, hookscope's tests) is not a library; hookscope itself is neither.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig

__all__ = ["library_of", "KNOWN_LIBRARIES"]

#: packages that are libraries wherever they are installed (a source build of torch)
KNOWN_LIBRARIES = frozenset({"torch", "accelerate", "peft", "transformers", "deepspeed",
                             "fairscale", "torchao", "bitsandbytes", "apex", "opacus"})


@functools.cache
def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {paths.get("purelib"), paths.get("platlib"), *site.getsitepackages()}
    return tuple(os.path.realpath(f) + os.sep for f in folders if f)


@functools.cache
def _installed(package: str) -> bool:
    module = sys.modules.get(package)
    file = getattr(module, "__file__", None)
    if not isinstance(file, str):
        return False
    return os.path.realpath(file).startswith(_library_folders())


def library_of(module_name: str) -> str | None:
    """The top-level package of ``module_name`` (a ``__module__``) when it is a library, else
    None (the user's code, hookscope)."""
    package = module_name.partition(".")[0]
    if package == "hookscope" or package == "__main__":
        return None
    if package in KNOWN_LIBRARIES or _installed(package):
        return package
    return None
