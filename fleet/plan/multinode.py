"""Instances that span hosts: tensor parallel inside each host's NVLink island, one pipeline stage
per host, with vLLM 0.33's multiprocessing backend. Pure, like ``fleet.plan.planner``.

What vLLM 0.33 requires, from its own code:

* ``vllm serve`` on every node with the same model and parallel sizes, plus ``--nnodes N
  --node-rank r --master-addr A --master-port P``; every node but rank 0 adds ``--headless``
  (``vllm/entrypoints/cli/serve.py``: ``run_headless`` starts only the workers when
  ``node_rank_within_dp > 0``; rank 0 runs the engine core and the API server);
* ``--nnodes`` must divide the world size ``TP × PP`` and ``0 ≤ node_rank < nnodes``
  (``EngineArgs.create_engine_config``, ``vllm/engine/arg_utils.py``); each node runs
  ``world_size / nnodes`` workers (``ParallelConfig.local_world_size``, ``vllm/config/parallel.py``),
  ranks laid out TP fastest, so with ``PP = nnodes`` and ``TP`` = the GPUs used per host each host
  is exactly one pipeline stage and tensor parallel never leaves a host;
* the backend is ``mp`` (``ParallelConfig.__post_init__`` picks it on CUDA when ``nnodes > 1``;
  fleet says so explicitly with ``--distributed-executor-backend mp``);
* the layers of stage ``r`` are ``get_pp_indices(num_layers, r, PP)`` (``vllm/distributed/utils.py``):
  ``L // PP`` each, the remainder given one by one to the stages before the last, from the
  second-to-last backwards. ``VLLM_PP_LAYER_PARTITION`` overrides it only when set, and fleet never
  sets it;
* every rank sizes its KV cache from its own free memory and its own layers, then all ranks take the
  smallest rank's block count (``get_kv_cache_configs``, ``vllm/v1/core/kv_cache_planning.py``): the
  instance's tokens are the smallest stage's.

What is fleet's: the first stage holds the input embedding and the last the LM head (each a full
``vocab × hidden`` matrix, also when tied: vLLM's last rank loads its own copy), the decoder layers'
weights split in proportion to each layer's parameters. Models whose layers mix attention kinds
(sliding windows, chunked attention) are not planned across hosts: vLLM groups their KV cache over
the whole model and projects the groups onto each stage, which fleet does not transcribe yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleet.errors import PlanError, PlanProblem
from fleet.gpus import GiB, HostGpus
from fleet.inventory.spec import HostSpec
from fleet.model.arch import ModelArch
from fleet.model.kv import BLOCK_SIZE
from fleet.plan.cuda import plan_cuda
from fleet.plan.planner import (
    Flag,
    HostPlan,
    Instance,
    MemoryMath,
    NodeRole,
    Precision,
    _instance,
    _validate_argv,
    batch_defaults,
    candidate_tps,
    gpu_groups,
    gpu_memory,
    kv_dtype_bytes,
    memory_math,
    resolve_precision,
    round_up,
    utilization_for,
    weight_bytes,
)

#: Most hosts fleet tries for one instance when the group does not pin ``pipeline_parallel_size``.
MAX_AUTO_NODES = 16


# -- vLLM's arithmetic ------------------------------------------------------------------------------


def pp_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage, as vLLM 0.33's ``get_pp_indices`` splits them (no
    ``VLLM_PP_LAYER_PARTITION``): ``L // PP`` each, the remainder one each to the stages before
    the last, from the second-to-last backwards."""
    if pp < 1:
        raise ValueError(f"pipeline parallel size {pp} must be at least 1")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def pp_indices(num_layers: int, rank: int, pp: int) -> tuple[int, int]:
    """``get_pp_indices(num_layers, rank, pp)``: stage ``rank``'s layers ``[start, end)``."""
    parts = pp_partition(num_layers, pp)
    start = sum(parts[:rank])
    return start, start + parts[rank]


