"""``lora_adapters``: LoRA adapters planned with the GPU memory vLLM reserves for them, and their flags.

What vLLM 0.33 does, transcribed:

* with ``--enable-lora`` the worker wraps the model's layers once it is loaded
  (``GPUModelRunner.load_model`` calls ``load_lora_model`` inside the ``DeviceMemoryProfiler`` that
  measures the weights, ``vllm/v1/worker/gpu_model_runner.py``): the LoRA buffers are counted as
  weights, and whatever they take comes out of the KV cache;
* ``LoRAModelManager._create_lora_modules`` (``vllm/lora/model_manager.py``) wraps every linear
  layer (``get_supported_lora_modules``, ``vllm/lora/utils.py``), plus ``embed_tokens`` and the
  logits processor behind ``lm_head`` when the model class lists them in ``embedding_modules``
  (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``; not ``Qwen2ForCausalLM``,
  ``MistralForCausalLM``, ``Gemma2ForCausalLM``): ``EMBEDDING_LORA`` below;
* each wrapped layer allocates ``max_loras`` slots of ``max_lora_rank`` whatever the adapters'
  own ranks (``create_lora_weights``): for a column-parallel layer (``qkv_proj``, ``gate_up_proj``;
  ``vllm/lora/layers/base_linear.py`` and ``column_parallel_linear.py``) ``lora_a`` is
  ``max_loras × rank × input`` per packed slice (3 for q/k/v, 2 for gate/up, 1 where the checkpoint
  packs them itself, as Phi-3 does) and ``lora_b`` ``max_loras × output-per-GPU × rank`` per slice;
  for a row-parallel layer (``o_proj``, ``down_proj``; ``row_parallel_linear.py``) ``lora_a`` is
  ``max_loras × rank × input-per-GPU`` and ``lora_b`` ``max_loras × hidden × rank``; the embedding
  (``vocab_parallel_embedding.py``) ``max_loras × (vocab + hidden) × rank`` and the logits
  processor (``logits_processor.py``) ``max_loras × (hidden + vocab) × rank``, on every GPU (not
  split by TP); K/V heads fewer than the TP size are replicated (one per GPU), as
  ``QKVParallelLinear`` does; all in the model's dtype (``lora_dtype`` ``auto``);
* not counted: the punica kernels' metadata (a few int32 vectors of ``max_num_batched_tokens``:
  kilobytes) and the LoRA activations of the profile run (``max_num_batched_tokens × rank`` per
  slice: megabytes), within the plan's stated estimate bounds.

Refused (bad input, before any host is touched): MoE models (vLLM's ``FusedMoEWithLoRA`` slots are
per expert; fleet does not plan them yet), MLA attention and models with vision/audio towers
(other wrapped layers fleet does not count yet), and a vocabulary above 258048 (vLLM's
``LogitsProcessorWithLoRA`` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.errors import FieldProblem
from fleet.inventory.spec import HostSpec, LoraSpec
from fleet.model.arch import ModelArch

KEY = "lora_adapters"
#: ``LogitsProcessorWithLoRA.create_lora_weights``: "When using LoRA, vocab size must be <= 258048"
MAX_LORA_VOCAB = 258048
#: Model classes whose ``embedding_modules`` name ``embed_tokens`` and ``lm_head`` in vLLM 0.33
#: (``vllm/model_executor/models/llama.py``, ``qwen3.py``, ``phi3.py``); any other architecture
#: fleet plans is counted with them too (an upper bound, said in the reason) unless it is listed
#: in ``NO_EMBEDDING_LORA``.
EMBEDDING_LORA = frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"})
NO_EMBEDDING_LORA = frozenset({"Qwen2ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"})
#: Model classes whose checkpoints pack q/k/v and gate/up themselves (``packed_modules_mapping``
#: maps ``qkv_proj`` to ``["qkv_proj"]``): one LoRA slice each, not three and two.
PACKED_IN_CHECKPOINT = frozenset({"Phi3ForCausalLM"})


@dataclass(frozen=True)
class LoraCost:
    """What the LoRA slots cost on each GPU of one instance."""

    bytes_per_gpu: int
    per_layer: int  #: one decoder layer's slots on one GPU
    embeddings: int  #: the embedding's and the logits processor's slots on one GPU (0 when not wrapped)
    reason: str


def embeddings_wrapped(arch: ModelArch) -> bool:
    return not any(a in NO_EMBEDDING_LORA for a in arch.architectures)


def lora_bytes(arch: ModelArch, tp: int, rank: int, max_loras: int) -> tuple[int, int]:
    """(one decoder layer's, the embeddings') LoRA slot bytes on one GPU at TP ``tp``."""
    h, hd, b = arch.hidden_size, arch.head_dim, arch.dtype_bytes
    q_out = arch.num_attention_heads * hd // tp
    kv_out = max(1, arch.num_kv_heads // tp) * hd
    inter = arch.intermediate_size // tp
    packed = any(a in PACKED_IN_CHECKPOINT for a in arch.architectures)
    qkv = (1 if packed else 3) * rank * h + (q_out + 2 * kv_out) * rank
    o_proj = rank * q_out + h * rank
    gate_up = (1 if packed else 2) * rank * h + 2 * inter * rank
    down = rank * inter + h * rank
    layer = (qkv + o_proj + gate_up + down) * max_loras * b
    emb = 2 * (arch.vocab_size + h) * rank * max_loras * b if embeddings_wrapped(arch) else 0
    return layer, emb


def unsupported(arch: ModelArch) -> str | None:
    """Why fleet cannot plan LoRA for this model, or None."""
    if arch.is_moe:
        return (
            f"{arch.name} is a mixture-of-experts model: vLLM gives LoRA slots to every expert "
            "(FusedMoEWithLoRA), which fleet does not plan yet"
        )
    if arch.is_mla:
        return f"{arch.name} uses MLA attention, whose LoRA-wrapped projections fleet does not plan yet"
    if arch.tower_parameters:
        return f"{arch.name} has vision/audio towers, whose LoRA-wrapped layers fleet does not plan yet"
    if arch.vocab_size > MAX_LORA_VOCAB:
        return f"{arch.name} has vocab_size {arch.vocab_size}: vLLM refuses LoRA above {MAX_LORA_VOCAB}"
    return None


def lora_cost(lora: LoraSpec, arch: ModelArch, tp: int) -> LoraCost:
    """The LoRA slots' bytes per GPU at TP ``tp``, and how they were counted."""
    layer, emb = lora_bytes(arch, tp, lora.max_lora_rank, lora.max_loras)
    total = layer * arch.num_layers + emb
    where = (
        f"{arch.num_layers} layers × {layer:,} B (q/k/v, o, gate/up, down)"
        + (f" + embedding and logits {emb:,} B" if emb else "")
        + ("" if not emb or set(arch.architectures) & EMBEDDING_LORA else " (counted: architecture not known)")
    )
    return LoraCost(
        total,
        layer,
        emb,
        f"{lora.max_loras} slot(s) of rank {lora.max_lora_rank} on every wrapped layer: {where} = "
        f"{total / 2**30:.2f} GiB per GPU at TP {tp}, counted with the weights (vLLM allocates them when "
        "it loads the model)",
    )


