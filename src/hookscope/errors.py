"""Errors and warnings that hookscope raises on purpose; each message says what to do."""

from __future__ import annotations


class HookscopeError(Exception):
    """Base class of every error hookscope raises on purpose."""


class SelectorError(HookscopeError, LookupError):
    """A pattern matched no module, or named a module whose hook could never fire."""


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


class HookNeverFiredWarning(UserWarning):
    """A selected module never ran while hooks were installed (``on_unfired="warn"``)."""


class CaptureError(HookscopeError, KeyError):
    """A record was asked for that the capture does not hold, or holds ambiguously."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreCorruptError(HookscopeError, OSError):
    """A store's shard or manifest fails its checksum or cannot be parsed."""


class SpecError(HookscopeError, ValueError):
    """A model or input spec names nothing usable: unknown name, missing file, wrong shape."""


class MissingExtraError(HookscopeError, ImportError):
    """An optional dependency is not installed; the message gives the exact ``pip install``."""


class StoreError(HookscopeError, LookupError):
    """A path is not a finished hookscope store, or a store lacks the layer asked for."""


class StoreExistsError(HookscopeError, FileExistsError):
    """An extraction's output exists and neither resume nor overwrite was asked for."""


class ExtractError(HookscopeError, ValueError):
    """An extraction cannot start or go on: a bad argument, an output that cannot be stored
    row by row, or a resume whose arguments differ from the interrupted run's."""


class EditError(HookscopeError, ValueError):
    """An edit cannot be applied: a replacement of the wrong shape, a missing source record, an
    option out of range; the message names the module, the call and the fix."""


class GradcamError(HookscopeError, ValueError):
    """Grad-CAM cannot be computed: the layer's output is not a feature map, the model's output
    is not class scores, or a target class is out of range."""


class PositionError(HookscopeError, IndexError):
    """``positions=`` names a token position that does not exist, or marks padding (see
    ``hookscope.positions``)."""
