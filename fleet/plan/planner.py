"""The serving planner: from (host spec, GPUs, model architecture) to vLLM instances and flags.

A pure function of its inputs. It decides the weight precision, the tensor-parallel size and
GPU groups, ``--max-model-len``, ``--gpu-memory-utilization`` and the rest, and keeps the memory
arithmetic behind every number so ``fleet plan`` can show it. A plan that cannot work raises
``PlanError`` naming the host, the numbers and the ways out — before any host is touched.

What is vLLM 0.33's own arithmetic, transcribed:

* the budget is ``ceil(CUDA total × --gpu-memory-utilization)`` (``request_memory``,
  ``vllm/v1/worker/utils.py``), where CUDA's total (``cudaMemGetInfo``) is NVML's total minus
  the driver's reserve: a probed host's NVML v2 ``reserved``, else the catalogue's (measured on
  H100 80GB and H200, a stated conservative estimate otherwise);
* vLLM refuses to start when free memory, read after its own CUDA context exists, is below
  that budget: utilization is lowered for memory already in use, counting that context;
* KV pages, hybrid groups, blocks, tokens and the one-request check (``fleet.model.kv``), the
  derived maximum length (``fleet.model.max_len``), the TP rules (``ModelArch.tp_problem``, and
  for block-quantized FP8 checkpoints ``fleet.model.fp8_blocks``, which depends on the GPUs too).

What is estimated, and said so in every plan: the non-torch memory, the activation peak of
vLLM's profiling run and the CUDA-graph memory (vLLM measures these on the GPU at start).

Decisions:

* weights = the checkpoint's safetensors size when known, else parameters × bytes per
  parameter of the served precision; embeddings and the LM head stay 16-bit in quantized
  checkpoints and under online FP8;
* TP satisfies vLLM's divisibility rules, is a power of two, stays in one NVLink island; across
  PCIe-only GPUs every GPU gets its own instance; GPUs left over become more instances;
* ``--max-model-len`` = p95 input + output rounded up to the block size, capped by the model;
  at least one sequence of that length must fit in the KV cache.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fleet.errors import PlanError, PlanProblem
from fleet.gpus import ESTIMATED_RESERVE, Fabric, GiB, HostGpus, MiB
from fleet.inventory.spec import HostSpec
from fleet.model.arch import ModelArch
from fleet.model.fp8_blocks import NATIVE_FP8, fp8_blocks
from fleet.model.kv import ASYNC_BATCHES, BLOCK_SIZE, KvLayout, LayerKind, kv_layout
from fleet.plan.cuda import CudaPlan, plan_cuda
from fleet.plan.extra_args import SET_BY_YOU_REASON, parse_extra_args
from fleet.plan.lora import LoraCost, flags_reasons, lora_cost, unsupported
from fleet.plan.presets import Batch, preset_batch
from fleet.plan.speculative import DraftCost, draft_cost, verdict
from fleet.plan.speculative import problem as speculative_problem
from fleet.plan.vllm_surface import SurfaceError, known_versions, parse_serve_argv

DEFAULT_UTILIZATION = 0.90
FREE_MEMORY_MARGIN = 0.01  #: keep 1% below what is free when lowering utilization
#: GPU memory one CUDA context takes (NVML v2 ``used`` after torch initialises CUDA: 527 MiB on
#: H100 80GB and H200, driver 580). vLLM reads free memory after creating its context.
CUDA_CONTEXT_BYTES = 527 * MiB
#: Non-torch memory per GPU (CUDA context, cuBLAS, NCCL). A published vLLM log of Llama-3.1-8B on an H100 shows
#: 0.35 GiB for one GPU; NCCL buffers add roughly half a GiB once TP > 1.
NON_TORCH_BYTES = int(0.35 * GiB)
NCCL_BYTES = int(0.5 * GiB)
#: CUDA-graph memory vLLM 0.33 estimates and subtracts (profiling on by default since 0.21).
CUDA_GRAPH_BYTES = int(0.5 * GiB)
#: Activation peak of the profiling run per batched token, relative to the MLP and hidden
#: widths; calibrated on the published Llama-3.1-8B/H100 log (1.24 GiB at 8192 tokens).
ACTIVATION_FACTOR = 1.8
#: How far the estimates may be off, stated in every plan: the activation peak ±50% (one
#: calibration point), CUDA graphs 0.5 GiB for a measured 0.2–1.5 GiB, non-torch ±0.25 GiB.
ACTIVATION_ERROR = 0.5
CUDA_GRAPH_RANGE = (int(0.2 * GiB), int(1.5 * GiB))
NON_TORCH_ERROR = int(0.25 * GiB)


#: ``Flag.set_by`` of the flags fleet plans; an inventory's ``vllm_extra_args`` are ``"you"``.
SET_BY_FLEET = "fleet"
SET_BY_YOU = "you"


@dataclass(frozen=True)
class Flag:
    """One ``vllm serve`` option, its value, and why it has that value."""

    option: str
    value: str | None
    reason: str
    more: tuple[str, ...] = ()  #: further values of a flag that takes several (``nargs='+'``)
    set_by: str = SET_BY_FLEET  #: "fleet" (planned) or "you" (``vllm_extra_args``)

    def argv(self) -> list[str]:
        return ([self.option] if self.value is None else [self.option, self.value]) + list(self.more)


@dataclass(frozen=True)
class MemoryMath:
    """Per-GPU memory arithmetic of one instance, in bytes (vLLM sizes each GPU alike)."""

    gpu_total: int  #: CUDA's total (``cudaMemGetInfo``): what vLLM multiplies by utilization
    utilization: float
    budget: int
    weights: int
    non_torch: int
    activation_peak: int
    cuda_graphs: int
    kv_budget: int
    kv_bytes_per_token: int  #: all layers at full attention (vLLM's page size / block size)
    kv_tokens: int  #: vLLM's ``GPU KV cache size: N tokens``
    max_model_len: int
    kv_tokens_per_request: int
    nvml_total: int = 0  #: NVML's total
    reserved: int = 0  #: the driver's reserve: NVML total − CUDA total
    reserve_source: str = ""  #: "probe", "measured", or "estimate"
    kv_layout: KvLayout | None = None
    kv_blocks: int = 0
    one_request_fits: bool = True  #: vLLM's start check for one ``max_model_len`` request
    in_flight_tokens: int = 0
    #: how many KV tokens the estimated terms could move this plan, either way
    kv_tokens_uncertainty: int = 0
    draft: DraftCost | None = None  #: the speculative draft's share (``fleet.plan.speculative``); in ``weights``
    lora: LoraCost | None = None  #: the LoRA adapters' GPU slots (``fleet.plan.lora``); in ``weights``
    #: vLLM's CPU build (``vllm_cpu``): its KV cache is this many GiB (``VLLM_CPU_KVCACHE_SPACE``), not
    #: what is left of a GPU budget; ``kv_budget`` and the KV fields are then that arithmetic
    #: (``cpu_memory``) and the GPU fields are not used. 0: the GPU arithmetic.
    cpu_kv_cache_gib: int = 0

    @property
    def max_concurrency(self) -> float:
        """vLLM's ``Maximum concurrency for max_model_len tokens per request``."""
        return self.kv_tokens / self.max_model_len if self.max_model_len else 0.0

    @property
    def workload_concurrency(self) -> int:
        """Requests of the workload's p95 size whose KV fits at once (shared prefixes counted once)."""
        return self.kv_tokens // max(1, self.kv_tokens_per_request)

    @property
    def fits(self) -> bool:
        return self.kv_budget > 0 and self.one_request_fits and self.kv_tokens > 0

    @property
    def estimate_bounds(self) -> int:
        """Bytes per GPU by which the estimated terms (non-torch, activations, graphs) may be off."""
        graphs = max(self.cuda_graphs - CUDA_GRAPH_RANGE[0], CUDA_GRAPH_RANGE[1] - self.cuda_graphs)
        return NON_TORCH_ERROR + int(self.activation_peak * ACTIVATION_ERROR) + graphs