def flags_reasons(lora: LoraSpec) -> dict[str, str]:
    """Why each LoRA flag has its value."""
    ranks = ", ".join(f"{a.name} {a.rank}" for a in lora.adapters)
    n = len(lora.adapters)
    return {
        "--max-lora-rank": (
            f"inventory max_lora_rank (adapters' ranks: {ranks})"
            if lora.rank_set_by_you
            else f"the smallest rank vLLM takes that holds every adapter ({ranks}); each slot is this size"
        ),
        "--max-loras": (
            "inventory max_loras: adapters in one batch"
            if lora.loras_set_by_you
            else f"all {n} adapter(s) in one batch (a GPU slot each; set max_loras to trade slots for KV cache)"
        ),
        "--max-cpu-loras": (
            "inventory max_cpu_loras"
            if lora.cpu_loras_set_by_you
            else f"every adapter ({n}) kept loaded in CPU memory, and at least max_loras ({lora.max_loras}), as vLLM "
            "requires"
        ),
    }


def field_problem(spec: HostSpec, arch: ModelArch) -> FieldProblem | None:
    """``unsupported`` as an inventory problem (file, host, field, value, why): bad input, before any host."""
    if spec.lora is None or (why := unsupported(arch)) is None:
        return None
    names = ", ".join(a.name for a in spec.lora.adapters)
    return FieldProblem(spec.source_of(KEY), spec.name, KEY, names, why + ": remove lora_adapters")
