"""Errors and warnings that hookscope raises on purpose; each message says what to do."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["ArgumentTypeError", "ArgumentValueError", "AttentionError", "BundleError", "CaptureError",
           "CircuitError", "ConcurrentModelError", "EditError", "EmptySelectionError", "ExtractError",
           "ExtractInterrupted",
           "FusedModuleWarning", "GradcamError", "HookNeverFiredError", "HookNeverFiredWarning",
           "HookscopeError", "HookscopeWarning", "MisalignedLabelsWarning", "MissingExtraError",
           "ModelCodeError", "MonitorFaultWarning", "NonFiniteStepError", "NonFiniteStepWarning",
           "OutputExistsError", "PositionError", "SelectorError", "SpecError", "StoreCorruptError",
           "StoreError", "StoreExistsError", "StoreFaultError", "TrainingModeWarning", "warn"]

# Frames in these files are hookscope's or the machinery between the user's line and hookscope
# (context managers, nn.Module.__call__ running hooks): a warning is attributed past them.
_INTERNAL = (str(Path(__file__).parent) + os.sep, str(Path(torch.__file__).parent) + os.sep,
             contextlib.__file__)


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose."""


class SelectorError(HookscopeError, LookupError):
    """A pattern matched no module, or named a module whose hook could never fire."""


class ArgumentTypeError(HookscopeError, TypeError):
    """An argument of a public function has the wrong type (``capture(None, ...)``,
    ``grads="yes"``, ``dtype="half"``): raised when the call is made, before anything runs; the
    message names the parameter, what it got and what to pass."""


class ArgumentValueError(HookscopeError, ValueError):
    """An argument of a public function has the right type and a value that cannot work
    (``to="nodevice"``, a NaN steering vector, ``positions=[]``): raised before anything runs."""


class EmptySelectionError(SelectorError, ValueError):
    """A selection that selects nothing: no pattern, ``edit(model, {})``, ``layers=[]``,
    ``positions=[]``. Every verb refuses it (a call that would do nothing and say nothing is a
    bug in the caller's code, not a request); it is a ``SelectorError`` and a ``ValueError``."""


class HookNeverFiredError(HookscopeError, RuntimeError):
    """A selected module never ran while hooks were installed (``on_unfired="error"``).

    Attributes:
        capture: the ``Capture`` whose data stays readable although the error was raised.
        unfired: ``{path: reason}`` for every module whose hook never fired.
    """

    def __init__(self, message: str, capture: object = None, unfired: dict[str, str] | None = None):
        super().__init__(message)
        self.capture = capture
        self.unfired = dict(unfired or {})


class HookscopeWarning(UserWarning):
    """Base class of every warning hookscope issues on purpose (filter them all with
    ``warnings.filterwarnings("ignore", category=hookscope.HookscopeWarning)``)."""


class TrainingModeWarning(HookscopeWarning):
    """A verb that compares many forward passes (``patching_sweep``, ``attribution_patching``,
    ``edge_attribution_patching``) runs a model whose dropout is in training mode, so each
    forward samples another mask."""


class HookNeverFiredWarning(HookscopeWarning):
    """A selected module never ran while hooks were installed (``on_unfired="warn"``)."""


class NonFiniteStepError(HookscopeError, FloatingPointError):
    """The training guard found a non-finite value in a step (``hookscope.monitor``); ``origin``
    (a ``NonFiniteOrigin`` or None), ``step`` and ``bundle`` (path or None) say where."""


class NonFiniteStepWarning(HookscopeWarning):
    """The training guard found a non-finite value in a step, with ``guard="warn"``/``"skip"``."""


class MonitorFaultWarning(HookscopeWarning):
    """``hookscope.monitor`` could not do part of its own work (write records or a replay
    bundle, summarise a value, hook an optimizer it does not know); training went on, and the
    fault is an ``{"event": "fault"}`` record in ``mon.events`` and the run folder."""


class BundleError(HookscopeError, ValueError):
    """A replay bundle is damaged, not hookscope's, or does not fit the model; nothing of the
    model was touched."""


class FusedModuleWarning(HookscopeWarning):
    """A selected module is a placeholder left by fusion (``fuse_modules``): its output is not
    what its name says."""


class CaptureError(HookscopeError, KeyError):
    """A record was asked for that the capture does not hold, or holds ambiguously."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreCorruptError(HookscopeError, OSError):
    """A store's shard or manifest fails its checksum or cannot be parsed."""


