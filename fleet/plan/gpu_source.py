"""Which GPU facts a deploy plans a host from: its NVML probe, its inventory ``gpu`` entry, or none yet.

The decision (:func:`gpu_source`) is pure: the probe's answer comes in, one of three outcomes
goes out.

* The probe answers (NVML status ``ok``): the host is planned from what it has. An inventory
  ``gpu`` entry is then a check: a different GPU count, GPU model or memory size, or NVLink
  islands is a :class:`GpuMismatch` that names the host, both sides and the way out, and the
  host is refused before anything is written.
* NVML does not answer yet (no driver, the driver installed but not loaded until the reboot; no
  Python, or a probe answer from a fleet that did not carry pynvml): the inventory's ``gpu``
  entry if there is one; otherwise the host waits: its units are not rendered in this run.
* NVML answers with an error (no permission, a driver error, the probe crashed, no answer at all):
  the inventory's ``gpu`` entry if there is one, otherwise a refusal.

A probed GPU's memory in use counts without what our own units hold (``fleet-vllm-*.service``
processes, from the probe's process list and their cgroups): a deploy replaces them, so a serving
host plans the same as when its units are stopped, and a second deploy changes nothing. Memory
held by anything else lowers ``--gpu-memory-utilization`` (``fleet.plan.planner.utilization_for``),
and preflight refuses GPUs another process holds.

Memory sizes are compared within 1 %, the tolerance the audit uses between a probed GPU and its
catalogue entry (NVML's ``nvmlDeviceGetMemoryInfo().total`` is a little under the marketing size,
see ``fleet.gpus``); islands are the NVLink groups tensor parallelism may span
(``fleet.topology.islands`` for a probe, ``fleet.gpus.nvlink_islands`` for a declared fabric),
compared by their sizes: the inventory says how the GPUs are joined, not which index pairs with
which (a probed host is planned from its real islands).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fleet.errors import FleetError, PlanError, PlanProblem
from fleet.facts.hostfacts import GpuFacts, HostFacts
from fleet.facts.units import OUR_UNIT_PREFIX
from fleet.gpus import CATALOGUE, GiB, HostGpus
from fleet.gpuwatch.quarantine import usable_gpus
from fleet.inventory.spec import GpuSpec, HostSpec
from fleet.topology import host_gpus

if TYPE_CHECKING:  # not at run time: fleet plan --offline does not load paramiko
    from fleet.facts.runner import HostUnreachable

#: probe statuses that mean "NVML does not answer yet, and a deploy is what brings it":
#: no driver, a driver installed and not loaded until the reboot (``fleet.facts.nvml_probe`` sets
#: these); ``no-pynvml`` only from a probe that did not carry pynvml (``fleet.facts.nvml`` does)
NOT_YET = ("no-python", "no-pynvml", "no-nvml-library", "driver-not-loaded", "lib-rm-version-mismatch")
#: relative difference of memory totals still taken as the same GPU (the audit's tolerance)
MEMORY_TOLERANCE = 0.01


class GpuMismatch(FleetError):
    """The inventory's ``gpu`` entry disagrees with what the probe found on the host."""

    def __init__(self, host: str, differences: list[str]):
        self.host, self.differences = host, differences
        super().__init__(
            f"host {host}: the inventory's gpu entry does not match the host's GPUs: "
            + "; ".join(differences)
            + ". Fix the host's gpu entry, or remove it to plan from the probe (if a GPU is missing, check "
            "the host first: fleet audit)"
        )


class GpusNotKnownYet(FleetError):
    """NVML does not answer yet and the inventory has no ``gpu`` entry: the host's units wait."""

    def __init__(self, host: str, why: str):
        self.host, self.why = host, why
        super().__init__(
            f"host {host}: its units wait for NVML to answer ({why}; the inventory has no gpu entry): the "
            "deploy renders them once it does, once the release is installed or, for a new driver, after "
            "the reboot (fleet deploy --reboot)"
        )


@dataclass(frozen=True)
class GpuSource:
    """The GPU facts to plan a host from; ``gpus`` None: the host waits (``waiting`` says why)."""

    gpus: HostGpus | None
    origin: str  #: "probe", "inventory", or "none"
    why: str = ""  #: why not the probe (the probe's status), or why the host waits

    @property
    def waiting(self) -> bool:
        return self.gpus is None


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _islands(islands: tuple[frozenset[int], ...]) -> str:
    return " ".join("{" + ",".join(str(i) for i in sorted(group)) + "}" for group in sorted(islands, key=min))


def _shape(islands: tuple[frozenset[int], ...]) -> list[int]:
    """Island sizes: a declared fabric says how GPUs are joined (all, in pairs, not at all), not
    which indices pair up (bridged PCIe boards pair GPUs by slot, not by index)."""
    return sorted(len(group) for group in islands)


