"""``speculative``: speculative decoding planned with its memory, its refusals and its trade-off.

What vLLM 0.33 does, transcribed (``vllm/config/speculative.py``, ``SpeculativeConfig``):

* ``method`` ``ngram`` proposes tokens by looking the last n-gram up in the prompt
  (``prompt_lookup_min``/``prompt_lookup_max``, both 5 when neither is given, min <= max): no
  second model, no weights, no KV cache (``draft_model_config = target_model_config``);
* ``draft_model`` loads a second, smaller checkpoint; ``eagle``/``eagle3`` load an EAGLE head
  (one or a few decoder layers reading the target's hidden states); ``mtp`` drafts with the
  target's own multi-token-prediction layers (``num_nextn_predict_layers`` in its config.json,
  read as ``n_predict``): ``num_speculative_tokens`` above ``n_predict`` must be a multiple of it;
* the draft runs at the target's tensor-parallel size unless ``draft_tensor_parallel_size``
  says 1 (fleet does not set it: the draft is split like the target);
* the draft's attention layers get KV cache from the same pool as the target's: the drafter's
  layers are in the KV-cache spec the worker reports (``GPUModelRunner.get_kv_cache_spec``), and
  layers of one kind go into one group (``get_kv_cache_groups``, ``vllm/v1/core/kv_cache_planning.py``:
  one spec for all, or ``UniformTypeKVCacheSpecs`` whose ``page_size_bytes`` is the sum of every
  layer's page, ``vllm/v1/kv_cache_interface.py``). So one block costs the target's layers plus the
  draft's, and ``num_blocks = available // (target + draft bytes per block)``: the draft's KV takes
  its share of every block. For a target with hybrid (sliding-window) groups fleet applies the same
  share to its blocks: an approximation, said here;
* not counted: the drafter's own activation peak and CUDA graphs (small next to the target's;
  within the plan's stated estimate bounds for a draft much smaller than the target).

Refused, before any host is touched: a draft whose ``vocab_size`` differs from the target's (vLLM
verifies proposed token ids against the target's vocabulary; a different tokenizer proposes
nonsense, and ``use_heterogeneous_vocab`` is not planned), ``mtp`` on a model without MTP layers,
``eagle``/``eagle3`` with a checkpoint that is not an EAGLE head, an ``mtp`` token count vLLM
refuses.

The trade-off (vLLM's "Speculative Decoding" page: it "reduces inter-token latency in
memory-bound LLM inference"): each decode step verifies ``num_speculative_tokens + 1`` tokens per
sequence for the price of one weight read. That pays while a decode step is memory-bound, i.e.
at low batch sizes; once ``sequences × (k + 1)`` tokens per step make the matrix products
compute-bound, the rejected tokens are paid in compute and throughput drops. The knee: a 16-bit
GEMM does one FLOP per weight byte per token, and an H100 SXM does 989 TFLOP/s (dense BF16) over
3.35 TB/s, ~295 FLOP per byte (NVIDIA H100 datasheet); fleet takes 256 tokens per step as the
point past which speculation is likely a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleet.errors import FieldProblem
from fleet.inventory.spec import HostSpec, SpeculativeSpec
from fleet.model.arch import ModelArch, load_model

#: Tokens per decode step past which a step is compute-bound (see the module docstring).
COMPUTE_BOUND_TOKENS = 256
KEY = "speculative"


@dataclass(frozen=True)
class DraftCost:
    """What the draft costs on each GPU of one instance."""

    weights: int  #: bytes per GPU
    kv_bytes_per_block: int  #: the draft's layers' pages in one KV block on one GPU
    layers: int  #: the draft's attention layers
    reason: str


def needs_draft_model(sp: SpeculativeSpec) -> bool:
    return sp.model is not None


def problem(sp: SpeculativeSpec, target: ModelArch, draft: ModelArch | None) -> tuple[str, str] | None:
    """(field, why) when vLLM would refuse or misuse this speculative config, or None."""
    if sp.method == "mtp":
        if target.mtp_layers == 0:
            return (
                f"{KEY}.method",
                f"{target.name} has no multi-token-prediction layers (no num_nextn_predict_layers in its "
                "config.json): use method ngram, or draft_model with a small model of the same family",
            )
        n = target.mtp_layers
        if sp.num_speculative_tokens > n and sp.num_speculative_tokens % n:
            return (
                f"{KEY}.num_speculative_tokens",
                f"{sp.num_speculative_tokens}: vLLM requires a multiple of the model's {n} MTP layer(s) above {n}",
            )
        return None
    if draft is None:
        return None
    if draft.vocab_size != target.vocab_size:
        return (
            f"{KEY}.model",
            f"{draft.name} has vocab_size {draft.vocab_size}, {target.name} {target.vocab_size}: a draft must share "
            "the target's tokenizer (vLLM checks proposed token ids against the target's); use a draft of the same "
            "family, or method ngram",
        )
    eagle_head = any("eagle" in a.lower() for a in draft.architectures) or "eagle" in draft.name.lower()
    if sp.method in ("eagle", "eagle3") and not eagle_head:
        return (
            f"{KEY}.model",
            f"{draft.name} is not an EAGLE head (architectures {list(draft.architectures)}): method {sp.method} "
            "needs a head trained for the target (e.g. an EAGLE3 checkpoint); for an ordinary small model use "
            "method draft_model",
        )
    return None


def _draft_weights(sp: SpeculativeSpec, target: ModelArch, draft: ModelArch | None) -> tuple[int, str]:
    """Bytes of the whole draft's weights (before TP), and how they were counted."""
    if sp.method == "ngram":
        return 0, "n-gram lookup in the prompt: no draft weights"
    if sp.method == "mtp":
        if target.checkpoint_bytes is not None:
            return 0, f"{target.mtp_layers} MTP layer(s) already in the checkpoint's size"
        per_layer = (target.parameters - target.embedding_parameters) // max(1, target.num_layers)
        return per_layer * target.mtp_layers * 2, f"{target.mtp_layers} MTP layer(s) of the target, 16-bit (estimated)"
    assert draft is not None
    if draft.checkpoint_bytes is not None:
        return draft.checkpoint_bytes, f"{draft.name}: checkpoint safetensors index, {draft.checkpoint_bytes:,} bytes"
    per_param = draft.quantization.bytes_per_param if draft.quantization is not None else 2
    params = draft.parameters
    shared = ""
    if sp.method in ("eagle", "eagle3"):
        params -= draft.embedding_parameters  # vLLM shares the target's embedding and LM head with the head
        shared = ", embeddings shared with the target"
    return int(params * per_param), f"{draft.name}: {params / 1e9:.2f}B parameters{shared}"


