"""The longest ``--max-model-len`` vLLM 0.33 accepts for a model, derived as vLLM derives it.

A transcription of ``_get_and_verify_max_len`` (``vllm/config/model.py``, vLLM 0.33.0) and of
``ModelArchConfigConvertorBase.derive_max_model_len_and_key``
(``vllm/transformers_utils/model_arch_config_convertor.py``), on the text config:

1. the smallest of ``max_position_embeddings, n_positions, max_seq_len, seq_length,
   model_max_length, max_target_positions, max_sequence_length, max_seq_length, seq_len``;
   ``model_max_length``, when set, overrides them all (Command-R / Cohere);
2. the minimum with the tokenizer config's ``model_max_length``;
3. none found: 2048 (vLLM then accepts any explicit ``--max-model-len``; fleet keeps 2048);
4. unless the model type contains ``gemma3`` (its ``max_position_embeddings`` is already
   scaled), the RoPE ``factor`` multiplies the length, except for the rope types ``su``,
   ``longrope``, ``llama3``, ``yarn``, ``deepseek_yarn`` and ``deepseek_llama_scaling``;
   with per-layer-type rope parameters the last scaled type's factor wins; a null factor is 1;
5. the default when ``--max-model-len`` is not given is that length, except for LongRoPE
   models, where it is ``original_max_position_embeddings``. A larger explicit value is
   refused ("User-specified max_model_len ... is greater than the derived max_model_len").

RoPE parameters are read the way transformers v5 presents them to vLLM: ``rope_parameters``,
else the legacy ``rope_scaling``; the legacy ``type`` key is ``rope_type``, ``su`` is
``longrope`` and ``mrope`` is ``default`` (``patch_legacy_rope_type``,
``vllm/transformers_utils/config.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fleet.model.config import ConfigReader

MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
#: Rope types whose ``factor`` vLLM does not multiply into the derived length.
ROPE_NOT_SCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
#: Layer types transformers knows (``ALLOWED_LAYER_TYPES``): a rope dict keyed by them is nested.
LAYER_TYPE_KEYS = frozenset(
    {
        "full_attention",
        "sliding_attention",
        "chunked_attention",
        "linear_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "mamba",
        "conv",
        "hybrid",
        "moe",
        "dense",
        "main",
        "compress",
    }
)
DEFAULT_MAX_LEN = 2048
_LEGACY_ROPE = {"su": "longrope", "mrope": "default"}


@dataclass(frozen=True)
class MaxLen:
    """vLLM's derived maximum length of a model and where it came from."""

    limit: int  #: the largest ``--max-model-len`` vLLM accepts
    default: int  #: what vLLM uses when ``--max-model-len`` is not given
    key: str  #: the config field it came from
    rope_factor: float  #: the RoPE factor multiplied in (1.0 when none)
    reason: str  #: one line for the plan


def rope_parameters(text: ConfigReader) -> list[dict[str, Any]]:
    """The rope parameter dicts vLLM's ``iter_rope_parameters`` yields, legacy keys patched."""
    raw = text.cfg.get("rope_parameters")
    if raw is None:
        raw = text.cfg.get("rope_scaling")
        key = "rope_scaling"
    else:
        key = "rope_parameters"
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise text.fail(key, raw, "must be a JSON object (rope_type, factor, ...)")

    def patched(params: Mapping[str, Any], where: str) -> dict[str, Any]:
        out = dict(params)
        if "rope_type" not in out and "type" in out:
            out["rope_type"] = out["type"]
        rope_type = out.get("rope_type", "default")
        if not isinstance(rope_type, str):
            raise text.fail(f"{where}.rope_type", rope_type, "must be a string such as 'linear' or 'yarn'")
        out["rope_type"] = _LEGACY_ROPE.get(rope_type, rope_type)
        factor = out.get("factor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0):
            raise text.fail(f"{where}.factor", factor, "must be a positive number")
        if isinstance(factor, float) and factor > 1e6:
            raise text.fail(f"{where}.factor", factor, "must be at most 1e6")
        return out

    def nested(items: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        for name, params in items.items():
            if isinstance(params, dict) and params:
                yield patched(params, f"{key}.{name}")

    if raw and set(raw) <= LAYER_TYPE_KEYS:
        return list(nested(raw))
    return [patched(raw, key)] if raw else []


def derive_max_len(text: ConfigReader, model_type: str, tokenizer_config: Mapping[str, Any] | None) -> MaxLen:
    """vLLM 0.33's derived max length for this text config (see the module docstring)."""
    derived: float = float("inf")
    key = ""
    for name in MAX_LEN_KEYS:
        value = text.optional_int(name, bounds=(1, 1 << 34))
        if value is not None:
            if value < derived:
                key = name
            derived = min(derived, value)
    override = text.optional_int("model_max_length", bounds=(1, 1 << 34))
    if override:
        key, derived = "model_max_length", override
    why = [f"{key}={int(derived)}" if key else ""]
    if tokenizer_config:
        tok = tokenizer_config.get("model_max_length", derived)
        if isinstance(tok, int | float) and not isinstance(tok, bool) and tok < derived:
            derived = tok
            key = "tokenizer_config.json model_max_length"
            why.append(f"tokenizer_config.json model_max_length={int(tok)}")
    if derived == float("inf"):
        derived, key = DEFAULT_MAX_LEN, "default"
        why = [f"config.json gives no maximum length; vLLM assumes {DEFAULT_MAX_LEN}"]
    params = rope_parameters(text)
    factor = 1.0
    if params and "gemma3" not in model_type:
        scale: float | None = 1.0
        for rp in params:
            if rp["rope_type"] not in ROPE_NOT_SCALED:
                scale = rp.get("factor", scale)
        factor = 1.0 if scale is None else float(scale)
        derived *= factor
        if factor != 1.0:
            why.append(f"× RoPE {params[-1]['rope_type']} factor {factor:g}")
    elif params and any(rp.get("factor") for rp in params):
        why.append(f"RoPE factor not applied: {model_type} max_position_embeddings is already scaled")
    scaled_types = sorted({rp["rope_type"] for rp in params if rp["rope_type"] in ROPE_NOT_SCALED and rp.get("factor")})
    if scaled_types:
        why.append(f"RoPE {', '.join(scaled_types)}: factor not multiplied (length already scaled)")
    limit = int(derived)
    default = limit
    if any(rp["rope_type"] == "longrope" for rp in params):
        original = text.optional_int("original_max_position_embeddings", bounds=(1, 1 << 34))
        if original is not None:
            default = original
            why.append(f"LongRoPE: default length original_max_position_embeddings={original}")
    return MaxLen(limit, default, key, factor, "; ".join(w for w in why if w))
