"""Several models on one host (``models``, issue 23 part 5): each entry planned on its own GPUs.

A host with ``models`` gives its GPUs to the entries in order, as contiguous index ranges
(``entry_gpus``: the first entry GPUs ``0..n-1``, the next ``n..``), and plans each entry with the
one-model planner (``plan_host``) on its range alone, so the memory arithmetic, the flags and their
reasons are a one-model host's, unchanged. Instances are numbered across the host, so units
(``fleet-vllm-N.service``) and ports (``port + N``) never collide: an entry's instances are numbered
from its first GPU's place (the entries before it hold that many GPUs), not after the instances
the entries before it happen to get. So a change to one entry (its tensor parallel size, its
model) renders the same units, ports and files for every other entry, and a rollout restarts only
its instances (configuration revisions are per instance, ``fleet.render.revision``); numbers an
entry does not use (a 4-GPU entry at TP 4 has one instance) stay free. A range that cuts across
NVLink islands is said in the plan's warnings: tensor parallelism stays inside an island
(``gpu_groups``), so such an entry may get smaller groups than its GPU count suggests. Pure: no I/O.

The host's plan is one ``HostPlan`` whose ``instances`` are every entry's, with ``models`` holding
each entry's own plan (``ModelPlan``): what ``fleet plan`` shows per model, and where every other
command (render, balancer, status, rollout) finds which model each instance serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleet.errors import PlanError, PlanProblem
from fleet.gpus import HostGpus
from fleet.inventory.spec import HostSpec, ModelEntry
from fleet.model.arch import ModelArch
from fleet.plan.planner import HostPlan, ModelPlan, plan_host


def gpu_span(indices: Sequence[int]) -> str:
    """``0-3`` for a range of GPU indices, ``5`` for one (empty: ``none``)."""
    if not indices:
        return "none"
    return str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"


def entry_gpus(spec: HostSpec, gpus: HostGpus) -> list[tuple[ModelEntry, tuple[int, ...]]]:
    """Each ``models`` entry with the GPU indices it gets: contiguous ranges in index order, over
    every GPU of the host (a quarantined GPU keeps its place, so no entry moves when one is taken
    out: the entry just has one GPU fewer to plan on). ``PlanError`` when the entries want more
    GPUs than the host has (a probed host may have fewer than its ``gpu.count`` said)."""
    indices = sorted(g.index for g in gpus.gpus)
    wanted = sum(e.gpus for e in spec.models)
    if wanted > len(indices):
        counts = ", ".join(f"models[{e.index}] {e.spec.model}: {e.gpus}" for e in spec.models)
        raise PlanError(
            PlanProblem(
                spec.name,
                f"models: the entries' gpus add up to {wanted}, but the host has {len(indices)} GPU(s) ({gpus.source})",
                details=[counts],
                ways_out=["give the entries fewer GPUs (models[N].gpus)", "serve some of the models on another host"],
            )
        )
    out: list[tuple[ModelEntry, tuple[int, ...]]] = []
    at = 0
    for entry in spec.models:
        out.append((entry, tuple(indices[at : at + entry.gpus])))
        at += entry.gpus
    return out


def subset(gpus: HostGpus, indices: Sequence[int]) -> HostGpus:
    """``gpus`` with only ``indices`` usable: every island cut to them (as a quarantine is,
    ``fleet.gpuwatch.quarantine.usable_gpus``); indices keep their meaning."""
    keep = frozenset(indices)
    return dataclasses.replace(gpus, islands=tuple(i & keep for i in gpus.islands if i & keep))


def island_warning(entry: ModelEntry, gpus: HostGpus, indices: Sequence[int]) -> str | None:
    """Why an entry's range is not inside one NVLink island, where the host has islands of 2+ GPUs."""
    if not any(len(i) > 1 for i in gpus.islands) or len(indices) < 2:
        return None
    touched = sorted({min(gpus.island_of(i)) for i in indices if gpus.island_of(i) & set(indices)})
    if len(touched) < 2:
        return None
    islands = "; ".join(
        gpu_span(sorted(gpus.island_of(i) & set(indices))) for i in touched if gpus.island_of(i) & set(indices)
    )
    return (
        f"models[{entry.index}] {entry.spec.model}: its GPUs {gpu_span(indices)} span NVLink islands (its part "
        f"of each: {islands}); tensor parallel stays inside one island: order the entries or size their gpus to follow "
        "the islands"
    )