def pp_problem(arch: ModelArch, pp: int) -> str | None:
    """Why vLLM cannot split this model into ``pp`` pipeline stages, or None."""
    if pp > arch.num_layers:
        return (
            f"{pp} pipeline stages but {arch.name} has {arch.num_layers} layers: "
            f"get_pp_indices would leave stage(s) without a layer"
        )
    if arch.is_hybrid:
        kinds = sorted({k.value for k in arch.kinds})
        return (
            f"{arch.name} mixes attention kinds ({', '.join(kinds)}): vLLM groups its KV cache over the whole "
            "model and projects the groups onto each stage, which fleet does not plan across hosts yet"
        )
    return None


def stage_weight_bytes(arch: ModelArch, precision: Precision, total: int, rank: int, pp: int) -> int:
    """Weight bytes pipeline stage ``rank`` of ``pp`` loads (all its GPUs together).

    The first stage holds the input embedding, the last the LM head (a full copy even when tied);
    the decoder layers' share of ``total`` is split by each layer's parameters.
    """
    emb_bytes = 2 if precision.bytes_per_param < 2 else precision.bytes_per_param
    matrix = int(arch.vocab_size * arch.hidden_size * emb_bytes)
    body = max(0, total - int(arch.embedding_parameters * emb_bytes))
    per_layer = [arch.layer_parameters(i) for i in range(arch.num_layers)]
    start, end = pp_indices(arch.num_layers, rank, pp)
    share = int(body * sum(per_layer[start:end]) / max(1, sum(per_layer)))
    return share + (matrix if rank == 0 else 0) + (matrix if rank == pp - 1 else 0)


# -- the plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One node's numbers in a candidate layout."""

    rank: int
    layers: tuple[int, int]
    weights: int  #: this stage's weight bytes, all its GPUs
    memory: MemoryMath
    utilization: tuple[float, str]


@dataclass(frozen=True)
class Pipeline:
    """A candidate: ``nodes`` hosts, TP ``tp`` on each, the stages' memory."""

    nodes: int
    tp: int
    group: tuple[int, ...]  #: the GPUs used on every host
    stages: tuple[Stage, ...]

    @property
    def fits(self) -> bool:
        return all(s.memory.fits for s in self.stages)

    @property
    def kv_blocks(self) -> int:
        return min(s.memory.kv_blocks for s in self.stages)

    @property
    def kv_tokens(self) -> int:
        """vLLM's ``GPU KV cache size`` of the instance: the smallest stage's blocks."""
        m = self.stages[0].memory
        assert m.kv_layout is not None
        per_request = m.kv_layout.pages_per_request(m.max_model_len, m.in_flight_tokens)
        return int(self.kv_blocks / per_request * m.max_model_len)

    @property
    def workload_concurrency(self) -> int:
        return self.kv_tokens // max(1, self.stages[0].memory.kv_tokens_per_request)


def pipeline(
    spec: HostSpec, gpus: HostGpus, arch: ModelArch, precision: Precision, nodes: int, tp: int, pcie_tp: bool
) -> Pipeline | None:
    """The numbers of one instance over ``nodes`` hosts like ``gpus`` at TP ``tp``; None: no group of ``tp``."""
    groups = gpu_groups(gpus, tp, pcie_tp)
    if not groups:
        return None
    group = groups[0]
    total = weight_bytes(arch, precision)
    wanted_len = round_up(spec.workload.p95_sequence_tokens, BLOCK_SIZE)
    max_len = min(wanted_len, arch.max_model_len)
    util = utilization_for(spec, gpus, group)
    mem = min((gpu_memory(gpus, i) for i in group), key=lambda m: m.cuda_total)
    stages = []
    kinds = arch.kinds
    for rank in range(nodes):
        start, end = pp_indices(arch.num_layers, rank, nodes)
        weights = stage_weight_bytes(arch, precision, total, rank, nodes)
        m = memory_math(
            arch, weights, tp, mem, util[0], max_len, kv_dtype_bytes(spec, arch), batch_defaults(gpus),
            min(max_len, spec.workload.kv_tokens_per_request), stage=kinds[start:end],
        )  # fmt: skip
        stages.append(Stage(rank, (start, end), weights, m, util))
    return Pipeline(nodes, tp, group, tuple(stages))