@dataclass(frozen=True)
class NodeRole:
    """This host's part of an instance spanning hosts (``fleet.plan.multinode``): one pipeline stage."""

    rank: int  #: vLLM's ``--node-rank``; rank 0 leads (serves the API), the others run ``--headless``
    hosts: tuple[str, ...]  #: every node's host, in rank order
    layers: tuple[int, int]  #: this stage's decoder layers [start, end) (vLLM's ``get_pp_indices``)
    partition: tuple[int, ...]  #: layers per stage, in rank order
    master: str  #: ``address:port`` of the leader's rendezvous (``--master-addr``/``--master-port``)
    #: the instance's KV cache: vLLM gives every rank the smallest rank's block count
    #: (``get_kv_cache_configs``), so these are the instance's tokens, equal on every node
    instance_kv_tokens: int
    instance_kv_blocks: int

    @property
    def leader(self) -> str:
        return self.hosts[0]

    @property
    def headless(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process on a group of GPUs (for a multi-node instance: this host's node of it)."""

    index: int
    gpus: tuple[int, ...]
    tensor_parallel_size: int
    port: int
    model: str
    flags: tuple[Flag, ...]
    env: tuple[tuple[str, str], ...]
    memory: MemoryMath
    node: NodeRole | None = None  #: None: the instance runs on this host alone

    @property
    def serves(self) -> bool:
        """Whether this process serves the API (a single-host instance, or a multi-node leader)."""
        return self.node is None or not self.node.headless

    @property
    def kv_tokens(self) -> int:
        """The instance's KV-cache tokens (a multi-node instance's: the smallest rank's blocks)."""
        return self.node.instance_kv_tokens if self.node is not None else self.memory.kv_tokens

    @property
    def workload_concurrency(self) -> int:
        return self.kv_tokens // max(1, self.memory.kv_tokens_per_request)

    @property
    def argv(self) -> list[str]:
        """Arguments after ``vllm serve``."""
        out = [self.model]
        for flag in self.flags:
            out += flag.argv()
        return out

    @property
    def unit_name(self) -> str:
        return f"vllm-{self.index}"


@dataclass(frozen=True)
class HostPlan:
    """The serving plan of one host."""

    host: str
    model: str
    model_source: str
    gpus_source: str
    vllm_version: str
    weights_precision: str
    weight_bytes: int
    instances: tuple[Instance, ...]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    idle_gpus: tuple[int, ...] = field(default=())
    #: CUDA packages from NVIDIA's repository and cuda-compat (``fleet.plan.cuda``)
    cuda: CudaPlan = field(default=CudaPlan())
    #: a host with ``models``: each entry's own plan on its GPUs (``fleet.plan.models``); the
    #: fields above are then the whole host's (``instances``: every entry's, numbered across the host)
    models: tuple[ModelPlan, ...] = ()

    @property
    def total_kv_tokens(self) -> int:
        """KV tokens of the instances this host serves (a multi-node instance counts at its leader)."""
        return sum(i.kv_tokens for i in self.instances if i.serves)

    @property
    def workload_concurrency(self) -> int:
        return sum(i.workload_concurrency for i in self.instances if i.serves)


@dataclass(frozen=True)
class ModelPlan:
    """One ``models`` entry of a host: its GPUs and its own plan there (``fleet.plan.models``)."""

    entry: int  #: its place in the host's ``models``
    model: str
    served_name: str  #: what its instances answer to (``/v1/models``)
    gpus: tuple[int, ...]  #: the GPUs given to it (a contiguous range of indices)
    plan: HostPlan  #: planned by ``plan_host`` on those GPUs alone; its instances as the host numbers them


# -- small pure pieces ----------------------------------------------------------------------------


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class Precision:
    """How the weights are served: bytes per parameter and the flags that say so."""

    name: str
    bytes_per_param: float
    flags: tuple[Flag, ...]
    reason: str


def resolve_precision(spec: HostSpec, arch: ModelArch) -> Precision:
    """Decide the served weight precision, or raise ``PlanError`` when vLLM cannot serve it."""
    want = spec.weights
    quant = arch.quantization
    if quant is not None:
        ckpt = {4.0: "int4", 8.0: "fp8" if "fp8" in quant.method else "int8"}.get(quant.bits, f"{quant.bits:g}-bit")
        if want not in ("auto", ckpt) and not (want == "int8" and quant.bits == 8):
            raise PlanError(
                PlanProblem(
                    spec.name,
                    f"weights={want} but the checkpoint is already quantized ({quant.method}, {quant.bits:g}-bit)",
                    ways_out=[
                        "set weights: auto (vLLM reads quantization_config)",
                        "use an unquantized checkpoint",
                    ],
                )
            )
        return Precision(
            ckpt,
            quant.bytes_per_param,
            (),
            f"checkpoint is pre-quantized ({quant.method}, {quant.bits:g}-bit); vLLM detects it, "
            "so no --quantization flag",
        )
    native = "fp16" if arch.dtype in ("float16", "half") else "bf16"
    if want in ("auto", native):
        note = " (vLLM's --dtype auto serves an FP32 checkpoint as BF16)" if arch.dtype in ("float32", "float") else ""
        return Precision(native, 2, (), f"checkpoint dtype {arch.dtype}, served as {native}{note}")
    if want in ("bf16", "fp16"):
        dtype = "bfloat16" if want == "bf16" else "float16"
        return Precision(want, 2, (Flag("--dtype", dtype, f"inventory asks for {want} weights"),), f"served as {want}")
    if want == "fp8":
        return Precision(
            "fp8",
            1,
            (Flag("--quantization", "fp8", "online FP8 of a 16-bit checkpoint halves weight memory"),),
            "online FP8 (weights 1 byte; embeddings stay 16-bit)",
        )
    raise PlanError(
        PlanProblem(
            spec.name,
            f"weights={want}: vLLM cannot quantize a {arch.dtype} checkpoint to {want} when loading it",
            details=[f"model {spec.model} has no quantization_config"],
            ways_out=[
                f"use a pre-quantized {want} checkpoint (AWQ/GPTQ) as model",
                "set weights: fp8 (vLLM quantizes to FP8 online)",
            ],
        )
    )


def weight_bytes(arch: ModelArch, precision: Precision) -> int:
    """Weight memory of the whole model: 16-bit embeddings plus the rest at the served precision.

    When the checkpoint's ``model.safetensors.index.json`` gives its size and the weights are
    served as stored, that size is exact; online FP8 of a 16-bit checkpoint halves all but the
    embeddings.
    """
    embeddings = arch.embedding_parameters
    emb_bytes = 2 if precision.bytes_per_param < 2 else precision.bytes_per_param
    if arch.checkpoint_bytes is not None:
        if precision.flags and precision.name == "fp8" and arch.quantization is None:
            body = max(0, arch.checkpoint_bytes - embeddings * 2)
            return int(body * precision.bytes_per_param / 2 + embeddings * emb_bytes)
        if not precision.flags:
            return arch.checkpoint_bytes
    rest = max(0, arch.parameters - embeddings)
    return int(rest * precision.bytes_per_param + embeddings * emb_bytes)


def batch_defaults(gpus: HostGpus) -> tuple[int, int]:
    """vLLM 0.33's default (max_num_batched_tokens, max_num_seqs) for ``vllm serve`` on these GPUs."""
    total = min(g.memory_total for g in gpus.gpus)
    name = gpus.gpus[0].name.lower()
    if total >= 160 * GiB:
        return 16384, 1024
    if total >= 70 * GiB and "a100" not in name:
        return 8192, 1024
    return 2048, 256


def activation_peak(arch: ModelArch, tp: int, batched_tokens: int, max_seqs: int) -> int:
    """Estimated peak of the profiling forward pass on one GPU, plus the sampler's logits."""
    mlp = arch.expert_intermediate_size * max(1, arch.experts_per_token) if arch.is_moe else arch.intermediate_size
    per_token = (2 * mlp // tp + 4 * arch.hidden_size) * arch.dtype_bytes
    logits = max_seqs * (arch.vocab_size // tp) * 4
    return int(ACTIVATION_FACTOR * batched_tokens * per_token) + logits


def kv_dtype_bytes(spec: HostSpec, arch: ModelArch) -> int:
    return 1 if spec.kv_cache_dtype == "fp8" else arch.dtype_bytes


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory as vLLM sees it: NVML's total, the driver's reserve, CUDA's total."""

    nvml_total: int
    reserved: int
    reserve_source: str
    used: int  #: by other processes

    @property
    def cuda_total(self) -> int:
        return self.nvml_total - self.reserved


def gpu_memory(gpus: HostGpus, index: int) -> GpuMemory:
    """The reserve of one GPU: the probe's NVML v2 ``reserved``, else the catalogue's value."""
    gpu = gpus.gpus[index]
    if gpu.memory_reserved is not None:
        return GpuMemory(gpu.memory_total, gpu.memory_reserved, "probe", gpu.memory_used)
    if gpus.sku is not None:
        source = "measured" if gpus.sku.reserve_measured else "estimate"
        return GpuMemory(gpu.memory_total, gpus.sku.memory_reserved, source, gpu.memory_used)
    return GpuMemory(gpu.memory_total, ESTIMATED_RESERVE, "estimate", gpu.memory_used)


def memory_math(
    arch: ModelArch,
    weights_total: int,
    tp: int,
    gpu: GpuMemory,
    utilization: float,
    max_model_len: int,
    kv_bytes: int,
    batch: tuple[int, int],
    kv_tokens_per_request: int,
    stage: tuple[LayerKind, ...] | None = None,
    draft: DraftCost | None = None,
    lora: LoraCost | None = None,
) -> MemoryMath:
    """The per-GPU arithmetic vLLM does at start, with our estimates.

    ``request_memory`` (``vllm/v1/worker/utils.py``) and ``determine_available_memory``
    (``vllm/v1/worker/gpu_worker.py``); the KV cache by ``fleet.model.kv``.

    ``stage``: the attention kinds of the layers one pipeline stage holds (multi-node instances:
    ``weights_total`` is then that stage's weights, and its GPUs hold only those layers' KV cache);
    None: the whole model.

    ``draft``: a speculative draft's weights (added to ``weights``) and KV pages: every block holds
    the draft's layers' pages too, so the target's layers get ``num_blocks × their bytes per block``
    of the KV budget (``UniformTypeKVCacheSpecs``; ``fleet.plan.speculative``).

    ``lora``: the LoRA adapters' slots on every wrapped layer, allocated while the model loads and
    so measured with the weights (``fleet.plan.lora``): added to ``weights``.
    """
    budget = math.ceil(gpu.cuda_total * utilization)
    weights = -(-weights_total // tp) + (draft.weights if draft is not None else 0)
    weights += lora.bytes_per_gpu if lora is not None else 0
    non_torch = NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 or stage is not None else 0)
    activations = activation_peak(arch, tp, *batch)
    kv_budget = budget - weights - non_torch - activations - CUDA_GRAPH_BYTES
    if stage is None:
        layout = arch.kv_layout(tp, kv_bytes)
        per_token = arch.kv_bytes_per_token(tp, kv_bytes)
    else:
        page = arch.page_bytes(tp, kv_bytes)
        layout = kv_layout(stage, page, arch.sliding_window, arch.attention_chunk_size)
        per_token = len(stage) * page // BLOCK_SIZE
    in_flight = ASYNC_BATCHES * batch[0]
    extra = draft.kv_bytes_per_block if draft is not None else 0

    def target_share(available: int) -> int:
        """The bytes of ``available`` the target's layers get once each block holds the draft's pages too."""
        if not extra or available <= 0:
            return available
        return available // (layout.bytes_per_block + extra) * layout.bytes_per_block

    kv_tokens = layout.tokens(target_share(kv_budget), max_model_len, in_flight)
    partial = MemoryMath(
        gpu_total=gpu.cuda_total,
        utilization=utilization,
        budget=budget,
        weights=weights,
        non_torch=non_torch,
        activation_peak=activations,
        cuda_graphs=CUDA_GRAPH_BYTES,
        kv_budget=kv_budget,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        kv_tokens_per_request=kv_tokens_per_request,
        nvml_total=gpu.nvml_total,
        reserved=gpu.reserved,
        reserve_source=gpu.reserve_source,
        kv_layout=layout,
        kv_blocks=layout.num_blocks(target_share(kv_budget)),
        one_request_fits=layout.fits_one_request(target_share(kv_budget), max_model_len, in_flight),
        in_flight_tokens=in_flight,
        draft=draft,
        lora=lora,
    )
    low = layout.tokens(target_share(kv_budget - partial.estimate_bounds), max_model_len, in_flight)
    return dataclasses.replace(partial, kv_tokens_uncertainty=max(0, kv_tokens - low))


#: vLLM's CPU build's KV block size where ``--block-size`` is not given: 128, and 16 for MLA
#: (``CpuPlatform.check_and_update_config``, ``vllm/platforms/cpu.py``; DeepSeek-V4's 256 aside).
CPU_BLOCK_SIZE = 128
CPU_MLA_BLOCK_SIZE = 16


def cpu_memory(m: MemoryMath, kv_cache_gib: int, block_size: int = CPU_BLOCK_SIZE) -> MemoryMath:
    """The KV arithmetic of vLLM's CPU build for an instance planned as ``m``.

    The CPU worker's KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB, exactly: ``check_and_update_config``
    (``vllm/platforms/cpu.py``) sets ``cache_config.kv_cache_memory_bytes`` from it and
    ``CPUWorker.determine_available_memory`` (``vllm/v1/worker/cpu_worker.py``) returns it as the
    KV budget; ``--gpu-memory-utilization`` is then unused (unset, it would be the share of the
    host's memory the worker reserves). The weights, activations and compiled graphs live in the
    host's memory beside it, so nothing is subtracted and nothing is estimated. The tokens and
    blocks are vLLM's from that budget, with the same KV layout as on a GPU but the CPU build's
    block size (``block_size`` tokens a page instead of 16).
    """
    assert m.kv_layout is not None
    scale = block_size / m.kv_layout.block_size
    layout = dataclasses.replace(m.kv_layout, page_bytes=int(m.kv_layout.page_bytes * scale), block_size=block_size)
    kv_budget = kv_cache_gib * GiB
    extra = int(m.draft.kv_bytes_per_block * scale) if m.draft is not None else 0
    share = kv_budget // (layout.bytes_per_block + extra) * layout.bytes_per_block if extra else kv_budget
    return dataclasses.replace(
        m,
        kv_budget=kv_budget,
        kv_tokens=layout.tokens(share, m.max_model_len, m.in_flight_tokens),
        kv_blocks=layout.num_blocks(share),
        one_request_fits=layout.fits_one_request(share, m.max_model_len, m.in_flight_tokens),
        kv_tokens_uncertainty=0,
        kv_layout=layout,
        cpu_kv_cache_gib=kv_cache_gib,
    )


def max_fitting_len(layout: KvLayout, kv_budget: int, limit: int, in_flight: int) -> int:
    """The longest ``--max-model-len`` (a block multiple) whose one request fits: vLLM's estimate."""
    lo, hi = 0, limit // BLOCK_SIZE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout.fits_one_request(kv_budget, mid * BLOCK_SIZE, in_flight):
            lo = mid
        else:
            hi = mid - 1
    return lo * BLOCK_SIZE


def utilization_for(spec: HostSpec, gpus: HostGpus, group: tuple[int, ...]) -> tuple[float, str]:
    """``--gpu-memory-utilization`` for a GPU group and why; lowered if memory is already in use.

    vLLM refuses to start unless free memory, read after its own CUDA context exists, is at
    least ``utilization × CUDA total`` on every GPU of the group.
    """
    wanted = spec.gpu_memory_utilization or DEFAULT_UTILIZATION
    why = (
        f"inventory sets {wanted:.2f}"
        if spec.gpu_memory_utilization
        else f"{DEFAULT_UTILIZATION:.2f} of each GPU's memory; 10% left for the CUDA context and fragmentation"
    )
    mems = {i: gpu_memory(gpus, i) for i in group}
    allowed = {
        i: (m.cuda_total - m.used - CUDA_CONTEXT_BYTES) / m.cuda_total - FREE_MEMORY_MARGIN for i, m in mems.items()
    }
    tightest = min(group, key=lambda i: allowed[i])
    if allowed[tightest] >= wanted:
        return wanted, why
    lowered = math.floor(allowed[tightest] * 100) / 100
    m = mems[tightest]
    in_use = f"already has {m.used / GiB:.1f} GiB in use by another process, and " if m.used else ""
    return lowered, (
        f"lowered from {wanted:.2f}: GPU {tightest} {in_use}vLLM refuses to start unless free memory after its own "
        f"CUDA context ({CUDA_CONTEXT_BYTES // MiB} MiB) ≥ utilization × CUDA total ({m.cuda_total / GiB:.2f} GiB)"
    )


def gpu_groups(gpus: HostGpus, tp: int, pcie_tp: bool) -> list[tuple[int, ...]]:
    """Split the host's GPUs into groups of ``tp`` that stay inside one NVLink island."""
    islands = [gpus.usable] if pcie_tp else list(gpus.islands)
    groups: list[tuple[int, ...]] = []
    for island in sorted((i for i in islands if i), key=min):
        members = sorted(island)
        groups += [tuple(members[i : i + tp]) for i in range(0, len(members) - tp + 1, tp)]
    return sorted(groups)


def tp_problem(arch: ModelArch, gpus: HostGpus, tp: int) -> str | None:
    """Why vLLM 0.33 refuses this TP size for this model on these GPUs, or None: the model's own
    rules (``ModelArch.tp_problem``), then a block-quantized FP8 checkpoint's (``fp8_blocks``)."""
    return arch.tp_problem(tp) or fp8_blocks(arch, tp, gpus.compute_capability).problem


def candidate_tps(arch: ModelArch, gpus: HostGpus, spec: HostSpec, pcie_tp: bool) -> list[int]:
    """TP sizes vLLM accepts for this model on these GPUs that fit inside an NVLink island, smallest first."""
    if spec.tensor_parallel_size is not None:
        return [spec.tensor_parallel_size]
    largest = len(gpus.usable) if pcie_tp else max((len(i) for i in gpus.islands), default=0)
    return [tp for tp in range(1, largest + 1) if is_power_of_two(tp) and tp_problem(arch, gpus, tp) is None]


@dataclass(frozen=True)
class _Layout:
    tp: int
    groups: tuple[tuple[int, ...], ...]
    memory: tuple[MemoryMath, ...]
    utilization: tuple[tuple[float, str], ...]
    batch: Batch | None = None  #: the ``serving_preset``'s batch; None: vLLM's defaults

    @property
    def feasible(self) -> bool:
        return bool(self.groups) and all(m.fits for m in self.memory)

    @property
    def concurrency(self) -> int:
        return sum(m.workload_concurrency for m in self.memory)


def _layout(
    spec: HostSpec,
    gpus: HostGpus,
    arch: ModelArch,
    tp: int,
    weights: int,
    max_len: int,
    pcie_tp: bool,
    draft: ModelArch | None = None,
) -> _Layout:
    groups = tuple(gpu_groups(gpus, tp, pcie_tp))
    sp = spec.speculative
    cost = draft_cost(sp, arch, draft, tp, kv_dtype_bytes(spec, arch)) if sp is not None else None
    slots = lora_cost(spec.lora, arch, tp) if spec.lora is not None else None
    utils = tuple(utilization_for(spec, gpus, g) for g in groups)
    per_request = min(max_len, spec.workload.kv_tokens_per_request)

    def memories(batch: tuple[int, int]) -> tuple[MemoryMath, ...]:
        return tuple(
            memory_math(
                arch,
                weights,
                tp,
                min((gpu_memory(gpus, i) for i in g), key=lambda m: m.cuda_total),
                u[0],
                max_len,
                kv_dtype_bytes(spec, arch),
                batch,
                per_request,
                draft=cost,
                lora=slots,
            )
            for g, u in zip(groups, utils, strict=True)
        )

    memory = memories(batch_defaults(gpus))
    preset: Batch | None = None
    if spec.serving_preset is not None and groups:
        preset = _preset(spec, gpus, max_len, memory, len(groups))
        memory = memories(preset.pair)  # the activation peak follows the batch, and the KV cache with it
        again = _preset(spec, gpus, max_len, memory, len(groups))
        if again.pair != preset.pair:
            preset, memory = again, memories(again.pair)
    fitting = [k for k, m in enumerate(memory) if m.fits]
    if fitting and len(fitting) < len(groups):  # serve on the groups that fit; the rest stay idle
        return _Layout(
            tp,
            tuple(groups[k] for k in fitting),
            tuple(memory[k] for k in fitting),
            tuple(utils[k] for k in fitting),
            preset,
        )
    return _Layout(tp, groups, memory, utils, preset)


def _preset(spec: HostSpec, gpus: HostGpus, max_len: int, memory: tuple[MemoryMath, ...], instances: int) -> Batch:
    """The ``serving_preset``'s batch (``fleet.plan.presets``) from the KV cache at vLLM's default batch;
    the KV requests are counted again at the preset's batch and the sequences capped to them."""
    target = -(-spec.workload.target_concurrency // instances)  # this instance's share
    fits = min(m.workload_concurrency for m in memory)
    assert spec.serving_preset is not None
    return preset_batch(
        spec.serving_preset, batch_defaults(gpus), max_len, spec.workload.p95_input_tokens, target, fits
    )


def choose_layout(layouts: list[_Layout], target: int) -> tuple[_Layout | None, bool]:
    """Smallest TP that meets the target concurrency; else the one that serves the most.

    Smaller TP means more independent instances (data parallel), which beats wider TP for
    throughput whenever each instance still holds enough KV cache for its share of the load.
    """
    feasible = [layout for layout in layouts if layout.feasible]
    for layout in feasible:
        if layout.concurrency >= target:
            return layout, True
    if not feasible:
        return None, False
    return max(feasible, key=lambda layout: (layout.concurrency, -layout.tp)), False


# -- the plan ------------------------------------------------------------------------------------


def plan_host(
    spec: HostSpec,
    gpus: HostGpus,
    arch: ModelArch,
    ways_out: bool = True,
    draft: ModelArch | None = None,
    first_index: int = 0,
) -> HostPlan:
    """The serving plan for one host, or ``PlanError`` with the numbers and the ways out.

    Every way out offered is planned first and offered with the numbers it gives
    (``ways_out=False`` is that inner re-plan: it skips looking for ways out of its own).
    ``draft``: the architecture of ``spec.speculative.model`` (``fleet.plan.speculative.load_draft``).
    ``first_index``: the number of the first instance (a ``models`` entry after others on the
    host, ``fleet.plan.models``: instance n, unit ``vllm-n``, listens on ``port + n``).
    """
    if spec.vllm_version not in known_versions():
        raise PlanError(
            PlanProblem(
                spec.name,
                f"vllm_version {spec.vllm_version}: fleet does not know that release's `vllm serve` arguments",
                ways_out=[f"pin one of: {', '.join(known_versions())}"],
            )
        )
    if not gpus.gpus:
        raise PlanError(PlanProblem(spec.name, "the host has no GPUs", ways_out=["check the driver (fleet audit)"]))
    cuda = plan_cuda(spec, gpus)
    _check_speculative(spec, arch, draft)
    _check_lora(spec, arch)
    precision = resolve_precision(spec, arch)
    weights = weight_bytes(arch, precision)
    counted = (
        f"checkpoint safetensors index: {arch.checkpoint_bytes:,} bytes"
        if arch.checkpoint_bytes is not None and not precision.flags
        else f"{arch.parameters / 1e9:.2f}B parameters"
        + (
            f" (incl. ~{arch.tower_parameters / 1e9:.2f}B estimated vision/audio tower)"
            if arch.tower_parameters
            else ""
        )
    )
    notes = [f"weights: {precision.reason}; {counted} = {weights / GiB:.1f} GiB"]
    if arch.max_len is not None and arch.max_len.reason:
        notes.append(f"model max length {arch.max_model_len:,} (vLLM's derivation: {arch.max_len.reason})")
    warnings: list[str] = []

    wanted_len = round_up(spec.workload.p95_sequence_tokens, BLOCK_SIZE)
    max_len = min(wanted_len, arch.max_model_len)
    if wanted_len > arch.max_model_len:
        warnings.append(
            f"workload p95 sequence {spec.workload.p95_sequence_tokens} tokens exceeds the model's maximum "
            f"{arch.max_model_len}; --max-model-len capped, longer requests will be rejected"
        )
    pcie_only = all(len(i) == 1 for i in gpus.islands) and len(gpus.usable) > 1
    pcie_tp = pcie_only and spec.allow_pcie_tensor_parallel
    if spec.tensor_parallel_size is not None:
        _check_pinned_tp(spec, gpus, arch, pcie_tp, ways_out, draft)
    layouts = [
        _layout(spec, gpus, arch, tp, weights, max_len, pcie_tp, draft)
        for tp in candidate_tps(arch, gpus, spec, pcie_tp)
    ]
    chosen, met = choose_layout(layouts, spec.workload.target_concurrency)
    if chosen is None:
        raise PlanError(_no_fit(spec, gpus, arch, precision, weights, max_len, layouts, pcie_only, ways_out, draft))
    if not met:
        warnings.append(
            f"target concurrency {spec.workload.target_concurrency} not met: at most {chosen.concurrency} "
            f"requests of {spec.workload.kv_tokens_per_request} unique KV tokens fit; expect queueing "
            "(add GPUs, fp8 KV cache, or fewer concurrent requests)"
        )
    if pcie_tp:
        warnings.append("tensor parallel over PCIe (allow_pcie_tensor_parallel): all-reduce over PCIe is slow")
    if (refined := fp8_blocks(arch, chosen.tp, gpus.compute_capability).note(arch, chosen.tp)) is not None:
        notes.append(refined)
        if gpus.compute_capability is None:
            warnings.append(
                f"the GPUs' compute capability is not known: at TP {chosen.tp} vLLM serves this FP8 checkpoint only "
                "on GPUs with native FP8 (compute capability ≥ 8.9: H100, H200, L40S, RTX 4090), and refuses it on "
                "others (A100, A10); give gpu.sku, or let fleet probe the host"
            )
    notes += _defaults_notes(spec, arch)
    notes += _kv_notes(arch, chosen.memory[0], gpu=spec.vllm_cpu is None)
    notes += cuda.reasons
    speculative_flag: tuple[Flag, ...] = ()
    if spec.speculative is not None:
        share = -(-spec.workload.target_concurrency // max(1, len(chosen.groups)))
        loss, why = verdict(spec.speculative, share)
        cost = chosen.memory[0].draft
        assert cost is not None
        notes.append(f"speculative decoding ({spec.speculative.method}): {cost.reason}")
        if loss:
            warnings.append(why)
        speculative_flag = (
            Flag("--speculative-config", spec.speculative.config_json(), f"inventory speculative: {why}"),
        )
    used = {i for g in chosen.groups for i in g}
    idle = tuple(i for i in sorted(gpus.usable) if i not in used)
    if idle:
        warnings.append(
            f"GPUs {', '.join(map(str, idle))} stay idle: no group of {chosen.tp} there fits "
            "(NVLink island too small, or memory already in use)"
        )
    instances = tuple(
        _instance(spec, met, gpus, arch, precision, first_index + k, group, chosen.tp, mem, util, chosen.batch)
        for k, (group, mem, util) in enumerate(zip(chosen.groups, chosen.memory, chosen.utilization, strict=True))
    )
    extra = speculative_flag + _lora_flags(spec, chosen.memory[0], notes) + _extra_flags(spec)
    if extra:
        instances = tuple(dataclasses.replace(i, flags=i.flags + extra) for i in instances)
    if spec.vllm_cpu is not None:
        instances, cpu_notes = _cpu_build(spec, instances, CPU_MLA_BLOCK_SIZE if arch.is_mla else CPU_BLOCK_SIZE)
        notes += cpu_notes
    if cuda.env:
        instances = tuple(dataclasses.replace(i, env=i.env + cuda.env) for i in instances)
    for instance in instances:
        _validate_argv(spec, instance)
    return HostPlan(
        host=spec.name,
        model=spec.model,
        model_source=arch.source,
        gpus_source=gpus.source,
        vllm_version=spec.vllm_version,
        weights_precision=precision.name,
        weight_bytes=weights,
        instances=instances,
        notes=tuple(notes),
        warnings=tuple(warnings),
        idle_gpus=idle,
        cuda=cuda,
    )


def _lora_flags(spec: HostSpec, memory: MemoryMath, notes: list[str]) -> tuple[Flag, ...]:
    """``--enable-lora`` and its flags (``fleet.plan.lora``); their memory is in ``memory.weights``."""
    lora = spec.lora
    if lora is None:
        return ()
    cost = memory.lora
    assert cost is not None
    notes.append(f"LoRA adapters ({', '.join(a.name for a in lora.adapters)}): {cost.reason}")
    why = flags_reasons(lora)
    first, *rest = [f"{a.name}={a.repo}" for a in lora.adapters]
    return (
        Flag("--enable-lora", None, f"inventory lora_adapters: {cost.reason}"),
        Flag(
            "--lora-modules",
            first,
            "inventory lora_adapters: each NAME=fleet-lora/NAME, staged into the units' cache like a model "
            "and read from it offline",
            more=tuple(rest),
        ),
        Flag("--max-loras", str(lora.max_loras), why["--max-loras"]),
        Flag("--max-lora-rank", str(lora.max_lora_rank), why["--max-lora-rank"]),
        Flag("--max-cpu-loras", str(lora.max_cpu_loras), why["--max-cpu-loras"]),
    )


def _check_lora(spec: HostSpec, arch: ModelArch) -> None:
    """``lora_adapters`` on a model fleet cannot plan LoRA for (``fleet.plan.lora``)."""
    if spec.lora is not None and (why := unsupported(arch)) is not None:
        raise PlanError(PlanProblem(spec.name, f"lora_adapters: {why}", ways_out=["remove lora_adapters"]))


def _check_speculative(spec: HostSpec, arch: ModelArch, draft: ModelArch | None) -> None:
    """``speculative`` that vLLM would refuse or misuse for this model (``fleet.plan.speculative``)."""
    sp = spec.speculative
    if sp is None:
        return
    if sp.model is not None and draft is None:
        raise PlanError(
            PlanProblem(spec.name, f"speculative.model {sp.model}: its config.json was not read (a bug in the caller)")
        )
    found = speculative_problem(sp, arch, draft)
    if found is not None:
        fld, why = found
        raise PlanError(PlanProblem(spec.name, f"{fld}: {why}", ways_out=["correct speculative, or remove it"]))


def _check_pinned_tp(
    spec: HostSpec, gpus: HostGpus, arch: ModelArch, pcie_tp: bool, ways_out: bool, draft: ModelArch | None = None
) -> None:
    tp = spec.tensor_parallel_size
    assert tp is not None
    pcie_only = all(len(i) == 1 for i in gpus.islands) and len(gpus.usable) > 1
    problem = tp_problem(arch, gpus, tp)
    largest = len(gpus.usable) if pcie_tp else max((len(i) for i in gpus.islands), default=0)
    over_pcie = False
    if problem is None and tp > largest:
        over_pcie = pcie_only and tp <= gpus.count
        problem = (
            f"TP {tp} spans {tp} GPUs with no NVLink between them: tensor parallelism over PCIe is only "
            "planned with allow_pcie_tensor_parallel: true"
            if over_pcie
            else f"TP {tp} is larger than the largest NVLink island ({largest} GPU{'s' if largest > 1 else ''})"
            if tp <= gpus.count
            else f"TP {tp} is larger than the host's {gpus.count} GPUs"
        )
    if not problem:
        return
    valid = [t for t in range(1, largest + 1) if tp_problem(arch, gpus, t) is None]
    ways = [f"use one of: {', '.join(map(str, valid))}", "or remove tensor_parallel_size to let fleet choose"]
    if ways_out:
        ways = _pinned_tp_ways(spec, gpus, arch, tp, valid, over_pcie, draft)
        if fp8_blocks(arch, tp, gpus.compute_capability).problem is not None and arch.tp_problem(tp) is None:
            ways += [w for w in _fp8_block_ways(arch, gpus) if w not in ways]
    raise PlanError(
        PlanProblem(
            spec.name,
            f"tensor_parallel_size={tp} cannot work for {spec.model}",
            details=[problem, f"attention heads {arch.num_attention_heads}, KV heads {arch.num_kv_heads}"],
            ways_out=ways,
        )
    )


def _pinned_tp_ways(
    spec: HostSpec,
    gpus: HostGpus,
    arch: ModelArch,
    tp: int,
    valid: list[int],
    over_pcie: bool,
    draft: ModelArch | None = None,
) -> list[str]:
    """Ways out of a refused ``tensor_parallel_size``, each planned first and offered with its numbers:
    TP over PCIe where that is all that is missing, the valid sizes, and fleet's own choice (or, when
    that fails too, the ways out of fleet's own choice)."""
    tries: list[tuple[str, dict[str, object]]] = []
    if over_pcie:
        label = f"allow_pcie_tensor_parallel: true (keeps TP {tp}; these GPUs have no NVLink, TP over PCIe is slow)"
        tries.append((label, {"allow_pcie_tensor_parallel": True}))
    tries += [(f"tensor_parallel_size: {t}", {"tensor_parallel_size": t}) for t in valid if t != tp]
    tries.append(("remove tensor_parallel_size (fleet chooses)", {"tensor_parallel_size": None}))
    ways = [w for label, changes in tries if (w := _try(label, spec, gpus, arch, draft, **changes))]
    free = dataclasses.replace(spec, tensor_parallel_size=None)
    try:
        plan_host(free, gpus, arch, draft=draft)
    except PlanError as exc:  # fleet's own choice fails too: its ways out, without the pinned TP
        offered = {w.rsplit(": ", 1)[-1] for w in ways}
        found = [w for w in exc.problem.ways_out if w.rsplit(": ", 1)[-1] not in offered]
        if not ways:
            sizes = ", ".join(map(str, valid)) or "none"
            ways.append(f"no tensor_parallel_size fits as the host is (sizes inside its NVLink islands: {sizes}): "
                        f"{exc.problem.summary}")  # fmt: skip
        ways += [f"remove tensor_parallel_size, and {w}" for w in found]
    return ways


def _fp8_block_ways(arch: ModelArch, gpus: HostGpus) -> list[str]:
    """Ways out of a block-quantized FP8 checkpoint vLLM refuses at the sizes this host allows."""
    ways = []
    cc = gpus.compute_capability
    if cc is not None and cc < NATIVE_FP8:
        ways.append(
            "GPUs with native FP8 (compute capability ≥ 8.9: h100-sxm-80gb, h200-sxm-141gb, l40s-48gb): there vLLM "
            "refines the block scales for Triton's fused-MoE kernel"
        )
    ways.append(
        f"the 16-bit checkpoint of {arch.name} with weights: fp8 (vLLM quantizes it per tensor when loading: "
        "no blocks to split)"
    )
    return ways


def _kv_notes(arch: ModelArch, m: MemoryMath, gpu: bool = True) -> list[str]:
    """What the KV numbers are: vLLM's arithmetic, and exactly what is estimated and by how much.

    ``gpu`` False (vLLM's CPU build): only the layout; the budget is ``VLLM_CPU_KVCACHE_SPACE``
    (``cpu_memory``, noted by ``_cpu_build``) and nothing is estimated."""
    notes = []
    if m.kv_layout is not None and (m.kv_layout.hybrid or arch.is_hybrid):
        layout = m.kv_layout
        per_request = layout.pages_per_request(m.max_model_len, m.in_flight_tokens)
        notes.append(
            f"KV cache: {layout.describe()}; a {m.max_model_len:,}-token request holds {per_request} blocks "
            f"(windowed layers keep window − 1 + {m.in_flight_tokens:,} tokens in flight), i.e. "
            f"{layout.bytes_per_token(m.max_model_len, m.in_flight_tokens):,.0f} B/token vs "
            f"{m.kv_bytes_per_token:,} at full attention"
            + ("" if layout.hybrid else "; vLLM turns its hybrid manager off for chunked local attention")
        )
    if not gpu:
        return notes
    reserve = {
        "probe": "NVML v2 reserved from the probe",
        "measured": "measured on this GPU model",
        "estimate": "an estimate above both measured values",
    }.get(m.reserve_source, m.reserve_source)
    notes.append(
        f"budget: ceil({m.utilization:.2f} × CUDA total {m.gpu_total / GiB:.2f} GiB) where CUDA total = NVML "
        f"{m.nvml_total / GiB:.2f} GiB − driver reserve {m.reserved // MiB} MiB ({reserve})"
    )
    share = m.kv_tokens_uncertainty / m.kv_tokens if m.kv_tokens else 0.0
    notes.append(
        f"estimated, not vLLM's arithmetic: non-torch {m.non_torch / GiB:.2f} GiB (±{NON_TORCH_ERROR / GiB:.2f}), "
        f"activation peak {m.activation_peak / GiB:.2f} GiB (±{ACTIVATION_ERROR:.0%}), CUDA graphs "
        f"{m.cuda_graphs / GiB:.2f} GiB (vLLM measures "
        f"{CUDA_GRAPH_RANGE[0] / GiB:.1f}–{CUDA_GRAPH_RANGE[1] / GiB:.1f}): "
        f"together up to ±{m.estimate_bounds / GiB:.2f} GiB per GPU, ±{m.kv_tokens_uncertainty:,} KV tokens "
        f"(±{share:.1%}); everything else is vLLM 0.33's arithmetic"
    )
    return notes


def _defaults_notes(spec: HostSpec, arch: ModelArch) -> list[str]:
    notes = ["chunked prefill: on by default in vLLM ≥ 0.11 for decoder models; no flag emitted"]
    if spec.prefix_caching:
        notes.append(
            f"prefix caching: on by default in vLLM ≥ 0.11; workload prefix reuse {spec.workload.prefix_reuse:.0%}, "
            "no flag emitted"
        )
    if arch.is_moe:
        notes.append(f"MoE: {arch.num_experts} experts, {arch.experts_per_token} per token")
    return notes


def _instance(
    spec: HostSpec,
    met: bool,
    gpus: HostGpus,
    arch: ModelArch,
    precision: Precision,
    index: int,
    group: tuple[int, ...],
    tp: int,
    mem: MemoryMath,
    util: tuple[float, str],
    batch: Batch | None = None,
) -> Instance:
    flags: list[Flag] = [Flag("--served-model-name", spec.served_model_name or spec.model, "the name clients ask for")]
    if spec.bind_address:
        flags.append(Flag("--host", spec.bind_address, "inventory bind_address"))
    port = spec.port + index
    flags.append(Flag("--port", str(port), f"base port {spec.port} + instance {index}"))
    flags.append(
        Flag(
            "--tensor-parallel-size",
            str(tp),
            f"GPU(s) {list(group)} in one NVLink island; "
            + ("the smallest" if met else "the")
            + f" power-of-two TP that divides {arch.num_attention_heads} heads / {arch.num_kv_heads} KV heads and "
            + ("meets the workload's target concurrency" if met else "serves the most requests"),
        )
    )
    flags.append(
        Flag(
            "--max-model-len",
            str(mem.max_model_len),
            f"p95 input {spec.workload.p95_input_tokens} + output {spec.workload.p95_output_tokens}, "
            f"rounded up to the {BLOCK_SIZE}-token block (model max {arch.max_model_len})",
        )
    )
    flags.append(Flag("--gpu-memory-utilization", f"{util[0]:.2f}", util[1]))
    flags += precision.flags
    if spec.kv_cache_dtype == "fp8":
        flags.append(Flag("--kv-cache-dtype", "fp8", "inventory asks for an FP8 KV cache: twice the tokens"))
    if not spec.prefix_caching:
        flags.append(Flag("--no-enable-prefix-caching", None, "inventory turns prefix caching off"))
    if batch is not None:
        flags.append(Flag("--max-num-batched-tokens", str(batch.max_num_batched_tokens), batch.tokens_reason))
        flags.append(Flag("--max-num-seqs", str(batch.max_num_seqs), batch.seqs_reason))
    if spec.shutdown_timeout > 0:
        flags.append(
            Flag(
                "--shutdown-timeout",
                str(spec.shutdown_timeout),
                "SIGTERM drains in-flight requests for up to this many seconds instead of aborting them",
            )
        )
    by_uuid = all(gpus.gpus[i].uuid for i in group)
    visible = ",".join(gpus.gpus[i].uuid if by_uuid else str(i) for i in group)
    env = (("CUDA_VISIBLE_DEVICES", visible), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
    return Instance(index, group, tp, port, spec.model, tuple(flags), env, mem)


def _cpu_build(
    spec: HostSpec, instances: tuple[Instance, ...], block_size: int
) -> tuple[tuple[Instance, ...], list[str]]:
    """The instances of a host running vLLM's CPU build (``vllm_cpu``), each with its CPU
    environment (``fleet.plan.cpu_engine``) and the CPU build's KV arithmetic (``cpu_memory``),
    and the notes that say why."""
    from fleet.plan.cpu_engine import CpuPlanError, cpu_env

    cpu = spec.vllm_cpu
    assert cpu is not None
    out: list[Instance] = []
    notes = [
        f"vLLM's CPU build vllm-cpu {cpu.version} (vllm_cpu, lab hosts only): flags checked against "
        f"vLLM {spec.vllm_version}'s surface; its KV cache is VLLM_CPU_KVCACHE_SPACE={cpu.kv_cache_gib} GiB per "
        "instance in the host's memory, so --gpu-memory-utilization and the GPU memory arithmetic do not apply"
    ]
    for inst in instances:
        try:
            got = cpu_env(cpu, inst.index, len(instances), inst.tensor_parallel_size)
        except CpuPlanError as exc:
            raise PlanError(PlanProblem(spec.name, str(exc))) from None
        mem = cpu_memory(inst.memory, cpu.kv_cache_gib, block_size)
        if not mem.one_request_fits:
            raise PlanError(
                PlanProblem(
                    spec.name,
                    f"vllm_cpu.kv_cache_gib {cpu.kv_cache_gib}: a KV cache of {cpu.kv_cache_gib} GiB "
                    f"({mem.kv_tokens:,} tokens) cannot hold one request of --max-model-len {mem.max_model_len:,}; "
                    "vLLM's CPU build would refuse to start",
                    ways_out=[f"raise vllm_cpu.kv_cache_gib to hold {mem.max_model_len:,} tokens"],
                )
            )
        flags = tuple(
            dataclasses.replace(
                f,
                reason=f"planned for vLLM {spec.vllm_version}'s surface; unused by the CPU build while "
                "VLLM_CPU_KVCACHE_SPACE is set (CPUWorker, vllm/v1/worker/cpu_worker.py)",
            )
            if f.option == "--gpu-memory-utilization"
            else f
            for f in inst.flags
        )
        out.append(dataclasses.replace(inst, flags=flags, env=inst.env + got.env, memory=mem))
        notes.append(got.reason)
    return tuple(out), notes


def _extra_flags(spec: HostSpec) -> tuple[Flag, ...]:
    """The inventory's ``vllm_extra_args`` as flags "set by you", after fleet's own (``fleet.plan.extra_args``).

    ``load_for_planning`` reports a refused extra flag with the inventory's problems; a spec that
    did not come through it gets the same verdict here, as a plan error.
    """
    parsed = parse_extra_args(spec.vllm_extra_args, spec.vllm_version)
    if parsed.problems:
        raise PlanError(
            PlanProblem(
                spec.name,
                "vllm_extra_args: " + "; ".join(f"{f.split('.', 1)[1]}: {why}" for f, _, why in parsed.problems),
                ways_out=["remove or correct the flags named, or set the inventory key each names"],
            )
        )
    flags: list[Flag] = []
    for f in parsed.flags:
        if f.option in parsed.appends:
            flags += [Flag(f.option, v, SET_BY_YOU_REASON, set_by=SET_BY_YOU) for v in f.values]
        else:
            first = f.values[0] if f.values else None
            flags.append(Flag(f.option, first, SET_BY_YOU_REASON, more=f.values[1:], set_by=SET_BY_YOU))
    return tuple(flags)


def _validate_argv(spec: HostSpec, instance: Instance) -> None:
    """Every argv we emit must parse under the target vLLM's real argument surface."""
    try:
        parse_serve_argv(instance.argv, spec.vllm_version)
    except SurfaceError as exc:  # a bug in fleet, not in the inventory
        raise PlanError(
            PlanProblem(spec.name, f"fleet generated flags vLLM {spec.vllm_version} would refuse: {exc}")
        ) from exc


def _try(
    label: str, spec: HostSpec, gpus: HostGpus, arch: ModelArch, draft: ModelArch | None = None, **changes: object
) -> str:
    """Plan ``spec`` with ``changes``; the way out with the numbers it gives, or "" if it fails too."""
    try:
        plan = plan_host(dataclasses.replace(spec, **changes), gpus, arch, ways_out=False, draft=draft)  # type: ignore[arg-type]
    except PlanError:
        return ""
    inst = plan.instances
    tps = sorted({i.tensor_parallel_size for i in inst})
    return (
        f"{label}: {len(inst)} instance(s) at TP {'/'.join(map(str, tps))}, {plan.total_kv_tokens:,} KV tokens, "
        f"{plan.workload_concurrency:,} concurrent requests of the workload"
    )


def _more_gpus(spec: HostSpec, gpus: HostGpus, arch: ModelArch, draft: ModelArch | None = None) -> str:
    """The fewest GPUs of this kind, in one host, that serve the model; or that one host cannot.

    GPUs are joined the way this GPU model is usually built (NVSwitch, bridged pairs, PCIe);
    TP over PCIe is tried last, with ``allow_pcie_tensor_parallel``.
    """
    sku = gpus.sku
    size = gpus.gpus[0].memory_total
    if sku is not None:
        fabric, name = (sku.typical_fabric if sku.nvlink_links else Fabric.NONE), sku.key
    else:
        largest = max(len(i) for i in gpus.islands)
        fabric = Fabric.SWITCH if largest > 2 else Fabric.PAIRS if largest == 2 else Fabric.NONE
        name = f"{size / GiB:.0f} GiB GPUs"
    joined = {Fabric.SWITCH: "joined by NVSwitch", Fabric.PAIRS: "in NVLink-bridged pairs", Fabric.NONE: "on PCIe"}
    for count in (2, 4, 8):
        if count <= gpus.count:
            continue
        if sku is not None:
            bigger = HostGpus.from_catalogue(sku.key, count, fabric)
        else:
            bigger = HostGpus.uniform(count, size, fabric, gpus.gpus[0].name)
        if way := _try(f"more GPUs: {count} × {name} {joined[fabric]}", spec, bigger, arch, draft):
            return way
        if fabric is not Fabric.SWITCH and (
            way := _try(
                f"more GPUs: {count} × {name} with allow_pcie_tensor_parallel: true (TP over PCIe, slow)",
                spec,
                bigger,
                arch,
                draft,
                allow_pcie_tensor_parallel=True,
            )
        ):
            return way
    return (
        f"needs more than one host: even 8 × {name} in one host cannot hold it; use a smaller or "
        "quantized model, or an instance spanning hosts (multi_node: true on the host's group)"
    )


def _no_fit(
    spec: HostSpec,
    gpus: HostGpus,
    arch: ModelArch,
    precision: Precision,
    weights: int,
    max_len: int,
    layouts: list[_Layout],
    pcie_only: bool,
    ways_out: bool = True,
    draft: ModelArch | None = None,
) -> PlanProblem:
    """Explain why nothing fits, with the numbers of the roomiest layout and ways out that work."""
    best = max((lay for lay in layouts if lay.groups), key=lambda lay: lay.tp, default=None)
    size = gpus.gpus[0].memory_total / GiB
    details = [
        f"weights {weights / GiB:.1f} GiB ({precision.name}); {gpus.count} GPU(s) of {size:.1f} GiB ({gpus.source})"
    ]
    summary = f"{spec.model} does not fit"
    ways: list[str] = []
    if best is not None:
        m = best.memory[0]
        details.append(
            f"at TP {best.tp}: budget {m.budget / GiB:.1f} GiB/GPU ({m.utilization:.2f} × CUDA total "
            f"{m.gpu_total / GiB:.2f}) − weights {m.weights / GiB:.1f} − overhead "
            f"{(m.non_torch + m.activation_peak + m.cuda_graphs) / GiB:.1f} (estimated) "
            f"= KV {m.kv_budget / GiB:.1f} GiB → {m.kv_tokens:,} tokens; one sequence needs {max_len:,}"
        )
        if m.kv_budget > 0:
            summary = f"max-model-len {max_len} leaves no room for one sequence"
            assert m.kv_layout is not None
            fit_len = max_fitting_len(m.kv_layout, m.kv_budget, max_len, m.in_flight_tokens)
            if fit_len > 0:
                ways.append(f"shorter context: at TP {best.tp} vLLM accepts --max-model-len up to {fit_len:,}")
        else:
            summary = "the weights do not fit in GPU memory"
    else:
        largest = (
            len(gpus.usable)
            if pcie_only and spec.allow_pcie_tensor_parallel
            else max((len(i) for i in gpus.islands), default=0)
        )
        refused = [
            f"TP {t}: {why}" for t in range(1, largest + 1) if is_power_of_two(t) and (why := tp_problem(arch, gpus, t))
        ]
        details.append("no tensor-parallel size that vLLM accepts fits the NVLink islands" + (":" if refused else ""))
        details += refused
        if any("FP8" in why for why in refused):
            ways.extend(_fp8_block_ways(arch, gpus))
    if not ways_out:
        return PlanProblem(spec.name, summary, details, ways)
    wanted = spec.gpu_memory_utilization or DEFAULT_UTILIZATION
    tries: list[tuple[str, dict[str, object]]] = []
    if spec.tensor_parallel_size is not None:
        pcie_tp = pcie_only and spec.allow_pcie_tensor_parallel
        free = dataclasses.replace(spec, tensor_parallel_size=None)
        for tp in candidate_tps(arch, gpus, free, pcie_tp):
            if tp != spec.tensor_parallel_size and (
                way := _try(f"tensor_parallel_size: {tp}", spec, gpus, arch, draft, tensor_parallel_size=tp)
            ):
                ways.append(way)
                break
    if wanted < 0.95:
        tries.append(("gpu_memory_utilization: 0.95 (less headroom)", {"gpu_memory_utilization": 0.95}))
    if spec.kv_cache_dtype != "fp8":
        tries.append(("kv_cache_dtype: fp8", {"kv_cache_dtype": "fp8"}))
    fp8_ok = precision.bytes_per_param > 1 and arch.quantization is None
    if fp8_ok:
        tries.append(("weights: fp8", {"weights": "fp8"}))
    if pcie_only and not spec.allow_pcie_tensor_parallel:
        tries.append(
            (
                "allow_pcie_tensor_parallel: true (these GPUs have no NVLink; TP over PCIe is slow)",
                {"allow_pcie_tensor_parallel": True},
            )
        )
    if fp8_ok and spec.kv_cache_dtype != "fp8":
        tries.append(("weights: fp8 and kv_cache_dtype: fp8", {"weights": "fp8", "kv_cache_dtype": "fp8"}))
    for label, changes in tries:
        if way := _try(label, spec, gpus, arch, draft, **changes):
            ways.append(way)
    ways.append(_more_gpus(spec, gpus, arch, draft))
    return PlanProblem(spec.name, summary, details, ways)