class ConcurrentModelError(HookscopeError, RuntimeError):
    """A verb that leaves the model as it was found ran a training-mode forward while another
    thread ran the same modules: their buffers (BatchNorm statistics) hold both threads' updates,
    and hookscope left them rather than overwrite the other thread's (``engine.run.untouched``).
    Run the verb on ``model.eval()`` or on ``copy.deepcopy(model)``."""


class SpecError(HookscopeError, ValueError):
    """A model or input spec names nothing usable: unknown name, missing file, wrong shape."""


class ModelCodeError(HookscopeError, RuntimeError):
    """The user's model code failed where hookscope ran it for the CLI: the forward pass raised
    on the inputs given (chained), or a factory or model file called ``sys.exit(code)`` (the
    CLI would otherwise exit with that code and no message; ``code`` is the code it asked for).
    The CLI exits 1 (the run failed), not 2 (usage)."""

    def __init__(self, message: str, code: object = None):
        super().__init__(message)
        self.code = code


class MissingExtraError(HookscopeError, ImportError):
    """An optional dependency is not installed; the message gives the exact ``pip install``."""


class StoreError(HookscopeError, LookupError):
    """A path is not a finished hookscope store, or a store lacks the layer asked for."""


class StoreFaultError(StoreError):
    """An object store (``s3://``, ``gs://``...) failed: unreachable, refused the credentials,
    lacks the bucket, or kept failing after bounded retries. The message names the store URL,
    the endpoint and what to check; raised during an extraction it also says how many rows are
    kept and how to resume."""


class StoreExistsError(HookscopeError, FileExistsError):
    """An extraction's output exists and neither resume nor overwrite was asked for."""


class OutputExistsError(HookscopeError, FileExistsError):
    """A file to write exists and ``overwrite`` was not asked for, or the path is a folder."""


class ExtractError(HookscopeError, ValueError):
    """An extraction cannot start or go on: a bad argument, an output that cannot be stored
    row by row, or a resume whose arguments differ from the interrupted run's."""


class ExtractInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped an extraction gracefully: the rows computed so far, those of the
    open shard included, are written and listed in the manifest (``rows`` of them, in the store
    folder ``out``); ``resume=True`` / ``--resume`` continues it. A ``KeyboardInterrupt``, so
    ``except Exception`` does not swallow it."""

    def __init__(self, message: str, *, rows: int, out: str):
        super().__init__(message)
        self.rows, self.out = rows, out


class EditError(HookscopeError, ValueError):
    """An edit cannot be applied: a replacement of the wrong shape, a missing source record, an
    option out of range; the message names the module, the call and the fix."""


class GradcamError(HookscopeError, ValueError):
    """Grad-CAM cannot be computed: the layer's output is not a feature map, the model's output
    is not class scores, or a target class is out of range."""


class MisalignedLabelsWarning(HookscopeWarning):
    """``extract`` stores a padded batch's layers ragged (real tokens only), but its labels are
    one ``(batch, seq)`` row of token labels per input, padding included: label ``j`` of a row
    is not the id of stored token ``j``."""


class PositionError(HookscopeError, IndexError):
    """``positions=`` names a token position that does not exist, or marks padding (see
    ``hookscope.record.positions``)."""


def warn(message: str, category: type[Warning]) -> None:
    """Issue ``warnings.warn(message, category)`` attributed to the user's line.

    The warning's file and line are those of the first caller outside hookscope, torch and
    ``contextlib`` (the ``with`` statement, the ``model(x)`` call, or the user's own forward), so
    that ``-W error`` tracebacks, warning filters by module and IDEs point at the user's code
    whatever the depth of hookscope's own calls (``stacklevel`` is counted here, not guessed).
    """
    frame = sys._getframe(1)
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


class AttentionError(HookscopeError, ValueError):
    """Attention probabilities cannot be taken from a module: it never ran, or one of its calls
    computed no attention or more than one; the message names the module and the pattern to use."""


class CircuitError(HookscopeError, ValueError):
    """A dictionary (SAE, transcoder) or an attribution graph cannot be built: a folder that is
    not SAELens's or circuit-tracer's format, weights of mismatched shapes, a model whose norms or
    attention cannot be frozen; the message names the file, module or shape and the fix."""
