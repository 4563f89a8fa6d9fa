"""One name for the pattern argument (issue 34 item 5): every public verb that selects modules
calls it ``layers`` (``*layers`` where the patterns are positional: ``capture(model, "fc1",
"fc2")``), and every command-line verb ``--layers``. Before: ``*patterns`` in 4 functions,
``layers=`` in 12, ``layer=`` in 1; ``--layer`` in 7 CLI verbs, ``--layers`` in 1."""

from __future__ import annotations

import argparse
import inspect

import hookscope
from hookscope.cli.main import build_parser

#: the public functions that select modules by pattern
SELECTING = {"capture", "capture_generation", "select", "run", "ablate", "patch", "patching_sweep",
             "attribution_patching", "attention", "attention_gradients", "rollout", "compare",
             "stats", "extract", "monitor", "gradcam", "logit_lens", "probe"}
#: other names a pattern argument has had, here or in the field
OTHER_NAMES = {"pattern", "patterns", "layer", "modules", "module_names", "names_filter",
               "return_nodes", "hook_names"}
#: the command-line verbs that select modules (``tree --filter`` narrows a printout)
SELECTING_VERBS = {"capture", "attention", "diff", "extract", "gradcam", "lens", "probe", "stats"}


def _parameters(name: str) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(getattr(hookscope, name)).parameters)


def test_every_public_verb_that_selects_calls_it_layers() -> None:
    public = [name for name in hookscope.__all__ if callable(getattr(hookscope, name))
              and not (isinstance(getattr(hookscope, name), type)
                       and issubclass(getattr(hookscope, name), BaseException))]
    assert SELECTING <= set(public)
    others = {name: sorted(set(_parameters(name)) & OTHER_NAMES) for name in public}
    assert {name: found for name, found in others.items() if found} == {}
    missing = sorted(name for name in SELECTING if "layers" not in _parameters(name))
    assert missing == []


def test_positional_patterns_are_star_layers() -> None:
    for name in ("capture", "capture_generation", "select"):
        layers = _parameters(name)["layers"]
        assert layers.kind is inspect.Parameter.VAR_POSITIONAL, name


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_command_line_verb_that_selects_has_the_flag_layers() -> None:
    flags = {verb: {flag for action in parser._actions for flag in action.option_strings}
             for verb, parser in _verb_parsers().items()}
    assert SELECTING_VERBS <= set(flags)
    assert sorted(verb for verb in SELECTING_VERBS if "--layers" not in flags[verb]) == []
    stale = {f"--{name.replace('_', '-')}" for name in OTHER_NAMES}
    assert {verb: sorted(found & stale) for verb, found in flags.items() if found & stale} == {}
