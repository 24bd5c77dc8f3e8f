"""vLLM 0.33's KV-cache arithmetic per GPU: layer kinds, hybrid groups, blocks and tokens.

Transcribed from vLLM 0.33.0:

* page size of one attention layer (``AttentionSpec.page_size_bytes``,
  ``vllm/v1/kv_cache_interface.py``): ``block_size × kv_heads_per_gpu × (head_size +
  head_size_v) × dtype_bytes``; ``kv_heads_per_gpu = max(1, kv_heads // TP)``
  (``ModelConfig.get_num_kv_heads``); MLA keeps one latent head of ``kv_lora_rank +
  qk_rope_head_dim`` and no V (``MLAAttentionSpec``), not split by TP;
* what one request of ``max_model_len`` tokens holds per layer
  (``max_memory_usage_bytes``): full attention ``cdiv(max_len, block)`` pages; sliding window
  ``cdiv(min(window − 1 + tokens in flight, max_len), block) + 1`` pages
  (``SlidingWindowSpec.max_admission_blocks_per_request``), where tokens in flight are
  ``max_concurrent_batches × max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``; 2
  batches under the default async scheduling);
* grouping (``get_kv_cache_groups`` and ``_get_kv_cache_groups_uniform_page_size``,
  ``vllm/v1/core/kv_cache_planning.py``): one group when every layer has the same spec or the
  same kind; otherwise layers are bucketed by kind and window, the group size is the smallest
  bucket (the largest when it is less than 1.5 × the smallest), each bucket is split into
  ``cdiv(n, group size)`` groups and the last one padded ("Add N padding layers"). A block
  holds one page of every layer slot of a group, so ``bytes per block = group size × page``;
* chunked local attention (Llama 4) turns the hybrid manager off by default
  (``VllmConfig`` "latency regression when using chunked local attention"): every layer is
  then sized as full attention (``unify_hybrid_kv_cache_specs``);
* ``num_blocks = available // bytes per block`` (``get_kv_cache_config_from_groups``); the
  token capacity vLLM logs is ``int(num_blocks / Σ_groups pages per request × max_len)``
  (``get_kv_cache_capacity``); the start check needs ``available − one block ≥ Σ_groups
  pages per request × bytes per block`` (``get_kv_cache_configs``, null block held back).

Layer kinds come from the config the way transformers v5 builds ``layer_types`` for each model
family (Gemma 2/3, Cohere 2, Qwen 2/3, Llama 4, gpt-oss, Mistral-style all-sliding models).
Only models whose attention layers share one page size are covered (all of those); models with
linear-attention or Mamba layers are refused with a clear error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from fleet.errors import ModelConfigError
from fleet.model.config import ConfigReader

BLOCK_SIZE = 16  #: vLLM's default KV block size (tokens) on CUDA
#: Batches in flight under vLLM 0.33's default async scheduling (``max_concurrent_batches``).
ASYNC_BATCHES = 2


class LayerKind(StrEnum):
    """How one attention layer keeps its KV cache in vLLM."""

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"


_LAYER_TYPES = {
    "full_attention": LayerKind.FULL,
    "sliding_attention": LayerKind.SLIDING,
    "chunked_attention": LayerKind.CHUNKED,
}
#: Model types whose transformers config derives ``layer_types`` from a repeating pattern.
_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_QWEN_SLIDING = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_kinds(text: ConfigReader, model_type: str, num_layers: int) -> tuple[LayerKind, ...]:
    """The attention kind of every layer, as vLLM's model code reads the transformers config."""
    types = text.items("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise text.fail("layer_types", f"{len(types)} entries", f"must list one type per layer ({num_layers})")
        kinds = []
        for i, name in enumerate(types):
            if name not in _LAYER_TYPES:
                raise ModelConfigError(
                    f"{text.source}: {text.prefix}layer_types[{i}]={name!r}: fleet plans only attention layers "
                    f"({', '.join(_LAYER_TYPES)}); models with linear-attention or state-space layers are not "
                    "supported"
                )
            kinds.append(_LAYER_TYPES[name])
        if LayerKind.SLIDING in kinds and not text.has("sliding_window"):
            raise text.fail("sliding_window", None, "layer_types has sliding_attention layers: give the window size")
        if LayerKind.CHUNKED in kinds and not text.has("attention_chunk_size"):
            raise text.fail("attention_chunk_size", None, "layer_types has chunked_attention layers: give its size")
        return tuple(kinds)
    if text.has("attention_chunk_size"):  # Llama 4: RoPE layers are chunked, NoPE layers global
        no_rope = text.items("no_rope_layers")
        interval = text.integer("no_rope_layer_interval", 4, bounds=(1, 4096))
        if not no_rope:
            no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(no_rope) != num_layers:
            raise text.fail("no_rope_layers", f"{len(no_rope)} entries", f"must list one flag per layer ({num_layers})")
        return tuple(LayerKind.CHUNKED if flag else LayerKind.FULL for flag in no_rope)
    window = text.has("sliding_window") and text.boolean("use_sliding_window", True)
    if not window:
        return (LayerKind.FULL,) * num_layers
    pattern = _PATTERN_DEFAULTS.get(model_type)
    if text.has("sliding_window_pattern"):
        pattern = text.integer("sliding_window_pattern")
    if pattern is not None:
        return tuple(LayerKind.SLIDING if (i + 1) % pattern else LayerKind.FULL for i in range(num_layers))
    if model_type in _QWEN_SLIDING:
        first = text.integer("max_window_layers", num_layers, bounds=(0, 4096))
        return tuple(LayerKind.SLIDING if i >= first else LayerKind.FULL for i in range(num_layers))
    return (LayerKind.SLIDING,) * num_layers


@dataclass(frozen=True)
class KvGroup:
    """One KV-cache group: layer slots sharing a block table."""

    kind: LayerKind
    layers: int  #: real layers in the group
    slots: int  #: layer slots (layers + padding)
    window: int | None = None


@dataclass(frozen=True)
class KvLayout:
    """vLLM's KV-cache groups on one GPU, and what a block and a request cost."""

    groups: tuple[KvGroup, ...]
    page_bytes: int  #: one layer's page (``BLOCK_SIZE`` tokens) on one GPU
    hybrid: bool  #: vLLM's hybrid manager sizes windowed layers by their window
    block_size: int = BLOCK_SIZE

    @property
    def bytes_per_block(self) -> int:
        """The largest group's pages: every group draws its blocks from one shared pool."""
        return max(g.layers for g in self.groups) * self.page_bytes

    @property
    def padding_layers(self) -> int:
        return sum(g.slots - g.layers for g in self.groups)

    def pages_per_request(self, max_len: int, in_flight_tokens: int) -> int:
        """Σ over groups of the blocks one request of ``max_len`` tokens holds."""
        total = 0
        for g in self.groups:
            if g.kind is LayerKind.SLIDING and g.window is not None:
                tokens = min(g.window - 1 + in_flight_tokens, max_len)
                total += cdiv(tokens, self.block_size) + 1
            elif g.kind is LayerKind.CHUNKED and g.window is not None:
                total += cdiv(min(g.window + in_flight_tokens, max_len), self.block_size)
            else:
                total += cdiv(max_len, self.block_size)
        return total

    def num_blocks(self, kv_budget: int) -> int:
        return max(0, kv_budget) // self.bytes_per_block

    def tokens(self, kv_budget: int, max_len: int, in_flight_tokens: int) -> int:
        """The ``GPU KV cache size: N tokens`` vLLM logs for this budget."""
        per_request = self.pages_per_request(max_len, in_flight_tokens)
        return int(self.num_blocks(kv_budget) / per_request * max_len)

    def fits_one_request(self, kv_budget: int, max_len: int, in_flight_tokens: int) -> bool:
        """vLLM's start check: one request of ``max_len`` fits, the null block held back."""
        if kv_budget <= 0:
            return False
        needed = self.bytes_per_block * self.pages_per_request(max_len, in_flight_tokens)
        return needed <= kv_budget - self.bytes_per_block

    def bytes_per_token(self, max_len: int, in_flight_tokens: int) -> float:
        """Average KV bytes one token of a ``max_len`` request costs on this GPU."""
        return self.bytes_per_block * self.pages_per_request(max_len, in_flight_tokens) / max_len

    def describe(self) -> str:
        if len(self.groups) == 1 and not self.hybrid:
            g = self.groups[0]
            return f"one KV group of {g.layers} layers × {self.page_bytes:,} B per {self.block_size}-token page"
        parts = []
        for kind, count in Counter((g.kind, g.window) for g in self.groups).items():
            k, w = kind
            label = f"{k.value}" + (f" (window {w})" if w else "")
            parts.append(f"{count} × {label}")
        slots = max(g.slots for g in self.groups)
        pad = f", {self.padding_layers} padding layer(s)" if self.padding_layers else ""
        return (
            f"hybrid KV groups of {slots} layer slots: {', '.join(parts)}{pad}; block = {slots} × {self.page_bytes:,} B"
        )


def kv_layout(kinds: tuple[LayerKind, ...], page_bytes: int, window: int | None, chunk: int | None) -> KvLayout:
    """vLLM 0.33's grouping of these layers (see the module docstring)."""
    n = len(kinds)
    if LayerKind.CHUNKED in kinds:  # hybrid manager off by default: all layers full-size
        return KvLayout((KvGroup(LayerKind.FULL, n, n),), page_bytes, hybrid=False)
    buckets = Counter(kinds)
    if len(buckets) == 1:
        kind = kinds[0]
        return KvLayout((KvGroup(kind, n, n, window if kind is LayerKind.SLIDING else None),), page_bytes, hybrid=False)
    smallest, largest = min(buckets.values()), max(buckets.values())
    size = largest if largest < smallest * 1.5 else smallest
    groups: list[KvGroup] = []
    for kind in dict.fromkeys(kinds):  # vLLM buckets in order of first appearance
        count = buckets[kind]
        parts = cdiv(count, size)
        w = window if kind is LayerKind.SLIDING else chunk if kind is LayerKind.CHUNKED else None
        for i in range(parts):
            real = len(range(i, count, parts))  # vLLM assigns layers[i::parts]
            groups.append(KvGroup(kind, real, size, w))
    return KvLayout(tuple(groups), page_bytes, hybrid=True)
