"""vLLM 0.33.0's start-up checks and KV-cache arithmetic (vllm.md §2, §3), with vLLM's texts.

Written from the reference independently of fleet's planner: when the two disagree, one of
them is wrong, and the lab tests find out which.

Per GPU and per instance:

* Before measuring, each worker creates what vLLM creates first in ``Worker.init_device``
  (``vllm/v1/worker/gpu_worker.py``): its CUDA context (527 MiB per process on an H100 and an
  H200 with driver 580, measured: NVML shows it as the process's memory), NCCL's buffers when
  TP×PP > 1 and the cuBLAS/cuBLASLt handles. These stay outside the budget below.
* Then ``MemorySnapshot`` (CUDA's free and total: NVML total − the driver's reserve) and
  ``request_memory`` (``vllm/v1/worker/utils.py``): ``requested = ceil(total ×
  gpu_memory_utilization)``; start fails when free memory is below it.
* ``available_kv = requested − weights − non_torch − activation_peak − cudagraph``, where vLLM
  measures the last three by profiling. Nothing runs here, so they are estimated:

  - ``non_torch``: 0.35 GiB (the non-torch increase in the worked Llama-3.1-8B/H100 log of
    vllm.md §2.3);
  - ``activation_peak``: the dummy forward pass of ``max_num_batched_tokens`` tokens,
    ``tokens × (2·I/TP + 4·H) × dtype_bytes`` (gate/up projection output plus a few hidden-size
    buffers) plus the sampler's fp32 logits ``max_num_seqs × vocab × 4``. For Llama-3.1-8B on
    an H100 (8192 tokens, 1024 seqs) that is 1.18 GiB against 1.24 GiB measured in §2.3;
  - ``cudagraph``: 64 MiB + 8 MiB per layer on this stage, 0 with ``--enforce-eager``.

* KV bytes per token per GPU = ``2 × L_stage × max(1, n_kv // TP) × head_dim × kv_bytes``
  (MLA: ``L_stage × (kv_lora_rank + qk_rope_head_dim) × kv_bytes``); blocks of
  ``--block-size`` tokens; ``num_blocks = available // bytes_per_block``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from vllm.standin import lora
from vllm.standin.gpus import Gpu
from vllm.standin.log import StartupError
from vllm.standin.model import DTYPE_BYTES, ModelArch, weight_bytes_per_gpu

GiB = 1024**3
MiB = 1024**2
NON_TORCH_BYTES = int(0.35 * GiB)
#: A CUDA context on an H100/H200 (driver 580.159.04): measured as NVML process memory.
CUDA_CONTEXT_BYTES = 527 * MiB
#: cuBLAS + cuBLASLt handles and workspaces created before the snapshot (estimate: two 32 MiB
#: workspaces, PyTorch's Hopper default).
CUBLAS_BYTES = 64 * MiB
#: NCCL communicator buffers when TP×PP > 1 (estimate).
NCCL_BYTES = int(0.25 * GiB)
CUDAGRAPH_BASE_BYTES = 64 * MiB
CUDAGRAPH_PER_LAYER_BYTES = 8 * MiB
CONSERVING_MEMORY_URL = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"


def resolve_dtype(arch: ModelArch, requested: str, gpu: Gpu) -> str:
    """The model dtype vLLM would run with (``--dtype``, vllm.md §1.4)."""
    config = arch.config_dtype.replace("torch.", "")
    name = {"half": "float16", "float": "float32"}.get(requested, requested)
    bf16_ok = gpu.compute_capability >= (8, 0)
    if name == "auto":
        if config == "float32":
            return "bfloat16" if bf16_ok else "float16"
        if config == "bfloat16" and not bf16_ok:
            return "float16"
        return config if config in DTYPE_BYTES else "bfloat16"
    if name == "bfloat16" and not bf16_ok:
        major, minor = gpu.compute_capability
        raise StartupError(
            "ValueError",
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0. "
            f"Your {gpu.name} GPU has compute capability {major}.{minor}. You can use float16 instead "
            "by explicitly setting the `dtype` flag in CLI, for example: --dtype=half.",
        )
    return name


def kv_bytes_per_element(kv_cache_dtype: str, model_dtype: str) -> int:
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[model_dtype]
    if kv_cache_dtype.startswith(("fp8", "int8")):
        return 1
    if "fp4" in kv_cache_dtype or "4bit" in kv_cache_dtype or kv_cache_dtype.startswith("int4"):
        return 1  # packed 4-bit with scales: counted as 1 byte, an upper bound
    return DTYPE_BYTES.get(kv_cache_dtype, 2)


def check_max_model_len(arch: ModelArch, user_len: int | None, allow_long: bool) -> int | None:
    """Config-time check of ``--max-model-len``; returns the length (``None``: auto-fit)."""
    if user_len is None:
        return arch.derived_max_len
    if user_len == -1:
        return None
    if user_len > arch.derived_max_len and not allow_long:
        raise StartupError(
            "ValueError",
            f"User-specified max_model_len ({user_len}) is greater than the derived max_model_len "
            f"({arch.max_len_key}={arch.derived_max_len} or model_max_length={arch.model_max_length} in "
            "model's config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme "
            "caution. If the model uses relative position encoding (RoPE), positions exceeding "
            "derived_max_model_len lead to nan. If the model uses absolute position encoding, positions "
            "exceeding derived_max_model_len will cause a CUDA array out-of-bounds error.",
        )
    return user_len


def check_parallel(arch: ModelArch, tp: int, pp: int, num_gpus: int, nnodes: int = 1) -> None:
    """Config-time parallelism checks, in vLLM's order: world size (per node, with ``--nnodes``:
    ``ParallelConfig.local_world_size``, ``vllm/config/parallel.py``), then attention heads."""
    world = tp * pp
    if world % nnodes != 0:
        raise StartupError("ValueError", f"world_size ({world}) must be divisible by nnodes ({nnodes}).")
    if world // nnodes > num_gpus:
        raise StartupError(
            "ValueError",
            f"World size ({world}) is larger than the number of available GPUs ({num_gpus}) in this node. "
            "If this is intentional and you are using:\n"
            "- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately.",
        )
    if arch.num_heads % tp != 0:
        raise StartupError(
            "ValueError",
            f"Total number of attention heads ({arch.num_heads}) must be divisible by tensor parallel size ({tp}).",
        )


def check_kv_heads(arch: ModelArch, tp: int) -> None:
    """Model-construction check of ``QKVParallelLinear`` (replicate or split KV heads)."""
    if arch.use_mla:
        return
    if tp >= arch.num_kv_heads:
        if tp % arch.num_kv_heads != 0:
            raise StartupError("AssertionError", f"{tp} is not divisible by {arch.num_kv_heads}")
    elif arch.num_kv_heads % tp != 0:
        raise StartupError("AssertionError", f"{arch.num_kv_heads} is not divisible by {tp}")


def format_gib(nbytes: int) -> str:
    """vLLM's ``format_gib`` (``vllm/utils/mem_utils.py``): ``round(b / GiB, 2)`` as text."""
    return f"{round(nbytes / GiB, 2)}"


