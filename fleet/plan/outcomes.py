"""The fleet plan: one value for the fleet, built by one function (``build_fleet_plan``) from the
inventory (validated once) and the facts (probed once, by the command, as far as it needs them).

Every host with its spec, its GPUs and where they came from (``GpuDecision``: declared, probed,
the difference), its plan or why it has none; every instance with its placements (host, GPUs,
node rank: shaped so that an instance can span hosts; today each has one), port, address,
served name, and every flag with its reason. Pure given its facts. ``fleet plan --json`` is its
serialization (``outcome_data``); ``plan_fleet`` loads, probes (read-only) and builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.errors import FleetError, InventoryError, ModelConfigError, PlanError, PlanProblem
from fleet.facts import PROBE_CONNECT_TIMEOUT
from fleet.facts.sshlink import SshTarget
from fleet.gpus import GiB, HostGpus
from fleet.inventory.multinode import pools
from fleet.inventory.spec import HostSpec, LoadedInventory, ModelSource, load_inventory
from fleet.model.arch import ModelArch, load_model
from fleet.model.mirror import fetch_planning_files
from fleet.model.store import fetch_store_planning_files
from fleet.plan.extra_args import extra_args_problems
from fleet.plan.gpu_source import (
    AllGpusQuarantined,
    GpuDecision,
    GpusNotKnownYet,
    decide_gpus,
    gpus_for,
    planning_gpus_of,
)
from fleet.plan.lora import field_problem as lora_field_problem
from fleet.plan.models import plan_models, served_names
from fleet.plan.multinode import describe, nodes_needed, plan_multi_node
from fleet.plan.planner import SET_BY_FLEET, Flag, HostPlan, Instance, MemoryMath, plan_host
from fleet.plan.speculative import draft_key
from fleet.plan.speculative import field_problem as speculative_field_problem

if TYPE_CHECKING:
    from pyinfra.api.inventory import Inventory

    from fleet.facts.hostfacts import HostFacts
    from fleet.facts.runner import HostUnreachable


@dataclass(frozen=True)
class Placement:
    """Where (part of) an instance runs: a host, its GPUs there, and the node's rank in the instance."""

    host: str
    gpus: tuple[int, ...]
    node_rank: int = 0


@dataclass(frozen=True)
class PlannedInstance:
    """One vLLM instance of the fleet: its unit on its first host, where it runs, how it is reached."""

    host: str  #: the host whose unit serves it (node rank 0)
    name: str  #: ``vllm-0``
    unit: str  #: ``fleet-vllm-0.service``
    placements: tuple[Placement, ...]
    port: int
    url: str
    served_name: str  #: what ``/v1/models`` lists
    spec: Instance  #: argv, env, every flag with its reason, the memory arithmetic


def _address(spec: HostSpec) -> str:
    """Where the host's instances are reached: the bind address unless a wildcard, else the machine."""
    address = spec.bind_address if spec.bind_address not in (None, "0.0.0.0", "::") else None
    return address or spec.ssh_hostname or spec.name


@dataclass(frozen=True)
class HostOutcome:
    """The plan of one host, or why it has none."""

    spec: HostSpec
    plan: HostPlan | None
    problem: PlanProblem | None
    #: the problem is in the input (a model config.json), not in what the host can serve: exit 2
    invalid_input: bool = False
    gpus: GpuDecision | None = field(default=None, compare=False)  #: declared, probed, chosen, differences
    #: why a deploy or rollout cannot plan the host, as it reports it (GpuMismatch, GpusNotKnownYet, PlanError)
    refusal: FleetError | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.plan is not None

    @property
    def served_name(self) -> str | None:
        return (self.spec.served_model_name or self.plan.model) if self.plan is not None else None

    @property
    def instances(self) -> tuple[PlannedInstance, ...]:
        """The instances this host serves; one spanning hosts is listed once, at its leader (node 0)."""
        if self.plan is None:
            return ()
        name, address = self.spec.name, _address(self.spec)
        served = served_names(self.plan, self.served_name or self.plan.model)
        return tuple(
            PlannedInstance(
                name,
                i.unit_name,
                f"fleet-{i.unit_name}.service",
                tuple(Placement(h, i.gpus, r) for r, h in enumerate(i.node.hosts))
                if i.node is not None
                else (Placement(name, i.gpus),),
                i.port,
                f"http://{address}:{i.port}",
                served[i.index],
                i,
            )
            for i in self.plan.instances
            if i.serves
        )

    @property
    def multi_node(self) -> bool:
        """Whether this host is a node of an instance spanning hosts."""
        return self.plan is not None and any(i.node is not None for i in self.plan.instances)