def _indices(indices: list[int]) -> str:
    return "GPU " + ",".join(str(i) for i in indices)


def mismatches(declared: GpuSpec, probed: HostGpus) -> list[str]:
    """What differs between the inventory's ``gpu`` entry and the probed GPUs (empty: they agree)."""
    want = declared.host_gpus()
    out: list[str] = []
    if probed.count != want.count:
        out.append(f"count: the inventory says {want.count}, the probe found {probed.count}")
    if declared.sku is not None:
        name = CATALOGUE[declared.sku].nvml_name
        other = [g for g in probed.gpus if g.name != name]
        if other:
            found = sorted({g.name for g in other})
            out.append(
                f"model: the inventory says {declared.sku} ({name}), the probe found {' and '.join(found)} "
                f"on {_indices([g.index for g in other])}"
            )
    size = want.gpus[0].memory_total if want.gpus else 0
    off = [g for g in probed.gpus if abs(g.memory_total - size) > size * MEMORY_TOLERANCE]
    if off:
        found = sorted({_gib(g.memory_total) for g in off})
        out.append(
            f"memory: the inventory says {_gib(size)} per GPU, the probe found {' and '.join(found)} "
            f"on {_indices([g.index for g in off])}"
        )
    if probed.count == want.count and _shape(probed.islands) != _shape(want.islands):
        out.append(
            f"NVLink: the inventory says nvlink={declared.nvlink.value} (islands {_islands(want.islands)}), "
            f"the probe found islands {_islands(probed.islands)}"
        )
    return out


def _others_use(g: GpuFacts) -> int:
    """Bytes of a GPU in use by anything but our own units."""
    used = g.memory.used if g.memory else 0
    procs = g.processes or ()
    ours = [p for p in procs if p.unit is not None and p.unit.startswith(OUR_UNIT_PREFIX)]
    if ours and len(ours) == len(procs) and any(p.used_memory is None for p in ours):
        return 0  # only our units hold it and NVML does not say how much: all of it is theirs
    return max(0, used - sum(p.used_memory or 0 for p in ours))


def planning_gpus(facts: HostFacts) -> HostGpus:
    """The probed GPUs as a deploy plans them: memory our own units hold counts as free."""
    probed = host_gpus(facts)
    others = {g.index: _others_use(g) for g in facts.gpus}
    return replace(probed, gpus=tuple(replace(g, memory_used=others.get(g.index, g.memory_used)) for g in probed.gpus))


def gpus_for(spec: HostSpec, probed: Mapping[str, HostGpus] | None = None) -> HostGpus:
    """The GPU facts ``fleet plan`` plans a host from: its probe where it answered (``probed``),
    else the inventory's ``gpu`` entry; ``PlanError`` if there are none."""
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


def planning_gpus_of(
    answers: Mapping[str, HostFacts | HostUnreachable | str | None],
) -> tuple[dict[str, HostGpus], dict[str, str]]:
    """``({host: probed HostGpus}, {host: why it was not probed})`` from each host's probe answer
    (``fleet.facts.probed.probe_hosts``): a host whose NVML answered with GPUs is planned from them
    (as ``fleet deploy`` plans it: our own units' memory is free), any other keeps the inventory's
    ``gpu`` data, and the note says why."""
    gpus: dict[str, HostGpus] = {}
    notes: dict[str, str] = {}
    for name, result in answers.items():
        if result is None:
            notes[name] = "the probe could not run on the host"
        elif isinstance(result, str):
            notes[name] = f"not probed: {result}"
        elif not isinstance(result, HostFacts):  # HostUnreachable
            notes[name] = f"not probed: {result.reason}"
        elif result.ok and result.gpus:
            gpus[name] = planning_gpus(result)
        else:
            notes[name] = f"probe answered {result.status}" + (f" ({result.error_class})" if result.error_class else "")
    return gpus, notes


@dataclass(frozen=True, eq=False)
class GpuDecision:
    """The one answer to "which GPUs does this host have": what the inventory declares, what the
    probe found (as planned: our own units' memory free), which of them plans the host and why,
    how they differ, and what a deploy refuses the host for (``decide_gpus``; pure)."""

    declared: HostGpus | None  #: the inventory's ``gpu`` entry
    probed: HostGpus | None  #: the probe's GPUs when NVML answered with some
    chosen: GpuSource  #: what a deploy or rollout plans the host from (``gpus`` None: it waits)
    differences: tuple[str, ...] = ()  #: declared vs probed (``mismatches``)
    refusal: FleetError | None = None  #: why a deploy or rollout cannot plan the host (raised by ``gpu_source``)

    def for_plan(self) -> HostGpus | None:
        """What ``fleet plan`` plans from: the probe where it answered with GPUs, else the
        inventory's entry (a difference is not a refusal there: it shows what the host has)."""
        return self.probed if self.probed is not None else self.declared