def baseline_bytes(world_size: int) -> int:
    """What a worker holds before its memory snapshot: context, cuBLAS, NCCL (TP×PP > 1)."""
    return CUDA_CONTEXT_BYTES + CUBLAS_BYTES + (NCCL_BYTES if world_size > 1 else 0)


def requested_memory(gpu: Gpu, utilization: float) -> int:
    """``ceil(total × utilization)`` with CUDA's total (``request_memory``)."""
    return math.ceil(gpu.total * utilization)


def check_free_memory(gpu: Gpu, utilization: float) -> int:
    """``request_memory`` in ``vllm/v1/worker/utils.py``: each worker on its own GPU, with the
    snapshot taken after its context exists; returns the requested bytes."""
    requested = requested_memory(gpu, utilization)
    if gpu.free < requested:
        raise StartupError(
            "ValueError",
            f"Free memory on device cuda:{gpu.cuda_index} ({format_gib(gpu.free)}/{format_gib(gpu.total)} GiB) "
            f"on startup is less than desired GPU memory utilization ({utilization}, "
            f"{format_gib(requested)} GiB). Decrease GPU memory utilization or reduce GPU memory used by "
            "other processes.",
        )
    return requested


def batch_defaults(gpu: Gpu) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` defaults of ``vllm serve`` by GPU class."""
    gib = gpu.total / GiB
    if gib >= 160:
        return 16384, 1024
    if gib >= 70 and "a100" not in gpu.name.lower() and "gb10" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


@dataclass
class Plan:
    """Everything the engine needs that comes out of the arithmetic."""

    model_dtype: str
    kv_dtype_bytes: int
    tp: int
    pp: int
    block_size: int
    utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    weight_bytes: int  #: per GPU
    non_kv_bytes: int  #: per GPU: non_torch + activation peak
    cudagraph_bytes: int
    kv_bytes_per_token: int  #: per GPU
    derived_max_len: int  #: the model's own limit (upper bound for auto-fit)
    max_model_len: int | None = None  #: ``None`` until auto-fit
    requested: int = 0  #: per GPU (minimum over ranks)
    available_kv: int = 0
    num_blocks: int = 0

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def kv_needed(self, length: int) -> int:
        return math.ceil(length / self.block_size) * self.bytes_per_block

    @property
    def kv_tokens(self) -> int:
        assert self.max_model_len is not None
        return int(self.max_concurrency * self.max_model_len)

    @property
    def max_concurrency(self) -> float:
        assert self.max_model_len is not None
        return self.num_blocks / math.ceil(self.max_model_len / self.block_size)


def make_plan(args: argparse.Namespace, arch: ModelArch, gpus: list[Gpu], max_model_len: int | None) -> Plan:
    """Static part of the plan (before any worker measured its GPU)."""
    tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
    used = gpus[: tp * pp]
    model_dtype = resolve_dtype(arch, str(args.dtype), used[0])
    dtype_bytes = DTYPE_BYTES[model_dtype]
    kv_bytes = kv_bytes_per_element(str(args.kv_cache_dtype), model_dtype)
    layers_stage = math.ceil(arch.num_layers / pp)
    if arch.use_mla:
        per_token = layers_stage * (arch.kv_lora_rank + arch.qk_rope_head_dim) * kv_bytes
    else:
        per_token = 2 * layers_stage * max(1, arch.num_kv_heads // tp) * arch.head_dim * kv_bytes

    default_tokens, default_seqs = batch_defaults(min(used, key=lambda g: g.total))
    if getattr(args, "performance_mode", None) == "throughput":
        default_tokens, default_seqs = default_tokens * 2, default_seqs * 2
    max_num_seqs = int(args.max_num_seqs or default_seqs)
    tokens = int(args.max_num_batched_tokens or default_tokens)
    length_for_cap = max_model_len or arch.derived_max_len
    if args.enable_chunked_prefill is False and not args.max_num_batched_tokens:
        tokens = max(length_for_cap, tokens)
    tokens = min(tokens, max_num_seqs * length_for_cap)
    max_num_seqs = min(max_num_seqs, tokens)

    weights = weight_bytes_per_gpu(arch, dtype_bytes, args.quantization, tp * pp)
    weights += lora.slot_bytes(args, arch, tp, dtype_bytes)  # measured with the weights, as vLLM does
    activation = tokens * (2 * arch.intermediate_size // tp + 4 * arch.hidden_size) * dtype_bytes
    activation += max_num_seqs * arch.vocab_size * 4
    non_torch = NON_TORCH_BYTES
    cudagraph = 0 if args.enforce_eager else CUDAGRAPH_BASE_BYTES + CUDAGRAPH_PER_LAYER_BYTES * layers_stage
    return Plan(
        model_dtype=model_dtype,
        kv_dtype_bytes=kv_bytes,
        tp=tp,
        pp=pp,
        block_size=int(args.block_size or 16),
        utilization=float(args.gpu_memory_utilization),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=tokens,
        weight_bytes=weights,
        non_kv_bytes=non_torch + activation,
        cudagraph_bytes=cudagraph,
        kv_bytes_per_token=per_token,
        derived_max_len=arch.derived_max_len,
        max_model_len=max_model_len,
    )


def estimate_max_model_len(plan: Plan, available: int, upper: int) -> int:
    """vLLM's binary search for the longest length whose KV fits ``available``."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if plan.kv_needed(mid) <= available:
            low = mid
        else:
            high = mid - 1
    return low


def size_kv_cache(
    plan: Plan, requested_per_rank: list[int], kv_cache_memory_bytes: int | None, blocks_override: int | None
) -> None:
    """Fill ``available_kv``, ``num_blocks`` and an auto-fit ``max_model_len``, or raise vLLM's errors.

    Across ranks the smallest budget wins (vLLM takes the minimum ``num_blocks``).
    """
    plan.requested = min(requested_per_rank)
    if kv_cache_memory_bytes is not None:
        available = int(kv_cache_memory_bytes)
    else:
        available = plan.requested - plan.weight_bytes - plan.non_kv_bytes - plan.cudagraph_bytes
    plan.available_kv = available
    if available <= 0:
        raise StartupError(
            "ValueError",
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            f"initializing the engine. See {CONSERVING_MEMORY_URL} for more details.",
        )
    if plan.max_model_len is None:  # --max-model-len auto
        fitted = estimate_max_model_len(plan, available, upper=plan.derived_max_len)
        if fitted < 1:
            raise StartupError("ValueError", "Cannot auto-fit max_model_len: not enough GPU memory.")
        plan.max_model_len = fitted
    needed = plan.kv_needed(plan.max_model_len)
    if needed > available:
        estimated = estimate_max_model_len(plan, available, plan.max_model_len)
        raise StartupError(
            "ValueError",
            f"To serve at least one request with the model's max seq len ({plan.max_model_len}), "
            f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({available / GiB:.2f} GiB). Based on the available memory, the estimated maximum "
            f"model length is {estimated}. Try increasing gpu_memory_utilization (which also controls CPU "
            "memory on the CPU backend) or decreasing max_model_len when initializing the engine. "
            f"See {CONSERVING_MEMORY_URL} for more details.",
        )
    plan.num_blocks = int(blocks_override) if blocks_override else available // plan.bytes_per_block