def same_gpus(gpus: Mapping[str, HostGpus]) -> str | None:
    """Why these hosts' GPUs cannot carry one instance (vLLM sizes every rank alike), or None."""

    def shape(g: HostGpus) -> tuple[object, ...]:
        return (g.count, g.gpus[0].name if g.gpus else "", tuple(x.memory_total for x in g.gpus), tuple(g.islands))

    first = next(iter(gpus))
    others = [h for h, g in gpus.items() if shape(g) != shape(gpus[first])]
    if not others:
        return None

    def said(h: str) -> str:
        g = gpus[h]
        size = g.gpus[0].memory_total / GiB if g.gpus else 0.0
        return f"{h}: {g.count} × {g.gpus[0].name if g.gpus else '?'} ({size:.1f} GiB, {g.source})"

    return "hosts with different GPUs cannot share an instance: " + "; ".join(said(h) for h in [first, *others])


def choose(spec: HostSpec, gpus: HostGpus, arch: ModelArch, hosts: int) -> tuple[Pipeline | None, list[Pipeline]]:
    """The fewest nodes (≤ ``hosts``, or the pinned PP) that fit; there the smallest TP meeting the
    target concurrency with ``hosts // nodes`` instances, else the one serving the most. Also every
    candidate tried (for the numbers of a refusal)."""
    precision = resolve_precision(spec, arch)
    pcie_only = all(len(i) == 1 for i in gpus.islands) and gpus.count > 1
    pcie_tp = pcie_only and spec.allow_pcie_tensor_parallel
    sizes = [spec.pipeline_parallel_size] if spec.pipeline_parallel_size else range(2, min(hosts, MAX_AUTO_NODES) + 1)
    tried: list[Pipeline] = []
    for nodes in sizes:
        if pp_problem(arch, nodes) is not None:
            continue
        fitting = []
        for tp in candidate_tps(arch, gpus, spec, pcie_tp):
            p = pipeline(spec, gpus, arch, precision, nodes, tp, pcie_tp)
            if p is not None:
                tried.append(p)
                if p.fits:
                    fitting.append(p)
        if fitting:
            count = max(1, hosts // nodes)
            for p in fitting:
                if p.workload_concurrency * count >= spec.workload.target_concurrency:
                    return p, tried
            return max(fitting, key=lambda p: (p.workload_concurrency, -p.tp)), tried
    return None, tried


def nodes_needed(spec: HostSpec, gpus: HostGpus, arch: ModelArch, hosts: int = MAX_AUTO_NODES) -> Pipeline | None:
    """The fewest hosts like this one that serve the model as one multi-node instance (None: not even ``hosts``)."""
    try:
        plain = dataclasses.replace(spec, pipeline_parallel_size=None)
        return choose(plain, gpus, arch, hosts)[0]
    except PlanError:
        return None


def describe(p: Pipeline) -> str:
    """A candidate in one line: nodes, TP, layers per node, KV tokens."""
    layers = "/".join(str(s.layers[1] - s.layers[0]) for s in p.stages)
    return (
        f"{p.nodes} hosts (PP {p.nodes} × TP {p.tp}), layers {layers}, {p.kv_tokens:,} KV tokens, "
        f"{p.workload_concurrency:,} concurrent requests of the workload"
    )


def _refusal(members: Sequence[HostSpec], gpus: HostGpus, arch: ModelArch, tried: list[Pipeline]) -> PlanProblem:
    first = members[0]
    names = ", ".join(s.name for s in members)
    details = [f"multi-node group of {len(members)} host(s) ({names}), each {gpus.count} GPU(s) ({gpus.source})"]
    for p in tried[-3:]:
        worst = min(p.stages, key=lambda s: s.memory.kv_budget)
        m = worst.memory
        details.append(
            f"{p.nodes} hosts at TP {p.tp}: stage {worst.rank} (layers {worst.layers[0]}-{worst.layers[1] - 1}) "
            f"budget {m.budget / GiB:.1f} GiB/GPU − weights {m.weights / GiB:.1f} − overhead "
            f"{(m.non_torch + m.activation_peak + m.cuda_graphs) / GiB:.1f} (estimated) = "
            f"KV {m.kv_budget / GiB:.1f} GiB → {m.kv_tokens:,} tokens; one sequence needs {m.max_model_len:,}"
        )
    ways = []
    if first.pipeline_parallel_size is not None:
        ways.append("remove pipeline_parallel_size (fleet tries every host count of the group)")
    more = nodes_needed(first, gpus, arch)
    if more is not None and more.nodes > len(members):
        ways.append(f"add hosts to the group: {describe(more)}")
    ways += ["weights: fp8 or kv_cache_dtype: fp8 (less memory per token and per layer)", "a smaller model"]
    return PlanProblem(first.name, f"{first.model} does not fit even across the multi-node group", details, ways)


def _flags(spec: HostSpec, inst: Instance, p: Pipeline, rank: int, master: tuple[str, int]) -> tuple[Flag, ...]:
    stages = "/".join(str(s.layers[1] - s.layers[0]) for s in p.stages)
    out: list[Flag] = []
    for f in inst.flags:
        if f.option == "--tensor-parallel-size":
            f = Flag(f.option, f.value, f"GPU(s) {list(p.group)} in one NVLink island of each host; tensor "
                     "parallel stays inside a host, the stages talk across hosts")  # fmt: skip
        out.append(f)
        if f.option == "--tensor-parallel-size":
            out += [
                Flag("--pipeline-parallel-size", str(p.nodes),
                     "one pipeline stage per host: "
                     + ("inventory pipeline_parallel_size" if spec.pipeline_parallel_size
                        else "the fewest of the group's hosts that hold the model")
                     + f" (layers per stage {stages}, vLLM's get_pp_indices)"),
                Flag("--distributed-executor-backend", "mp",
                     "vLLM's multiprocessing backend across nodes (no Ray); vLLM picks it for --nnodes > 1 on CUDA"),
                Flag("--nnodes", str(p.nodes), "hosts of the instance"),
                Flag("--node-rank", str(rank), f"this host's place in the instance (0 leads: {master[0]})"),
                Flag("--master-addr", master[0], "the leader's address: every node joins its torch.distributed store"),
                Flag("--master-port", str(master[1]), "inventory master_port: the leader's rendezvous port"),
            ]  # fmt: skip
    if rank > 0:
        out.append(Flag("--headless", None, "a worker node: no API server; the leader serves the instance"))
    return tuple(out)


def plan_multi_node(
    members: Sequence[HostSpec], gpus: Mapping[str, HostGpus], arch: ModelArch, leader_address: Mapping[str, str]
) -> dict[str, HostPlan]:
    """Plan the hosts of one multi-node group as instances spanning hosts, or ``PlanError``.

    ``gpus``: each member's GPUs; ``leader_address``: the address other nodes reach each host at.
    Hosts are taken in inventory order, ``nodes`` at a time; hosts left over serve nothing (a warning).
    """
    first = members[0]
    if (why := same_gpus({s.name: gpus[s.name] for s in members})) is not None:
        raise PlanError(PlanProblem(first.name, why, ways_out=["put hosts with other GPUs in a group of their own"]))
    g = gpus[first.name]
    if first.pipeline_parallel_size is not None and (why := pp_problem(arch, first.pipeline_parallel_size)):
        raise PlanError(PlanProblem(first.name, f"pipeline_parallel_size={first.pipeline_parallel_size}: {why}"))
    if arch.is_hybrid and (why := pp_problem(arch, 2)) is not None:
        raise PlanError(PlanProblem(first.name, why, ways_out=["a model whose layers all use full attention"]))
    chosen, tried = choose(first, g, arch, len(members))
    if chosen is None:
        raise PlanError(_refusal(members, g, arch, tried))
    precision = resolve_precision(first, arch)
    count = len(members) // chosen.nodes
    met = chosen.workload_concurrency * count >= first.workload.target_concurrency
    plans: dict[str, HostPlan] = {}
    for k in range(count):
        team = members[k * chosen.nodes : (k + 1) * chosen.nodes]
        hosts = tuple(s.name for s in team)
        master = (leader_address[hosts[0]], first.master_port)
        for stage, spec in zip(chosen.stages, team, strict=True):
            base = _instance(spec, met, g, arch, precision, 0, chosen.group, chosen.tp, stage.memory, stage.utilization)
            role = NodeRole(
                stage.rank, hosts, stage.layers, tuple(s.layers[1] - s.layers[0] for s in chosen.stages),
                f"{master[0]}:{master[1]}", chosen.kv_tokens, chosen.kv_blocks,
            )  # fmt: skip
            inst = dataclasses.replace(base, flags=_flags(spec, base, chosen, stage.rank, master), node=role)
            _validate_argv(spec, inst)
            plans[spec.name] = _host_plan(spec, g, arch, precision, inst, chosen, met)
    for spec in members[count * chosen.nodes :]:
        plans[spec.name] = HostPlan(
            spec.name, spec.model, arch.source, g.source, spec.vllm_version, precision.name,
            weight_bytes(arch, precision), (),
            warnings=(f"serves nothing: instances of {chosen.nodes} hosts leave it over in its multi-node group",),
            idle_gpus=tuple(range(g.count)),
        )  # fmt: skip
    return plans


def _host_plan(
    spec: HostSpec, g: HostGpus, arch: ModelArch, precision: Precision, inst: Instance, p: Pipeline, met: bool
) -> HostPlan:
    assert inst.node is not None
    cuda = plan_cuda(spec, g)
    node = inst.node
    start, end = node.layers
    m = inst.memory
    notes = [
        f"multi-node instance: {p.nodes} hosts ({', '.join(node.hosts)}), leader {node.leader}; this host is node "
        f"{node.rank}" + (" (headless: no API server)" if node.headless else " (serves the API)"),
        f"layers {start}-{end - 1} of {arch.num_layers} (vLLM's get_pp_indices: {'/'.join(map(str, node.partition))}"
        " per stage; VLLM_PP_LAYER_PARTITION is not set)",
        f"weights of this stage {m.weights * p.tp / GiB:.1f} GiB ({precision.name}; "
        + ("the input embedding, " if node.rank == 0 else "")
        + ("the LM head, " if node.rank == p.nodes - 1 else "")
        + "decoder layers by their parameters)",
        f"KV cache: this node has room for {m.kv_blocks:,} blocks ({m.kv_tokens:,} tokens); vLLM gives every node "
        f"the smallest node's {node.instance_kv_blocks:,} blocks: {node.instance_kv_tokens:,} tokens for the instance",
    ]
    warnings = []
    if not met:
        warnings.append(
            f"target concurrency {spec.workload.target_concurrency} not met: the instance holds "
            f"{p.workload_concurrency} requests of {spec.workload.kv_tokens_per_request} unique KV tokens"
        )
    idle = tuple(i for i in range(g.count) if i not in p.group)
    if idle:
        warnings.append(f"GPUs {', '.join(map(str, idle))} stay idle: one node of a multi-node instance per host")
    notes += cuda.reasons
    if cuda.env:
        inst = dataclasses.replace(inst, env=inst.env + cuda.env)
    return HostPlan(
        spec.name, spec.model, arch.source, g.source, spec.vllm_version, precision.name,
        weight_bytes(arch, precision), (inst,), tuple(notes), tuple(warnings), idle, cuda=cuda,
    )  # fmt: skip