def planning_inputs(spec: HostSpec) -> HostSpec:
    """The part of a host spec its plan depends on: everything but the host's name and place
    (where it is written, its groups, the machine's address, SSH port and reboot command: ``plan_host``
    reads none).

    Hosts whose planning inputs (this, their GPU facts and their model) are equal get equal
    plans, so a fleet of identical hosts costs one plan (``plan_inventory``).
    """
    return dataclasses.replace(
        spec, name="", inventory="", groups=(), ssh_hostname=None, ssh_port=22, reboot_command=None
    )


def _renamed(
    outcome: tuple[HostPlan | None, PlanProblem | None], host: str
) -> tuple[HostPlan | None, PlanProblem | None]:
    plan, problem = outcome
    if plan is not None:
        plan = dataclasses.replace(plan, host=host)
    if problem is not None:
        problem = dataclasses.replace(problem, host=host)
    return plan, problem


def _plan_all(
    specs: tuple[HostSpec, ...],
    gpus_of: Callable[[HostSpec], HostGpus],
    model_loader: Callable[[str, str | None], ModelArch],
    decisions: Mapping[str, GpuDecision] | None = None,
) -> list[HostOutcome]:
    """Plan every host from ``gpus_of``; problems are collected per host, never raised half-way.

    Plans are memoized on the planning inputs (spec without the host name, GPU facts, model):
    ``plan_host`` is pure, so identical hosts share one computation.
    """
    outcomes = []
    models: dict[tuple[str, str | None], ModelArch | ModelConfigError] = {}
    plans: dict[object, tuple[HostPlan | None, PlanProblem | None]] = {}

    def arch(key: tuple[str, str | None]) -> ModelArch:
        """The model of ``key``, loaded once per planning (a failure too: raised each time)."""
        if key not in models:
            try:
                models[key] = model_loader(*key)
            except ModelConfigError as exc:
                models[key] = exc
        found = models[key]
        if isinstance(found, ModelConfigError):
            raise found
        return found

    for spec in specs:
        decision = decisions.get(spec.name) if decisions is not None else None
        try:
            if spec.models:
                outcomes.append(_plan_models(spec, gpus_of, arch, decision))
                continue
            key = (spec.model, spec.model_config)
            model = arch(key)
            draft = arch(dkey) if (dkey := draft_key(spec)) is not None else None
            if (bad := speculative_field_problem(spec, model, draft)) is not None:
                raise InventoryError([bad])
            if (bad := lora_field_problem(spec, model)) is not None:
                raise InventoryError([bad])
            gpus = gpus_of(spec)
            memo: object = (planning_inputs(spec), gpus, key)
            try:
                cached = plans.get(memo)
            except TypeError:  # an unhashable input: plan without sharing
                memo, cached = None, None
            if cached is None:
                try:
                    cached = (plan_host(spec, gpus, model, draft=draft), None)
                except PlanError as exc:
                    cached = (None, exc.problem)
                if memo is not None:
                    plans[memo] = cached
            plan, problem = _renamed(cached, spec.name)
            refusal = PlanError(problem) if problem is not None else None
            outcomes.append(HostOutcome(spec, plan, problem, gpus=decision, refusal=refusal))
        except PlanError as exc:
            outcomes.append(HostOutcome(spec, None, exc.problem, gpus=decision, refusal=exc))
        except ModelConfigError as exc:
            outcomes.append(
                HostOutcome(
                    spec, None, PlanProblem(spec.name, str(exc)), invalid_input=True, gpus=decision, refusal=exc
                )
            )
        except InventoryError as exc:  # speculative that does not go with the model: input, like the inventory
            outcomes.append(
                HostOutcome(
                    spec, None, PlanProblem(spec.name, str(exc)), invalid_input=True, gpus=decision, refusal=exc
                )
            )
        except FleetError as exc:
            outcomes.append(HostOutcome(spec, None, PlanProblem(spec.name, str(exc)), gpus=decision, refusal=exc))
    return _across_hosts(specs, outcomes, gpus_of, models)


