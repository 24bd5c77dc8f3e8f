"""Finding and reading a Hugging Face ``config.json``: every problem is a ``ModelConfigError``.

The one boundary for model configs. A config is found without network (an explicit path, the
local Hugging Face cache layout, then the reference configs bundled with fleet), read as UTF-8
JSON that must be an object, and every number the planner uses is checked here: an integer (not
a bool, float or string), inside plausible bounds, so no arithmetic downstream can hang or
divide by zero. Errors name the file, the field, the value and what is allowed.

Next to ``config.json`` fleet also reads, when present, ``tokenizer_config.json`` (its
``model_max_length`` caps the derived length, as in vLLM's ``_get_and_verify_max_len``) and
``model.safetensors.index.json`` (its ``metadata.total_size`` is the exact weight size).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.errors import ModelConfigError

BUNDLED_MODELS = Path(__file__).resolve().parents[1] / "data" / "models"

#: Largest config.json fleet reads (real ones are a few KiB; multimodal ones under 100 KiB).
MAX_CONFIG_BYTES = 4 * 1024 * 1024

#: Plausible bounds per field: (smallest, largest). Far beyond any published model, small
#: enough that per-layer loops and products stay instant.
BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 4096),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "hidden_size": (1, 1 << 20),
    "head_dim": (1, 1 << 14),
    "intermediate_size": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "shared_expert_intermediate_size": (1, 1 << 22),
    "vocab_size": (1, 1 << 24),
    "num_experts": (1, 1 << 16),
    "num_experts_per_tok": (1, 1 << 16),
    "n_shared_experts": (1, 1 << 10),
    "first_k_dense_replace": (1, 4096),
    "kv_lora_rank": (1, 1 << 16),
    "q_lora_rank": (1, 1 << 16),
    "qk_rope_head_dim": (1, 1 << 14),
    "qk_nope_head_dim": (1, 1 << 14),
    "v_head_dim": (1, 1 << 14),
    "sliding_window": (1, 1 << 31),
    "attention_chunk_size": (1, 1 << 31),
    "max_position_embeddings": (1, 1 << 34),
    "sliding_window_pattern": (1, 4096),
    "max_window_layers": (0, 4096),
}
#: Defaults of transformers' config classes (v5) for fields a ``config.json`` may leave out;
#: vLLM sees these values, so fleet must too. Only the fields the planner reads.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"max_position_embeddings": 8192, "sliding_window": 4096, "head_dim": 256, "vocab_size": 256000},
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window_pattern": 6,
    },
    "llama4_text": {"max_position_embeddings": 4096 * 32, "attention_chunk_size": 8192, "vocab_size": 202048},
    "mistral": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "llama": {"max_position_embeddings": 2048},
    "qwen2": {"max_position_embeddings": 32768},
}


def with_class_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with its model type's transformers defaults filled in where the file has no value."""
    defaults = CLASS_DEFAULTS.get(str(cfg.get("model_type")), {})
    return {**defaults, **cfg}


@dataclass(frozen=True)
class Checkpoint:
    """A model's ``config.json`` and what lies beside it."""

    path: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any] | None = None
    #: ``model.safetensors.index.json`` ``metadata.total_size``: bytes of all weights, exact
    weights_total_size: int | None = None