def _no_answer(spec: HostSpec, why: str, not_yet: bool) -> GpuSource:
    if spec.gpu is not None:
        return GpuSource(spec.gpu.host_gpus(), "inventory", why)
    if not_yet:
        return GpuSource(None, "none", why)
    raise PlanError(
        PlanProblem(
            spec.name,
            f"no GPU facts: the NVML probe failed ({why}) and the inventory has no gpu entry",
            ways_out=["fix the driver (fleet audit shows what NVML says)", "declare the host's gpu entry"],
        )
    )


def probe_summary(facts: HostFacts) -> str:
    """The probe's status in a few words (with NVML's error class, if any)."""
    return f"NVML probe: {facts.status}" + (f" ({facts.error_class})" if facts.error_class else "")


def _chosen(spec: HostSpec, probe: HostFacts | str | None, probed: HostGpus | None) -> GpuSource:
    """Where a deploy takes the host's GPU facts from; raises what refuses the host."""
    if probe is None:
        return GpuSource(gpus_for(spec), "inventory", "not probed")  # no gpu entry: the planner's PlanError
    if isinstance(probe, str):
        return _no_answer(spec, probe, not_yet=False)
    if probe.status in NOT_YET:
        return _no_answer(spec, probe_summary(probe), not_yet=True)
    if probe.status == "no-gpus" or (probe.ok and not probe.gpus):
        if spec.gpu is not None:
            raise GpuMismatch(spec.name, [f"count: the inventory says {spec.gpu.count}, the probe found none"])
        raise PlanError(
            PlanProblem(
                spec.name,
                "NVML answers but enumerates no GPU",
                ways_out=["check the host (lspci, dmesg | grep -i xid; fleet audit)"],
            )
        )
    if not probe.ok:
        return _no_answer(spec, probe_summary(probe), not_yet=False)
    assert probed is not None
    if spec.gpu is not None:
        differences = mismatches(spec.gpu, probed)
        if differences:
            raise GpuMismatch(spec.name, differences)
    return GpuSource(probed, "probe")


def decide_gpus(
    spec: HostSpec, probe: HostFacts | str | None, quarantined: Mapping[int, str] | None = None
) -> GpuDecision:
    """The host's GPUs from its inventory entry and its probe (see the module docstring); pure.

    ``probe``: the probe's answer; a string: why there is none (unreachable, output not
    understood); None: not probed (planning offline). ``quarantined``: GPU index -> why (the GPU
    watcher's record, ``fleet.gpuwatch.state``): those GPUs get no instance
    (``fleet.gpuwatch.quarantine.usable_gpus``), and a host with none left is refused.
    """
    declared = spec.gpu.host_gpus() if spec.gpu is not None else None
    probed = planning_gpus(probe) if isinstance(probe, HostFacts) and probe.ok and probe.gpus else None
    differences = tuple(mismatches(spec.gpu, probed)) if spec.gpu is not None and probed is not None else ()
    if quarantined and probed is not None:
        probed = usable_gpus(probed, quarantined)
    try:
        chosen = _chosen(spec, probe, probed)
        if quarantined and chosen.gpus is not None:
            chosen = replace(chosen, gpus=_around_quarantine(spec, chosen.gpus, quarantined))
    except (GpuMismatch, PlanError) as exc:
        return GpuDecision(declared, probed, GpuSource(None, "none", str(exc)), differences, exc)
    return GpuDecision(declared, probed, chosen, differences)


class AllGpusQuarantined(PlanError):
    """Every GPU of the host is quarantined: nothing can be planned on it, by any command."""


def _around_quarantine(spec: HostSpec, gpus: HostGpus, quarantined: Mapping[int, str]) -> HostGpus:
    usable = usable_gpus(gpus, quarantined)
    if not usable.usable:
        why = "; ".join(f"GPU {i}: {w}" for i, w in sorted(quarantined.items()))
        raise AllGpusQuarantined(
            PlanProblem(
                spec.name,
                f"every GPU is quarantined ({why})",
                ways_out=[f"repair the GPUs, then lift the quarantine: fleet gpu clear {spec.name} GPU --why TEXT"],
            )
        )
    return usable


def gpu_source(spec: HostSpec, probe: HostFacts | str | None) -> GpuSource:
    """Where a deploy takes a host's GPU facts from (``decide_gpus``); raises ``GpuMismatch`` or
    ``PlanError`` when the host cannot be planned."""
    decision = decide_gpus(spec, probe)
    if decision.refusal is not None:
        raise decision.refusal
    return decision.chosen
