"""Tiny models of every architecture transformers' auto mappings name.

Each class comes from one of transformers' own auto-model mappings (``MAPPINGS``: causal LMs,
sequence-to-sequence, masked LMs, encoders, vision), never from a hand list. Its config is the
model type's default (``AutoConfig.for_model``) with every size it has shrunk (``SHRINK``, in
sub-configs too), so every class builds in well under a second on CPU; one that does not build,
or is still too large, is skipped with the reason recorded.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# (kind, mapping name in transformers.models.auto.modeling_auto)
MAPPINGS = (("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
            ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
            ("masked", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
            ("encoder", "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES"),
            ("vision", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"))
MAX_PARAMETERS = 3_000_000
WIDTH, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 4, 2, 2, 128
# config key -> the tiny value; a key the config lacks is left out
SHRINK: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim",
                     "hidden_dim", "word_embed_proj_dim", "embedding_size", "d_embed",
                     "projection_dim", "kv_lora_rank"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "num_encoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads",
                     "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim", "attention_head_dim"), WIDTH // HEADS),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim",
                     "decoder_ffn_dim", "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "expert_intermediate_size",
                     "mlp_dim", "d_inner"), 2 * WIDTH),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk"), 2),
    **dict.fromkeys(("vocab_size", "n_vocab"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
SPECIAL = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
           "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")


@dataclass(frozen=True)
class Built:
    """One architecture: ``name`` (the class), ``kind`` (its mapping), the ``model`` in eval
    mode, or ``None`` with ``skipped`` the reason."""

    name: str
    kind: str
    model_type: str
    model: nn.Module | None
    skipped: str = ""


def classes() -> list[tuple[str, str, str]]:
    """``[(kind, model_type, class name)]`` of every mapping in ``MAPPINGS``, first kind wins
    (a class in two mappings is tested once)."""
    from transformers.models.auto import modeling_auto
    seen: set[str] = set()
    out = []
    for kind, mapping in MAPPINGS:
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in (names,) if isinstance(names, str) else tuple(names):
                if name not in seen:
                    seen.add(name)
                    out.append((kind, model_type, name))
    return out


def tiny_config(model_type: str, seed: int = 0, **extra: Any) -> Any:
    """The default config of ``model_type`` with its sizes shrunk (``SHRINK``, sub-configs
    too) and its special token ids inside the tiny vocabulary; ``extra`` overrides."""
    from transformers import AutoConfig
    default = AutoConfig.for_model(model_type)
    return _shrunk(type(default), default, extra)


def _shrunk(config_class: type, default: Any, extra: dict[str, Any]) -> Any:
    values = default.to_dict()
    keys = set(values) | set(getattr(default, "attribute_map", {}))
    kwargs: dict[str, Any] = {k: v for k, v in SHRINK.items() if k in keys and _replaceable(values.get(k, v))}
    for key, _value in values.items():
        sub = getattr(default, key, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type") and key.endswith("config"):
            kwargs[key] = _shrunk(type(sub), sub, {}).to_dict()
    for key in SPECIAL:
        if isinstance(values.get(key), int) and values[key] >= VOCAB:
            kwargs[key] = VOCAB - 1 - SPECIAL.index(key)
    for key in ("layer_types", "block_types", "layers_block_type", "hybrid_override_pattern"):
        if isinstance(values.get(key), (list, str)) and values[key]:
            kwargs[key] = values[key][:LAYERS] if isinstance(values[key], list) else values[key][:LAYERS]
    kwargs.update(extra)
    return config_class(**kwargs)


def _replaceable(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def build(kind: str, model_type: str, name: str, seed: int = 0) -> Built:
    """``name`` built from ``tiny_config(model_type)`` with seeded random weights, in eval mode;
    skipped (the reason recorded) when it cannot build or has more than ``MAX_PARAMETERS``."""
    import transformers
    cls = getattr(transformers, name, None)
    if cls is None:
        return Built(name, kind, model_type, None, "not importable from transformers")
    try:
        with _quiet():
            config = tiny_config(model_type)
            if kind == "causal" and getattr(config, "is_decoder", None) is False:
                config.is_decoder = True  # a BERT-like class as a causal LM, as its tests build it
            if getattr(config, "is_encoder_decoder", False) and \
                    getattr(config, "decoder_start_token_id", None) is None:
                config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
            with torch.device("meta"):
                count = sum(p.numel() for p in cls(config).parameters())
            if count > MAX_PARAMETERS:
                limit = f"limit {MAX_PARAMETERS / 1e6:.0f}M"
                return Built(name, kind, model_type, None,
                             f"{count / 1e6:.1f}M parameters after shrinking ({limit})")
            torch.manual_seed(seed)
            model = cls(config).eval()
    except Exception as exc:  # noqa: BLE001 - any failure to build is recorded as the reason
        return Built(name, kind, model_type, None, _reason(exc))
    return Built(name, kind, model_type, model)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:120]}"


@contextlib.contextmanager
def _quiet() -> Any:
    from transformers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
