"""The engine: the only code that touches torch's hook API, in four rooms and the life cycle on top.

- ``door/``: the only writer of torch's hook tables. ``hooks`` registers every hook hookscope adds,
  each owned (its module object, its thread, not a checkpoint recompute); ``copies`` keeps every
  hook out of a copy, a pickle or a checkpoint.
- ``values/``: what a hook saw, held and described. ``keep`` (what can be kept after the call),
  ``copy_on_write`` (equal to what the module returned despite later in-place writes), ``kinds``
  (the table of tensor kinds), ``layout`` (batch, token and heads axes, the mask of its forward),
  ``record_key`` (the one address of a recorded value).
- ``naming/``: from the names users see to modules and calls. ``selection`` (paths, ``state_dict()``
  keys, globs), ``names`` and ``wrappers`` (every visible name, through any wrapper),
  ``standard_naming`` and ``residual_check`` (standard names, checked against the model's own
  hidden states), ``function_names`` (addresses of function calls inside a forward).
- ``compile/``: ``graph``, the route of hooks through ``torch.compile`` graphs and the
  process-wide changes it makes; ``spec`` (a value as the tensors and spec string a graph hands
  out); ``function_calls`` (a watched forward's calls inside a graph).
- On top: ``session`` (the life cycle every verb shares: resolve once, register, remove on every
  exit path, explain unfired hooks), ``interrupts`` (no interrupt skips a cleanup),
  ``function_mode`` (the torch functions a forward calls), ``function_hooks`` (hooks on those
  calls), ``mode_stack`` (torch's function-mode stack), ``early_stop``, ``run`` (what a batch
  means to the model), ``ground_truth`` (one probe forward: what the model itself computed),
  ``diagnose`` (why a hook could not or did not fire), ``checks`` (argument checks).

Imports only ``hookscope.errors`` and ``hookscope.util``. Other packages import what this face
offers (``__all__``), never one of its modules (``tests/test_layers.py``).
"""

from hookscope.engine.checks import (
    brief,
    check_arity,
    check_callable,
    check_device,
    check_dtype,
    check_finite,
    check_flag,
    check_int,
    check_iterable,
    check_model,
    check_nonempty,
    check_number,
    check_options,
    check_path,
    check_positions,
    check_run_dir,
    check_tensor,
    check_token_ids,
    warn_if_dropout_trains,
)
from hookscope.engine.compile.graph import eager_when_called
from hookscope.engine.compile.spec import NotKept
from hookscope.engine.diagnose import explain_no_hooks, fullgraph, locate_error, preflight
from hookscope.engine.door.hooks import (
    FULLGRAPH,
    OwnedHook,
    RecordingHook,
    in_recompute,
    nothing,
    output_of,
    owner,
)
from hookscope.engine.door.tables import (
    after_backward,
    on_optimizer_step,
    on_output_grad,
    on_tensor_grad,
    others_tables,
    registered,
    unregister,
)
from hookscope.engine.function_mode import FunctionCall, Watch
from hookscope.engine.ground_truth import Probe, first_tensor, probe_of, same_values
from hookscope.engine.interrupts import (
    GracefulStop,
    critical,
    exit_at_interrupt,
    never_skipped,
    release_signals,
)
from hookscope.engine.mode_stack import each_call
from hookscope.engine.naming.function_names import bind_arguments, functional_hint, refuse_uninterceptable
from hookscope.engine.naming.names import ModuleIndex, index, one_index_per_call
from hookscope.engine.naming.residual_check import Residuals, checked_residuals, decoder_blocks
from hookscope.engine.naming.selection import (
    Target,
    as_patterns,
    asked_names,
    flat_patterns,
    is_container,
    resolve,
    select,
)
from hookscope.engine.naming.standard_naming import (
    blocks_of,
    branch_norms,
    from_transformer_lens,
    is_standard,
    known_standard_names,
    resolve_standard,
    standard_names,
    unresolved_standard,
)
from hookscope.engine.naming.wrappers import unwrap
from hookscope.engine.origin import KNOWN_LIBRARIES, library_of
from hookscope.engine.run import (
    RngState,
    detached_clones,
    input_device,
    model_inputs,
    state_snapshot,
    untouched,
)
from hookscope.engine.session import HookSession, Observer, OnUnfired, resolve_checked, resolve_each
from hookscope.engine.values.copy_on_write import eager_copy, lazy_copy, shares_memory, version_of
from hookscope.engine.values.keep import (
    NO_VALUES_FIX,
    check_has_values,
    check_not_transformed,
    holds_no_values,
    keepable,
    kept_note,
    no_values_reason,
    outside_inference,
    special,
)
from hookscope.engine.values.kinds import (
    apply_edit,
    comparable,
    describe,
    inside,
    kind_of,
    rows_for,
    values_for,
)
from hookscope.engine.values.layout import (
    NO_TOKENS,
    TOKEN_AXES,
    AxesRow,
    Layout,
    MaskWatcher,
    Tokens,
    batch_first,
    check_no_unmasked_padding,
    layout_of,
    token_axes,
)
from hookscope.engine.values.record_key import Part, RecordKey, record_name

__all__ = ["Probe", "Residuals", "checked_residuals", "first_tensor", "probe_of", "same_values",
           "decoder_blocks",
           "AxesRow", "TOKEN_AXES", "batch_first", "token_axes",
           "FULLGRAPH", "FunctionCall", "RecordingHook", "GracefulStop", "critical", "exit_at_interrupt",
           "release_signals", "never_skipped", "others_tables", "HookSession",
           "KNOWN_LIBRARIES", "Layout", "MaskWatcher", "ModuleIndex", "NO_TOKENS", "NO_VALUES_FIX", "NotKept",
           "Observer", "OnUnfired", "OwnedHook", "Part", "RecordKey", "RngState", "Target", "Tokens",
           "Watch", "after_backward", "apply_edit", "as_patterns", "bind_arguments", "brief", "check_arity",
           "check_callable", "check_device", "check_dtype", "check_finite", "check_flag",
           "check_has_values", "check_int", "check_iterable", "check_model", "check_no_unmasked_padding",
           "check_nonempty", "check_not_transformed", "check_number", "check_options", "check_path",
           "check_positions", "check_run_dir", "check_tensor", "check_token_ids", "comparable", "describe",
           "detached_clones", "eager_copy", "eager_when_called", "each_call", "explain_no_hooks",
           "fullgraph", "functional_hint", "holds_no_values", "in_recompute", "index", "input_device",
           "inside", "is_container", "keepable", "kept_note", "kind_of", "layout_of", "lazy_copy",
           "library_of", "locate_error", "model_inputs", "no_values_reason", "nothing", "on_optimizer_step",
           "on_output_grad",
           "on_tensor_grad", "one_index_per_call", "output_of", "outside_inference", "owner", "preflight",
           "refuse_uninterceptable", "registered", "resolve", "resolve_checked", "resolve_each", "rows_for",
           "select", "shares_memory", "special", "standard_names", "flat_patterns",
           "record_name", "from_transformer_lens", "known_standard_names", "unresolved_standard",
           "warn_if_dropout_trains", "state_snapshot", "unregister",
           "untouched", "unwrap", "values_for", "version_of", "blocks_of", "branch_norms",
           "resolve_standard", "is_standard", "asked_names"]