class ConfigReader:
    """Typed, bounded reads from one config dict; errors name the file and the field."""

    def __init__(self, cfg: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.cfg = cfg
        self.source = source
        self.prefix = prefix

    def _where(self, key: str) -> str:
        return f"{self.source}: {self.prefix}{key}"

    def fail(self, key: str, value: object, allowed: str) -> ModelConfigError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ModelConfigError(f"{self._where(key)}={shown}: {allowed}")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def integer(self, key: str, default: int | None = None, bounds: tuple[int, int] | None = None) -> int:
        """An integer field within its bounds; ``default`` when absent or null."""
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(f"{self._where(key)} is missing: config.json must give it (an integer)")
            return default
        lo, hi = bounds or BOUNDS.get(key, (1, 1 << 40))
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, value, f"must be an integer from {lo} to {hi}")
        if not lo <= value <= hi:
            raise self.fail(key, value, f"must be an integer from {lo} to {hi}")
        return value

    def optional_int(self, key: str, bounds: tuple[int, int] | None = None) -> int | None:
        return None if self.cfg.get(key) is None else self.integer(key, bounds=bounds)

    def first_int(self, keys: tuple[str, ...], default: int, bounds: tuple[int, int]) -> int:
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.integer(key, bounds=bounds)
        return default

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.cfg.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(key, value, "must be a finite number")
        return float(value)

    def string(self, key: str, default: str = "") -> str:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.fail(key, value, "must be a string")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any] | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, value, "must be a JSON object")
        return value

    def sub(self, key: str) -> ConfigReader | None:
        value = self.mapping(key)
        return None if value is None else ConfigReader(with_class_defaults(value), self.source, f"{self.prefix}{key}.")

    def items(self, key: str) -> list[Any] | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.fail(key, value, "must be a JSON list")
        return value


def read_json_object(path: Path, what: str = "config.json") -> dict[str, Any]:
    """A JSON object from ``path``, or ``ModelConfigError`` saying what is wrong with the file."""
    try:
        if path.is_dir():
            raise ModelConfigError(f"{path}: is a directory, not a {what} file")
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path}: {size} bytes; a {what} is at most {MAX_CONFIG_BYTES} bytes")
        raw = path.read_bytes()
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{path}: not UTF-8 (byte {exc.start}): a {what} is UTF-8 JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise ModelConfigError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: a {what} must be a JSON object, not a {type(data).__name__}")
    return data


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache directories, in the order ``huggingface_hub`` uses them."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    dirs.append(hf_home / "hub")
    return dirs


def _is_path(raw: str) -> bool:
    return raw.startswith(("/", ".", "~")) or raw.endswith(".json")


def find_config(model: str, explicit: str | None = None) -> Path:
    """Locate ``config.json`` for ``model`` without network; ``ModelConfigError`` names where it looked.

    An explicit ``model_config`` must exist and be a file (a directory holding ``config.json``
    is accepted): it is never silently replaced by another config.
    """
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            return path / "config.json"
        if path.is_dir():
            raise ModelConfigError(f"model_config {explicit!r}: is a directory with no config.json in it")
        if not path.is_file():
            raise ModelConfigError(
                f"model_config {explicit!r}: no such file. Set model_config to the model's config.json, "
                "or remove it to look the model up in the local Hugging Face cache"
            )
        return path
    looked: list[str] = []
    candidates: list[Path] = []
    if _is_path(model):
        path = Path(model).expanduser()
        candidates.append(path if path.suffix == ".json" else path / "config.json")
    elif "/" in model:
        repo = "models--" + model.replace("/", "--")
        for cache in hf_cache_dirs():
            snapshots = cache / repo / "snapshots"
            looked.append(str(snapshots))
            if snapshots.is_dir():
                candidates += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        candidates.append(BUNDLED_MODELS / model / "config.json")
    for candidate in candidates:
        looked.append(str(candidate))
        if candidate.is_file():
            return candidate
    raise ModelConfigError(
        f"no config.json for model {model!r}; looked in: {', '.join(dict.fromkeys(looked))}. "
        "Put the model in the local Hugging Face cache, or set model_config to a config.json path."
    )


def _index_total_size(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    data = read_json_object(index, "model.safetensors.index.json")
    meta = data.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total < 1 << 50:
        raise ModelConfigError(f"{index}: metadata.total_size={total!r}: must be a positive integer (bytes)")
    return total


def read_checkpoint(path: Path) -> Checkpoint:
    """``config.json`` at ``path`` and, beside it, the tokenizer config and safetensors index."""
    config = read_json_object(path)
    folder = path.parent
    tokenizer = folder / "tokenizer_config.json"
    tok = read_json_object(tokenizer, "tokenizer_config.json") if tokenizer.is_file() else None
    return Checkpoint(path, config, tok, _index_total_size(folder))