def draft_cost(sp: SpeculativeSpec, target: ModelArch, draft: ModelArch | None, tp: int, kv_bytes: int) -> DraftCost:
    """The draft's weights per GPU and its KV pages per block at tensor-parallel size ``tp``."""
    weights, counted = _draft_weights(sp, target, draft)
    if sp.method == "ngram":
        return DraftCost(0, 0, 0, counted + ", no KV cache")
    if sp.method == "mtp":
        layers, page = target.mtp_layers, target.page_bytes(tp, kv_bytes)
    else:
        assert draft is not None
        layers, page = draft.num_layers, draft.page_bytes(tp, kv_bytes)
    per_gpu = -(-weights // tp)
    return DraftCost(
        per_gpu,
        layers * page,
        layers,
        f"{counted}; {per_gpu / 2**30:.2f} GiB per GPU at TP {tp}; its {layers} attention layer(s) add "
        f"{layers * page:,} B to every KV block (vLLM gives the draft's layers pages of the same blocks)",
    )


def verdict(sp: SpeculativeSpec, per_instance_concurrency: int) -> tuple[bool, str]:
    """(likely a loss, why): the trade-off at the workload's concurrency on one instance."""
    k = sp.num_speculative_tokens
    step = per_instance_concurrency * (k + 1)
    if step > COMPUTE_BOUND_TOKENS:
        return True, (
            f"speculative decoding is likely a loss here: the workload's {per_instance_concurrency} requests per "
            f"instance × {k + 1} tokens verified each = {step} tokens per decode step, past the ~"
            f"{COMPUTE_BOUND_TOKENS} at which a step is compute-bound; rejected drafts then cost throughput. It pays "
            "at low batch sizes: lower the target concurrency per instance, fewer speculative tokens, or remove "
            "speculative"
        )
    return False, (
        f"{per_instance_concurrency} requests per instance × {k + 1} tokens verified = {step} tokens per decode "
        f"step, under the ~{COMPUTE_BOUND_TOKENS} at which a step turns compute-bound: speculation pays at such "
        "low batch sizes (lower inter-token latency when drafts are accepted)"
    )


def draft_key(spec: HostSpec) -> tuple[str, str | None] | None:
    """(model, config path) of the host's draft model, for ``load_model``; None: no second checkpoint."""
    sp = spec.speculative
    if sp is None or sp.model is None:
        return None
    return sp.model, sp.model_config


def load_draft(spec: HostSpec, loader: Callable[[str, str | None], ModelArch] = load_model) -> ModelArch | None:
    """The draft's architecture read from its config.json (``ModelConfigError`` names the file)."""
    key = draft_key(spec)
    return loader(*key) if key is not None else None


def field_problem(spec: HostSpec, target: ModelArch, draft: ModelArch | None) -> FieldProblem | None:
    """``problem`` as an inventory problem (file, host, field, value, why): bad input, before any host."""
    sp = spec.speculative
    if sp is None:
        return None
    found = problem(sp, target, draft)
    if found is None:
        return None
    fld, why = found
    value = {f"{KEY}.model": sp.model, f"{KEY}.method": sp.method}.get(fld, sp.num_speculative_tokens)
    return FieldProblem(spec.source_of(KEY), spec.name, fld, value, why)