def _shared(parts: Sequence[HostPlan], attr: str) -> list[str]:
    """The lines every entry's plan has (the host's own: CUDA packages, ...), once, in order."""
    first: tuple[str, ...] = getattr(parts[0], attr)
    return [line for line in first if all(line in getattr(p, attr) for p in parts[1:])]


def plan_models(spec: HostSpec, gpus: HostGpus, archs: Sequence[tuple[ModelArch, ModelArch | None]]) -> HostPlan:
    """The plan of a host with ``models``: each entry planned by ``plan_host`` on its GPUs
    (``archs``: each entry's model and draft, in entry order), its instances numbered from its
    first GPU's place. ``PlanError`` names the entry, its GPUs and the one-model planner's problem."""
    assert spec.models and len(archs) == len(spec.models)
    parts: list[ModelPlan] = []
    warnings: list[str] = []
    first = 0  # instances of an entry are numbered from its first GPU's place: stable across the others' changes
    given = entry_gpus(spec, gpus)
    for (entry, indices), (arch, draft) in zip(given, archs, strict=True):
        if (why := island_warning(entry, gpus, indices)) is not None:
            warnings.append(why)
        try:
            plan = plan_host(entry.spec, subset(gpus, indices), arch, draft=draft, first_index=first)
        except PlanError as exc:
            p = exc.problem
            raise PlanError(
                dataclasses.replace(
                    p, summary=f"models[{entry.index}] {entry.spec.model} on GPU(s) {gpu_span(indices)}: {p.summary}"
                )
            ) from None
        first += entry.gpus
        served = entry.spec.served_model_name or entry.spec.model
        parts.append(ModelPlan(entry.index, entry.spec.model, served, indices, plan))
    plans = [m.plan for m in parts]
    shared_notes, shared_warnings = _shared(plans, "notes"), _shared(plans, "warnings")
    notes = list(shared_notes)
    for m in parts:
        notes.append(f"models[{m.entry}] {m.model}: GPU(s) {gpu_span(m.gpus)}, {len(m.plan.instances)} instance(s)")
        notes += [f"models[{m.entry}] {m.model}: {n}" for n in m.plan.notes if n not in shared_notes]
        warnings += [f"models[{m.entry}] {m.model}: {w}" for w in m.plan.warnings if w not in shared_warnings]
    warnings = shared_warnings + warnings
    given_to = {i for _, indices in given for i in indices}
    unused = tuple(sorted(g.index for g in gpus.gpus if g.index not in given_to and g.index in gpus.usable))
    if unused:
        warnings.append(f"GPUs {', '.join(map(str, unused))} are given to no entry of models: they stay idle")
    idle = tuple(sorted({*unused, *(i for p in plans for i in p.idle_gpus)}))
    head = plans[0]
    return HostPlan(
        host=spec.name,
        model=head.model,
        model_source=head.model_source,
        gpus_source=gpus.source,
        vllm_version=head.vllm_version,
        weights_precision=", ".join(dict.fromkeys(p.weights_precision for p in plans)),
        weight_bytes=sum(p.weight_bytes for p in plans),
        instances=tuple(i for p in plans for i in p.instances),
        notes=tuple(notes),
        warnings=tuple(warnings),
        idle_gpus=idle,
        cuda=head.cuda,
        models=tuple(parts),
    )


def served_names(plan: HostPlan, default: str) -> dict[int, str]:
    """Instance index -> the name it answers to (``/v1/models``): its entry's with ``models``,
    else ``default`` (the host's served name) for every instance."""
    if not plan.models:
        return {i.index: default for i in plan.instances}
    return {i.index: m.served_name for m in plan.models for i in m.plan.instances}
