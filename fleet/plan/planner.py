"""The serving planner: from (host spec, GPUs, model architecture) to vLLM instances and flags.

A pure function of its inputs. It decides the weight precision, the tensor-parallel size and
GPU groups, ``--max-model-len``, ``--gpu-memory-utilization`` and the rest, and keeps the memory
arithmetic behind every number so ``fleet plan`` can show it. A plan that cannot work raises
``PlanError`` naming the host, the numbers and the ways out — before any host is touched.

Rules (``shared/design.md``, ``shared/reference/vllm.md``):

* weights = parameters × bytes per parameter of the served precision; embeddings and the LM
  head stay 16-bit in quantized checkpoints and under online FP8;
* KV bytes per token per GPU follow vLLM's formula (``ModelArch.kv_bytes_per_token``);
* ``--gpu-memory-utilization`` is a fraction of each GPU's total memory; 0.90 leaves 10% for
  the CUDA context and fragmentation; lowered when a probe shows memory already used, because
  vLLM refuses to start when free memory is below utilization × total;
* TP satisfies vLLM's divisibility rules, is a power of two, stays in one NVLink island; across
  PCIe-only GPUs every GPU gets its own instance; GPUs left over become more instances;
* ``--max-model-len`` = p95 input + output rounded up to the block size, capped by the model;
  at least one sequence of that length must fit in the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleet.errors import PlanError, PlanProblem
from fleet.gpus import GiB, HostGpus
from fleet.inventory.spec import HostSpec
from fleet.model.arch import ModelArch
from fleet.plan.vllm_surface import SurfaceError, known_versions, parse_serve_argv

BLOCK_SIZE = 16  #: vLLM's default KV block size (tokens)
DEFAULT_UTILIZATION = 0.90
FREE_MEMORY_MARGIN = 0.01  #: keep 1% below what is free when lowering utilization
#: Non-torch memory per GPU (CUDA context, cuBLAS, NCCL). The worked vLLM log in vllm.md shows
#: 0.35 GiB for one GPU; NCCL buffers add roughly half a GiB once TP > 1.
NON_TORCH_BYTES = int(0.35 * GiB)
NCCL_BYTES = int(0.5 * GiB)
#: CUDA-graph memory vLLM 0.33 estimates and subtracts (profiling on by default since 0.21).
CUDA_GRAPH_BYTES = int(0.5 * GiB)
#: Activation peak of the profiling run per batched token, relative to the MLP and hidden
#: widths; calibrated on the published Llama-3.1-8B/H100 log (1.24 GiB at 8192 tokens).
ACTIVATION_FACTOR = 1.8


@dataclass(frozen=True)
class Flag:
    """One ``vllm serve`` option, its value, and why it has that value."""

    option: str
    value: str | None
    reason: str

    def argv(self) -> list[str]:
        return [self.option] if self.value is None else [self.option, self.value]


@dataclass(frozen=True)
class MemoryMath:
    """Per-GPU memory arithmetic of one instance, in bytes (vLLM sizes each GPU alike)."""

    gpu_total: int
    utilization: float
    budget: int
    weights: int
    non_torch: int
    activation_peak: int
    cuda_graphs: int
    kv_budget: int
    kv_bytes_per_token: int
    kv_tokens: int
    max_model_len: int
    kv_tokens_per_request: int

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
        return self.kv_budget > 0 and self.kv_tokens >= self.max_model_len


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process on a group of GPUs."""

    index: int
    gpus: tuple[int, ...]
    tensor_parallel_size: int
    port: int
    model: str
    flags: tuple[Flag, ...]
    env: tuple[tuple[str, str], ...]
    memory: MemoryMath

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

    @property
    def total_kv_tokens(self) -> int:
        return sum(i.memory.kv_tokens for i in self.instances)

    @property
    def workload_concurrency(self) -> int:
        return sum(i.memory.workload_concurrency for i in self.instances)


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
    """Weight memory of the whole model: 16-bit embeddings plus the rest at the served precision."""
    embeddings = arch.embedding_parameters
    rest = max(0, arch.parameters - embeddings)
    emb_bytes = 2 if precision.bytes_per_param < 2 else precision.bytes_per_param
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
    mlp = (arch.moe_intermediate_size * max(1, arch.experts_per_token)) if arch.is_moe else arch.intermediate_size
    per_token = (2 * mlp // tp + 4 * arch.hidden_size) * arch.dtype_bytes
    logits = max_seqs * (arch.vocab_size // tp) * 4
    return int(ACTIVATION_FACTOR * batched_tokens * per_token) + logits


def kv_dtype_bytes(spec: HostSpec, arch: ModelArch) -> int:
    return 1 if spec.kv_cache_dtype == "fp8" else arch.dtype_bytes


def memory_math(
    arch: ModelArch,
    weights_total: int,
    tp: int,
    gpu_total: int,
    utilization: float,
    max_model_len: int,
    kv_bytes: int,
    batch: tuple[int, int],
    kv_tokens_per_request: int,
) -> MemoryMath:
    """The per-GPU arithmetic vLLM does at start (``vllm.md`` §2.1–2.3), with our estimates."""
    budget = int(utilization * gpu_total)
    weights = -(-weights_total // tp)
    non_torch = NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 else 0)
    activations = activation_peak(arch, tp, *batch)
    kv_budget = budget - weights - non_torch - activations - CUDA_GRAPH_BYTES
    per_token = arch.kv_bytes_per_token(tp, kv_bytes)
    blocks = max(0, kv_budget // (per_token * BLOCK_SIZE))
    kv_tokens = max(0, blocks - 1) * BLOCK_SIZE  # one block is the null block
    return MemoryMath(
        gpu_total=gpu_total,
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
    )


def utilization_for(spec: HostSpec, gpus: HostGpus, group: tuple[int, ...]) -> tuple[float, str]:
    """``--gpu-memory-utilization`` for a GPU group and why; lowered if memory is already in use."""
    wanted = spec.gpu_memory_utilization or DEFAULT_UTILIZATION
    why = (
        f"inventory sets {wanted:.2f}"
        if spec.gpu_memory_utilization
        else f"{DEFAULT_UTILIZATION:.2f} of each GPU's memory; 10% left for the CUDA context and fragmentation"
    )
    allowed = min(
        (gpus.gpus[i].memory_total - gpus.gpus[i].memory_used) / gpus.gpus[i].memory_total - FREE_MEMORY_MARGIN
        for i in group
    )
    if allowed >= wanted:
        return wanted, why
    busiest = max(group, key=lambda i: gpus.gpus[i].memory_used)
    used = gpus.gpus[busiest].memory_used / GiB
    lowered = math.floor(allowed * 100) / 100
    return lowered, (
        f"lowered from {wanted:.2f}: GPU {busiest} already has {used:.1f} GiB in use by another process, "
        f"and vLLM refuses to start unless free memory ≥ utilization × total"
    )


def gpu_groups(gpus: HostGpus, tp: int, pcie_tp: bool) -> list[tuple[int, ...]]:
    """Split the host's GPUs into groups of ``tp`` that stay inside one NVLink island."""
    islands = [frozenset(range(gpus.count))] if pcie_tp else list(gpus.islands)
    groups: list[tuple[int, ...]] = []
    for island in sorted(islands, key=min):
        members = sorted(island)
        groups += [tuple(members[i : i + tp]) for i in range(0, len(members) - tp + 1, tp)]
    return sorted(groups)


def candidate_tps(arch: ModelArch, gpus: HostGpus, spec: HostSpec, pcie_tp: bool) -> list[int]:
    """TP sizes vLLM accepts for this model that fit inside an NVLink island, smallest first."""
    if spec.tensor_parallel_size is not None:
        return [spec.tensor_parallel_size]
    largest = gpus.count if pcie_tp else max(len(i) for i in gpus.islands)
    return [tp for tp in range(1, largest + 1) if is_power_of_two(tp) and arch.tp_problem(tp) is None]


@dataclass(frozen=True)
class _Layout:
    tp: int
    groups: tuple[tuple[int, ...], ...]
    memory: tuple[MemoryMath, ...]
    utilization: tuple[tuple[float, str], ...]

    @property
    def feasible(self) -> bool:
        return bool(self.groups) and all(m.fits for m in self.memory)

    @property
    def concurrency(self) -> int:
        return sum(m.workload_concurrency for m in self.memory)


def _layout(
    spec: HostSpec, gpus: HostGpus, arch: ModelArch, tp: int, weights: int, max_len: int, pcie_tp: bool
) -> _Layout:
    groups = tuple(gpu_groups(gpus, tp, pcie_tp))
    utils = tuple(utilization_for(spec, gpus, g) for g in groups)
    batch = batch_defaults(gpus)
    per_request = min(max_len, spec.workload.kv_tokens_per_request)
    memory = tuple(
        memory_math(
            arch,
            weights,
            tp,
            min(gpus.gpus[i].memory_total for i in g),
            u[0],
            max_len,
            kv_dtype_bytes(spec, arch),
            batch,
            per_request,
        )
        for g, u in zip(groups, utils, strict=True)
    )
    return _Layout(tp, groups, memory, utils)


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


def plan_host(spec: HostSpec, gpus: HostGpus, arch: ModelArch) -> HostPlan:
    """The serving plan for one host, or ``PlanError`` with the numbers and the ways out."""
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
    precision = resolve_precision(spec, arch)
    weights = weight_bytes(arch, precision)
    notes = [f"weights: {precision.reason}; {arch.parameters / 1e9:.2f}B parameters = {weights / GiB:.1f} GiB"]
    warnings: list[str] = []

    wanted_len = round_up(spec.workload.p95_sequence_tokens, BLOCK_SIZE)
    max_len = min(wanted_len, arch.max_model_len)
    if wanted_len > arch.max_model_len:
        warnings.append(
            f"workload p95 sequence {spec.workload.p95_sequence_tokens} tokens exceeds the model's maximum "
            f"{arch.max_model_len}; --max-model-len capped, longer requests will be rejected"
        )
    pcie_only = all(len(i) == 1 for i in gpus.islands) and gpus.count > 1
    pcie_tp = pcie_only and spec.allow_pcie_tensor_parallel
    if spec.tensor_parallel_size is not None:
        _check_pinned_tp(spec, gpus, arch, pcie_tp)
    layouts = [
        _layout(spec, gpus, arch, tp, weights, max_len, pcie_tp) for tp in candidate_tps(arch, gpus, spec, pcie_tp)
    ]
    chosen, met = choose_layout(layouts, spec.workload.target_concurrency)
    if chosen is None:
        raise PlanError(_no_fit(spec, gpus, arch, precision, weights, max_len, layouts, pcie_only))
    if not met:
        warnings.append(
            f"target concurrency {spec.workload.target_concurrency} not met: at most {chosen.concurrency} "
            f"requests of {spec.workload.kv_tokens_per_request} unique KV tokens fit; expect queueing "
            "(add GPUs, fp8 KV cache, or fewer concurrent requests)"
        )
    if pcie_tp:
        warnings.append("tensor parallel over PCIe (allow_pcie_tensor_parallel): all-reduce over PCIe is slow")
    notes += _defaults_notes(spec, arch)
    if arch.sliding_window:
        notes.append(
            f"sliding window {arch.sliding_window}: vLLM allocates less KV for windowed layers, so KV "
            "tokens here are a lower bound"
        )
    used = {i for g in chosen.groups for i in g}
    idle = tuple(i for i in range(gpus.count) if i not in used)
    if idle:
        warnings.append(f"GPUs {', '.join(map(str, idle))} stay idle: no group of {chosen.tp} fits in their island")
    instances = tuple(
        _instance(spec, met, gpus, arch, precision, k, group, chosen.tp, mem, util)
        for k, (group, mem, util) in enumerate(zip(chosen.groups, chosen.memory, chosen.utilization, strict=True))
    )
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
    )


def _check_pinned_tp(spec: HostSpec, gpus: HostGpus, arch: ModelArch, pcie_tp: bool) -> None:
    tp = spec.tensor_parallel_size
    assert tp is not None
    problem = arch.tp_problem(tp)
    largest = gpus.count if pcie_tp else max(len(i) for i in gpus.islands)
    if problem is None and tp > largest:
        problem = (
            f"TP {tp} is larger than the largest NVLink island ({largest} GPUs)"
            if tp <= gpus.count
            else f"TP {tp} is larger than the host's {gpus.count} GPUs"
        )
    if problem:
        valid = [t for t in range(1, largest + 1) if arch.tp_problem(t) is None]
        raise PlanError(
            PlanProblem(
                spec.name,
                f"tensor_parallel_size={tp} cannot work for {spec.model}",
                details=[
                    problem,
                    f"attention heads {arch.num_attention_heads}, KV heads {arch.num_kv_heads}",
                ],
                ways_out=[
                    f"use one of: {', '.join(map(str, valid))}",
                    "or remove tensor_parallel_size to let fleet choose",
                ],
            )
        )


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


def _validate_argv(spec: HostSpec, instance: Instance) -> None:
    """Every argv we emit must parse under the target vLLM's real argument surface."""
    try:
        parse_serve_argv(instance.argv, spec.vllm_version)
    except SurfaceError as exc:  # a bug in fleet, not in the inventory
        raise PlanError(
            PlanProblem(spec.name, f"fleet generated flags vLLM {spec.vllm_version} would refuse: {exc}")
        ) from exc


def _no_fit(
    spec: HostSpec,
    gpus: HostGpus,
    arch: ModelArch,
    precision: Precision,
    weights: int,
    max_len: int,
    layouts: list[_Layout],
    pcie_only: bool,
) -> PlanProblem:
    """Explain why nothing fits, with the numbers of the roomiest layout and concrete ways out."""
    best = max((lay for lay in layouts if lay.groups), key=lambda lay: lay.tp, default=None)
    size = gpus.gpus[0].memory_total / GiB
    details = [
        f"weights {weights / GiB:.1f} GiB ({precision.name}); {gpus.count} GPU(s) of {size:.1f} GiB ({gpus.source})"
    ]
    summary = f"{spec.model} does not fit"
    if best is not None:
        m = best.memory[0]
        details.append(
            f"at TP {best.tp}: budget {m.budget / GiB:.1f} GiB/GPU ({m.utilization:.2f} × {m.gpu_total / GiB:.1f})"
            f" − weights "
            f"{m.weights / GiB:.1f} − overhead {(m.non_torch + m.activation_peak + m.cuda_graphs) / GiB:.1f} "
            f"= KV {m.kv_budget / GiB:.1f} GiB → {m.kv_tokens} tokens; one sequence needs {max_len}"
        )
        if m.kv_budget > 0:
            summary = f"max-model-len {max_len} leaves no room for one sequence"
            fit_len = m.kv_tokens // BLOCK_SIZE * BLOCK_SIZE
            ways = [f"shorter context: at TP {best.tp} at most {fit_len} tokens fit" if fit_len > 0 else ""]
        else:
            summary = "the weights do not fit in GPU memory"
            ways = []
    else:
        ways = []
        details.append("no tensor-parallel size fits the NVLink islands")
    if best is not None and best.memory[0].utilization < 0.95:
        m = best.memory[0]
        extra = (0.95 - m.utilization) * m.gpu_total
        ways.append(f"gpu_memory_utilization: 0.95 (+{extra / GiB:.1f} GiB per GPU, less headroom)")
    if spec.kv_cache_dtype != "fp8" and best is not None and best.memory[0].kv_budget > 0:
        ways.append("kv_cache_dtype: fp8 (halves KV bytes per token)")
    if precision.bytes_per_param > 1 and arch.quantization is None:
        fp8 = weight_bytes(arch, Precision("fp8", 1, (), ""))
        ways.append(f"weights: fp8 ({fp8 / GiB:.1f} GiB) or a pre-quantized int4 checkpoint (~{fp8 / 2 / GiB:.1f} GiB)")
    usable = DEFAULT_UTILIZATION * min(g.memory_total for g in gpus.gpus) - 2 * GiB
    if usable > 0:
        needed = math.ceil(weights * 1.15 / usable)
        needed_tp = 1 << (needed - 1).bit_length()
        ways.append(f"more GPUs: about {needed_tp} × {gpus.gpus[0].memory_total / GiB:.0f} GiB joined by NVLink")
    if pcie_only and not spec.allow_pcie_tensor_parallel:
        ways.append("these GPUs have no NVLink: allow_pcie_tensor_parallel: true runs TP over PCIe (slow)")
    return PlanProblem(spec.name, summary, details, [w for w in ways if w])