def _plan_models(
    spec: HostSpec,
    gpus_of: Callable[[HostSpec], HostGpus],
    arch: Callable[[tuple[str, str | None]], ModelArch],
    decision: GpuDecision | None,
) -> HostOutcome:
    """A host with ``models`` (``fleet.plan.models``): every entry's model read and checked, then
    each planned on its GPUs. Raises what ``_plan_all`` turns into the host's problem."""
    archs: list[tuple[ModelArch, ModelArch | None]] = []
    for m in spec.model_specs:
        model = arch((m.model, m.model_config))
        draft = arch(dkey) if (dkey := draft_key(m)) is not None else None
        if (bad := speculative_field_problem(m, model, draft)) is not None:
            raise InventoryError([bad])
        archs.append((model, draft))
    try:
        plan = plan_models(spec, gpus_of(spec), archs)
    except PlanError as exc:
        return HostOutcome(spec, None, exc.problem, gpus=decision, refusal=exc)
    return HostOutcome(spec, plan, None, gpus=decision)


def _does_not_fit(outcome: HostOutcome) -> bool:
    """The host was refused because the model does not fit it (``planner._no_fit``), nothing else."""
    return (
        outcome.plan is None
        and type(outcome.refusal) is PlanError
        and outcome.problem is not None
        and any(w in outcome.problem.summary for w in ("does not fit", "do not fit", "no room for one sequence"))
    )


def _across_hosts(
    specs: tuple[HostSpec, ...],
    outcomes: list[HostOutcome],
    gpus_of: Callable[[HostSpec], HostGpus],
    models: Mapping[tuple[str, str | None], ModelArch | ModelConfigError],
) -> list[HostOutcome]:
    """Instances spanning hosts (``fleet.plan.multinode``): a ``multi_node`` group whose model fits
    none of its hosts is planned as a whole; a host that did not opt in learns how many would do."""
    by_name = {o.spec.name: k for k, o in enumerate(outcomes)}
    for pool in pools(specs).values():
        names = {m.name for m in pool}
        members = [s for s in specs if s.name in names]
        found = [outcomes[by_name[s.name]] for s in members]
        arch = models.get((members[0].model, members[0].model_config))
        if not all(_does_not_fit(o) for o in found) or not isinstance(arch, ModelArch):
            continue
        try:
            gpus = {s.name: gpus_of(s) for s in specs if s.name in {m.name for m in members}}
            team = [s for s in specs if s.name in {m.name for m in members}]
            plans = plan_multi_node(team, gpus, arch, {s.name: _address(s) for s in team})
            for o in found:
                outcomes[by_name[o.spec.name]] = dataclasses.replace(
                    o, plan=plans[o.spec.name], problem=None, refusal=None
                )
        except PlanError as exc:
            for o in found:
                problem = dataclasses.replace(exc.problem, host=o.spec.name)
                outcomes[by_name[o.spec.name]] = dataclasses.replace(o, problem=problem, refusal=PlanError(problem))
    for k, o in enumerate(outcomes):
        arch = models.get((o.spec.model, o.spec.model_config))
        if o.spec.multi_node or o.spec.models or not _does_not_fit(o):
            continue
        if not isinstance(arch, ModelArch) or o.problem is None:
            continue
        try:
            needed = nodes_needed(o.spec, gpus_of(o.spec), arch)
        except FleetError:
            continue
        if needed is None:
            continue
        way = f"multi_node: true on a group of {needed.nodes} such hosts: {describe(needed)}"
        problem = dataclasses.replace(o.problem, ways_out=[*o.problem.ways_out, way])
        outcomes[k] = dataclasses.replace(o, problem=problem, refusal=PlanError(problem))
    return outcomes


def plan_inventory(
    inventory: LoadedInventory,
    probed: Mapping[str, HostGpus] | None = None,
    model_loader: Callable[[str, str | None], ModelArch] = load_model,
) -> list[HostOutcome]:
    """Plan every host from ``probed`` GPU facts where given, else its inventory ``gpu`` entry."""
    return _plan_all(inventory.hosts, lambda spec: gpus_for(spec, probed), model_loader)


