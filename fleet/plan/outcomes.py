"""``fleet plan`` as a library: inventory in, one plan (or one problem) per host out.

GPU facts come from a probe of the host where it answers (``plan_fleet``; read-only), else from
the inventory's ``gpu`` entry. Planning itself touches no host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.errors import FleetError, ModelConfigError, PlanError, PlanProblem
from fleet.gpus import GiB, HostGpus
from fleet.inventory.spec import HostSpec, LoadedInventory, load_inventory
from fleet.model.arch import ModelArch, load_model
from fleet.plan.planner import HostPlan, Instance, plan_host


@dataclass(frozen=True)
class HostOutcome:
    """The plan of one host, or why it has none."""

    spec: HostSpec
    plan: HostPlan | None
    problem: PlanProblem | None
    #: the problem is in the input (a model config.json), not in what the host can serve: exit 2
    invalid_input: bool = False

    @property
    def ok(self) -> bool:
        return self.plan is not None


def gpus_for(spec: HostSpec, probed: Mapping[str, HostGpus] | None = None) -> HostGpus:
    """The GPU facts the planner uses for a host; ``PlanError`` if there are none."""
    if probed and spec.name in probed:
        return probed[spec.name]
    if spec.gpu is not None:
        return spec.gpu.host_gpus()
    raise PlanError(
        PlanProblem(
            spec.name,
            "no GPU facts: the host was not probed and the inventory has no gpu entry",
            ways_out=[
                "add gpu: {'sku': 'h100-sxm-80gb', 'count': 8} to the host's data",
                "probe the host (fleet audit)",
            ],
        )
    )


def planning_inputs(spec: HostSpec) -> HostSpec:
    """The part of a host spec its plan depends on: everything but the host's name and place
    (where it is written, its groups, the machine's address and SSH port: ``plan_host`` reads none).

    Hosts whose planning inputs (this, their GPU facts and their model) are equal get equal
    plans, so a fleet of identical hosts costs one plan (``plan_inventory``).
    """
    return dataclasses.replace(spec, name="", inventory="", groups=(), ssh_hostname=None, ssh_port=22)


def _renamed(
    outcome: tuple[HostPlan | None, PlanProblem | None], host: str
) -> tuple[HostPlan | None, PlanProblem | None]:
    plan, problem = outcome
    if plan is not None:
        plan = dataclasses.replace(plan, host=host)
    if problem is not None:
        problem = dataclasses.replace(problem, host=host)
    return plan, problem


def plan_inventory(
    inventory: LoadedInventory,
    probed: Mapping[str, HostGpus] | None = None,
    model_loader: Callable[[str, str | None], ModelArch] = load_model,
) -> list[HostOutcome]:
    """Plan every host; problems are collected per host, never raised half-way.

    Plans are memoized on the planning inputs (spec without the host name, GPU facts, model):
    ``plan_host`` is pure, so identical hosts share one computation.
    """
    outcomes = []
    models: dict[tuple[str, str | None], ModelArch | ModelConfigError] = {}
    plans: dict[object, tuple[HostPlan | None, PlanProblem | None]] = {}
    for spec in inventory.hosts:
        try:
            key = (spec.model, spec.model_config)
            if key not in models:
                try:
                    models[key] = model_loader(*key)
                except ModelConfigError as exc:
                    models[key] = exc
            model = models[key]
            if isinstance(model, ModelConfigError):
                raise model
            gpus = gpus_for(spec, probed)
            memo: object = (planning_inputs(spec), gpus, key)
            try:
                cached = plans.get(memo)
            except TypeError:  # an unhashable input: plan without sharing
                memo, cached = None, None
            if cached is None:
                try:
                    cached = (plan_host(spec, gpus, model), None)
                except PlanError as exc:
                    cached = (None, exc.problem)
                if memo is not None:
                    plans[memo] = cached
            plan, problem = _renamed(cached, spec.name)
            outcomes.append(HostOutcome(spec, plan, problem))
        except PlanError as exc:
            outcomes.append(HostOutcome(spec, None, exc.problem))
        except ModelConfigError as exc:
            outcomes.append(HostOutcome(spec, None, PlanProblem(spec.name, str(exc)), invalid_input=True))
        except FleetError as exc:
            outcomes.append(HostOutcome(spec, None, PlanProblem(spec.name, str(exc))))
    return outcomes


def load_for_planning(
    path: str | Path, limit: list[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> LoadedInventory:
    """Load an inventory to plan it: every host's model config is read here with the rest of the
    checks, so a missing model on one host is reported together with a bad value on another."""
    return load_inventory(path, limit, overrides, model_check=load_model)


def plan_file(path: str | Path, limit: list[str] | None = None) -> list[HostOutcome]:
    """Plan an inventory from its own ``gpu`` data (no host is contacted)."""
    return plan_inventory(load_for_planning(path, limit))


@dataclass(frozen=True)
class FleetPlan:
    """Plans of an inventory's hosts, and why some were planned from the inventory, not a probe."""

    outcomes: list[HostOutcome]
    not_probed: dict[str, str]  #: host -> why its GPU facts come from the inventory


def plan_fleet(
    path: str | Path, limit: list[str] | None = None, offline: bool = False, probe_timeout: float | None = None
) -> FleetPlan:
    """Plan an inventory from probed GPU facts where hosts answer (read-only), else its ``gpu`` data.

    ``probe_timeout``: seconds to wait for each host's SSH port (all hosts at once); None: the
    probe's default (``fleet.facts.PROBE_CONNECT_TIMEOUT``).
    """
    loaded = load_for_planning(path, limit)
    if offline:
        return FleetPlan(plan_inventory(loaded), {})
    from fleet.facts.probed import probe_host_gpus

    if probe_timeout is None:
        probed, notes = probe_host_gpus(loaded)
    else:
        probed, notes = probe_host_gpus(loaded, connect_timeout=probe_timeout)
    return FleetPlan(plan_inventory(loaded, probed), notes)


# -- data for --json --------------------------------------------------------------------------------


def _gib(n: int) -> float:
    return round(n / GiB, 3)


def instance_data(instance: Instance, venv: str = "/opt/fleet/vllm") -> dict[str, Any]:
    m = instance.memory
    return {
        "index": instance.index,
        "unit": f"fleet-{instance.unit_name}.service",
        "gpus": list(instance.gpus),
        "tensor_parallel_size": instance.tensor_parallel_size,
        "port": instance.port,
        "argv": [f"{venv}/bin/vllm", "serve", *instance.argv],
        "env": dict(instance.env),
        "flags": [{"option": f.option, "value": f.value, "reason": f.reason} for f in instance.flags],
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
            }
        )
    if outcome.problem is not None:
        pr = outcome.problem
        data["error"] = {"summary": pr.summary, "details": pr.details, "ways_out": pr.ways_out}
    return data