def load_for_planning(
    path: str | Path, limit: list[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> LoadedInventory:
    """Load an inventory to plan it: every host's model config is read here with the rest of the
    checks, so a missing model on one host is reported together with a bad value on another; and
    each host's ``vllm_extra_args`` against its pinned vLLM's surface (``fleet.plan.extra_args``).
    A ``hub`` source's planning files (``config.json``...) are read from the mirror when this
    machine has no copy that matches it (``fleet.model.mirror.fetch_planning_files``), a ``store``
    source's from the store host (``fleet.model.store``)."""
    return load_inventory(
        path, limit, overrides, model_check=load_model, host_check=extra_args_problems, source_check=planning_files,
    )  # fmt: skip


def planning_files(source: ModelSource, model: str, inventory: Inventory) -> Path | None:
    """``model``'s planning files from a ``hub`` or ``store`` source into ``source.planning_dir(model)``
    on this machine (``SourceCheck``); a store host is reached with its own inventory SSH settings
    and ``known_hosts``. ``FleetError`` says why not."""
    if source.kind == "dir":
        return None
    if source.kind == "hub":
        return fetch_planning_files(source, model)
    assert source.host is not None, "a store source names its host"
    store = inventory.get_host(source.host, None)
    if store is None:  # refused before (``fleet.inventory.spec.store_problems``)
        raise FleetError(f"model_source: store {source.host} is not a host of this inventory")
    data = store.data.dict()  # type: ignore[no-untyped-call]
    target = SshTarget.from_data(source.host, data)
    return fetch_store_planning_files(target, source.path, model, Path(source.planning_dir(model)))


def plan_file(path: str | Path, limit: list[str] | None = None) -> list[HostOutcome]:
    """Plan an inventory from its own ``gpu`` data (no host is contacted)."""
    return plan_inventory(load_for_planning(path, limit))


@dataclass(frozen=True)
class FleetPlan:
    """The fleet: every selected host's outcome, and why some were planned from the inventory."""

    outcomes: list[HostOutcome]
    not_probed: dict[str, str]  #: host -> why its GPU facts come from the inventory
    loaded: LoadedInventory | None = field(default=None, compare=False)

    @property
    def hosts(self) -> list[HostOutcome]:
        return self.outcomes

    def host(self, name: str) -> HostOutcome:
        return next(o for o in self.outcomes if o.spec.name == name)

    def instances(self) -> list[PlannedInstance]:
        """Every instance of the fleet, inventory order (hosts, then their instances)."""
        return [i for o in self.outcomes for i in o.instances]

    def refusals(self) -> list[str]:
        """Why a deploy or rollout cannot plan some hosts, one text per host (empty: all planned)."""
        return [str(o.refusal) for o in self.outcomes if o.plan is None and o.refusal is not None]


def _answer(result: HostFacts | HostUnreachable | str | None) -> HostFacts | str | None:
    """A probe answer as ``decide_gpus`` takes it: HostUnreachable becomes its reason."""
    from fleet.facts.hostfacts import HostFacts

    if result is None or isinstance(result, HostFacts | str):
        return result
    return result.reason


def build_fleet_plan(
    loaded: LoadedInventory,
    probes: Mapping[str, HostFacts | HostUnreachable | str | None] | None = None,
    *,
    deploy: bool = False,
    model_loader: Callable[[str, str | None], ModelArch] = load_model,
    quarantine: Mapping[str, Mapping[int, str]] | None = None,
) -> FleetPlan:
    """The one function from inventory and facts to the fleet plan (pure given its inputs).

    ``probes``: each probed host's NVML answer (hosts not in it, or ``probes`` None: not probed).
    ``deploy``: plan as a deploy or rollout does (``fleet.plan.gpu_source``: an inventory entry the
    probe contradicts refuses the host; a host whose NVML does not answer yet and that declares
    nothing waits); otherwise as ``fleet plan`` does (the probe where it answered with GPUs, else the
    declaration, and the difference shown). ``quarantine``: host -> GPU index -> why (the GPU
    watcher's records, ``fleet.gpuwatch.state.read_quarantine``): planned around.
    """
    answers = {name: _answer(r) for name, r in (probes or {}).items()}
    held = quarantine or {}
    decisions = {s.name: decide_gpus(s, answers.get(s.name), held.get(s.name)) for s in loaded.hosts}
    if deploy:

        def gpus_of(spec: HostSpec) -> HostGpus:
            d = decisions[spec.name]
            if d.refusal is not None:
                raise d.refusal
            if d.chosen.gpus is None:
                raise GpusNotKnownYet(spec.name, d.chosen.why)
            return d.chosen.gpus

        return FleetPlan(_plan_all(loaded.hosts, gpus_of, model_loader, decisions), {}, loaded)
    probed = {name: d.probed for name, d in decisions.items() if d.probed is not None}
    notes = planning_gpus_of(probes)[1] if probes is not None else {}

    def plan_gpus(spec: HostSpec) -> HostGpus:
        refusal = decisions[spec.name].refusal
        if isinstance(refusal, AllGpusQuarantined):
            raise refusal
        return gpus_for(spec, probed)

    outcomes = _plan_all(loaded.hosts, plan_gpus, model_loader, decisions)
    return FleetPlan(outcomes, notes, loaded)


def plan_fleet(
    path: str | Path, limit: list[str] | None = None, offline: bool = False, probe_timeout: float | None = None
) -> FleetPlan:
    """Plan an inventory from probed GPU facts where hosts answer (read-only), else its ``gpu`` data.

    ``probe_timeout``: seconds to wait for each host's SSH port (all hosts at once); None: the
    probe's default (``fleet.facts.PROBE_CONNECT_TIMEOUT``).
    """
    loaded = load_for_planning(path, limit)
    if offline:
        return build_fleet_plan(loaded)
    from fleet.facts.hostfacts import HostFacts
    from fleet.facts.probed import probe_hosts
    from fleet.gpuwatch.state import read_quarantine

    connect = PROBE_CONNECT_TIMEOUT if probe_timeout is None else probe_timeout
    answers = probe_hosts(loaded, connect_timeout=connect)
    reachable = dataclasses.replace(
        loaded, hosts=tuple(h for h in loaded.hosts if isinstance(answers.get(h.name), HostFacts))
    )
    return build_fleet_plan(loaded, answers, quarantine=read_quarantine(reachable, connect_timeout=connect))


# -- data for --json --------------------------------------------------------------------------------


def _gib(n: int) -> float:
    return round(n / GiB, 3)


def _flag_data(flag: Flag) -> dict[str, Any]:
    """A flag for --json; one the inventory set (``vllm_extra_args``) says so, and all its values."""
    data: dict[str, Any] = {"option": flag.option, "value": flag.value, "reason": flag.reason}
    if flag.more:
        data["values"] = [flag.value, *flag.more]
    if flag.set_by != SET_BY_FLEET:
        data["set_by"] = flag.set_by
    return data


def instance_data(instance: Instance, venv: str = "/opt/fleet/vllm") -> dict[str, Any]:
    m = instance.memory
    data: dict[str, Any] = {
        "index": instance.index,
        "unit": f"fleet-{instance.unit_name}.service",
        "gpus": list(instance.gpus),
        "tensor_parallel_size": instance.tensor_parallel_size,
        "port": instance.port,
        "argv": [f"{venv}/bin/vllm", "serve", *instance.argv],
        "env": dict(instance.env),
        "flags": [_flag_data(f) for f in instance.flags],
        "memory": {
            "gpu_total_gib": _gib(m.gpu_total),
            "nvml_total_gib": _gib(m.nvml_total),
            "cuda_total_gib": _gib(m.gpu_total),
            "driver_reserve_mib": m.reserved // 2**20,
            "driver_reserve_source": m.reserve_source,
            "gpu_memory_utilization": m.utilization,
            "budget_gib": _gib(m.budget),
            "weights_per_gpu_gib": _gib(m.weights),
            "non_torch_gib": _gib(m.non_torch),
            "activation_peak_gib": _gib(m.activation_peak),
            "cuda_graphs_gib": _gib(m.cuda_graphs),
            "kv_budget_gib": _gib(m.kv_budget),
            "kv_bytes_per_token": m.kv_bytes_per_token,
            "kv_tokens": m.kv_tokens,
            "kv_tokens_uncertainty": m.kv_tokens_uncertainty,
            "kv_blocks": m.kv_blocks,
            "kv_groups": (
                [
                    {"kind": g.kind.value, "layers": g.layers, "slots": g.slots, "window": g.window}
                    for g in m.kv_layout.groups
                ]
                if m.kv_layout is not None
                else []
            ),
            "max_model_len": m.max_model_len,
            "max_concurrency": round(m.max_concurrency, 2),
            "workload_concurrency": m.workload_concurrency,
        },
    }
    if m.cpu_kv_cache_gib:  # vLLM's CPU build: its own arithmetic, no GPU terms (``cpu_memory``)
        data["memory"] = _cpu_memory_data(m)
    if m.lora is not None:  # LoRA adapters (absent otherwise)
        data["memory"]["lora_slots_per_gpu_gib"] = _gib(m.lora.bytes_per_gpu)
    if m.draft is not None:  # speculative decoding (absent otherwise)
        data["memory"]["draft_weights_per_gpu_gib"] = _gib(m.draft.weights)
        data["memory"]["draft_kv_bytes_per_block"] = m.draft.kv_bytes_per_block
    if (node := instance.node) is not None:  # a node of an instance spanning hosts (absent otherwise)
        data["node"] = {
            "rank": node.rank,
            "nnodes": len(node.hosts),
            "hosts": list(node.hosts),
            "leader": node.leader,
            "headless": node.headless,
            "master": node.master,
            "layers": [node.layers[0], node.layers[1]],
            "layers_per_node": list(node.partition),
            "node_kv_blocks": m.kv_blocks,
            "node_kv_tokens": m.kv_tokens,
            "instance_kv_blocks": node.instance_kv_blocks,
            "instance_kv_tokens": node.instance_kv_tokens,
            "instance_workload_concurrency": instance.workload_concurrency,
        }
    return data


def _cpu_memory_data(m: MemoryMath) -> dict[str, Any]:
    """An instance of vLLM's CPU build: the KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB in the host's memory."""
    return {
        "engine": "cpu",
        "kv_cache_space_gib": m.cpu_kv_cache_gib,
        "kv_budget_gib": _gib(m.kv_budget),
        "weights_gib": _gib(m.weights),
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "kv_tokens": m.kv_tokens,
        "kv_tokens_uncertainty": m.kv_tokens_uncertainty,
        "kv_blocks": m.kv_blocks,
        "kv_groups": [
            {"kind": g.kind.value, "layers": g.layers, "slots": g.slots, "window": g.window}
            for g in (m.kv_layout.groups if m.kv_layout is not None else ())
        ],
        "max_model_len": m.max_model_len,
        "max_concurrency": round(m.max_concurrency, 2),
        "workload_concurrency": m.workload_concurrency,
    }


def outcome_data(outcome: HostOutcome) -> dict[str, Any]:
    data: dict[str, Any] = {"host": outcome.spec.name, "ok": outcome.ok, "model": outcome.spec.model}
    if outcome.plan is not None:
        p = outcome.plan
        data.update(
            {
                "model_config": p.model_source,
                "gpus_source": p.gpus_source,
                "vllm_version": p.vllm_version,
                "weights_precision": p.weights_precision,
                "weights_gib": _gib(p.weight_bytes),
                "instances": [instance_data(i) for i in p.instances],
                "total_kv_tokens": p.total_kv_tokens,
                "workload_concurrency": p.workload_concurrency,
                "target_concurrency": outcome.spec.workload.target_concurrency,
                "notes": list(p.notes),
                "warnings": list(p.warnings),
                "idle_gpus": list(p.idle_gpus),
                "cuda": {"toolkit": p.cuda.toolkit, "compat": p.cuda.compat, "packages": list(p.cuda.packages)},
            }
        )
        if p.models:  # a host with models (absent otherwise): each entry's own plan, instances by index
            served = served_names(p, p.model)
            for inst, planned in zip(data["instances"], p.instances, strict=True):
                inst["model"], inst["served_name"] = planned.model, served[planned.index]
            data["models"] = [
                {
                    "entry": m.entry,
                    "model": m.model,
                    "served_name": m.served_name,
                    "gpus": list(m.gpus),
                    "instances": [i.index for i in m.plan.instances],
                    "model_config": m.plan.model_source,
                    "weights_precision": m.plan.weights_precision,
                    "weights_gib": _gib(m.plan.weight_bytes),
                    "total_kv_tokens": m.plan.total_kv_tokens,
                    "workload_concurrency": m.plan.workload_concurrency,
                    "target_concurrency": outcome.spec.models[k].spec.workload.target_concurrency,
                    "notes": list(m.plan.notes),
                    "warnings": list(m.plan.warnings),
                    "idle_gpus": list(m.plan.idle_gpus),
                }
                for k, m in enumerate(p.models)
            ]
    if outcome.problem is not None:
        pr = outcome.problem
        data["error"] = {"summary": pr.summary, "details": pr.details, "ways_out": pr.ways_out}
    return data
