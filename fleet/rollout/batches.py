"""Batch arithmetic (pure): which instances restart together, and whether the budget allows it now.

Sizes follow Ansible's ``serial`` (``lib/ansible/executor/playbook_executor.py:
_get_serialized_batches`` with ``lib/ansible/utils/helpers.py: pct_to_int``): a list of sizes,
the last one repeating until every unit is done; ``-1`` means "all the rest"; ``"N%"`` is a
percentage of *all* units (not of the remainder), **rounded down with a minimum of 1**. Ansible
computes ``int((N / 100.0) * total) or 1`` in floating point, so ``"29%"`` of 100 gives 28
there; we compute ``N * total // 100`` in integers, which gives 29 (the stated percentage).

The budget is Kubernetes' ``maxUnavailable`` (``pkg/controller/deployment/util/deployment_util.go:
ResolveFenceposts``: a percentage is rounded down; at least 1 here because an in-place rollout
has no surge). It counts *instances* not serving for any reason, including ones that were already
sick before the rollout (Kubernetes' ``reconcileOldReplicaSets`` counts unavailable pods the same
way): a batch is shrunk to fit, and waits when nothing fits.

A unit is an instance (default) or a whole host. In instance mode a batch never holds every
instance of a host that has several, so a host keeps serving while its instances roll, unless
``whole_host`` is asked for.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleet.errors import FleetError
from fleet.rollout.policy import BatchUnit, Size


@dataclass(frozen=True, order=True)
class InstanceRef:
    """One vLLM server: its host and its instance name on that host (the unit's instance)."""

    host: str
    instance: str

    def __str__(self) -> str:
        return f"{self.host}/{self.instance}"

    @classmethod
    def parse(cls, text: str) -> InstanceRef:
        host, _, instance = text.partition("/")
        return cls(host, instance)


#: What a batch counts: one instance, or every instance of one host.
Unit = tuple[InstanceRef, ...]
Batch = tuple[Unit, ...]


def resolve_size(size: Size, total: int) -> int:
    """A batch size for ``total`` units: ints as they are, ``-1`` → ``total``, ``"N%"`` floored, at least 1."""
    if isinstance(size, str):
        pct = int(size.rstrip("%"))
        return max(1, pct * total // 100)
    return total if size <= 0 else size


def budget_of(max_unavailable: Size, total_instances: int) -> int:
    """``max_unavailable`` as a count of instances: floored percentage, at least 1."""
    return max(1, resolve_size(max_unavailable, total_instances))


def serialized_sizes(sizes: Sequence[Size], total: int) -> list[int]:
    """Ansible's batch sizes for ``total`` hosts (no budget, no host rule): ``[1, 2, 3]`` of 10 → 1, 2, 3, 3, 1."""
    out: list[int] = []
    left, i = total, 0
    spec = list(sizes) or [-1]
    while left > 0:
        n = min(resolve_size(spec[min(i, len(spec) - 1)], total), left)
        out.append(n)
        left -= n
        i += 1
    return out


def units_of(instances: Sequence[InstanceRef], unit: BatchUnit) -> list[Unit]:
    """The units in rollout order.

    Host mode: one unit per host, in inventory order. Instance mode: round robin over the hosts
    (every host's first instance, then every host's second, ...), so consecutive units sit on
    different hosts and a batch spreads its cost over the fleet.
    """
    by_host: dict[str, list[InstanceRef]] = {}
    for ref in instances:
        by_host.setdefault(ref.host, []).append(ref)
    if unit is BatchUnit.HOST:
        return [tuple(refs) for refs in by_host.values()]
    out: list[Unit] = []
    depth = max((len(v) for v in by_host.values()), default=0)
    for i in range(depth):
        out.extend((refs[i],) for refs in by_host.values() if i < len(refs))
    return out


def _takes_whole_host(chosen: Iterable[InstanceRef], ref: InstanceRef, host_size: int) -> bool:
    """Would adding ``ref`` leave its host (with several instances) with none outside ``chosen``?"""
    same = sum(1 for r in chosen if r.host == ref.host) + 1
    return host_size > 1 and same >= host_size


def plan_batches(
    instances: Sequence[InstanceRef],
    sizes: Sequence[Size],
    max_unavailable: Size,
    unit: BatchUnit = BatchUnit.INSTANCE,
    whole_host: bool = False,
) -> list[Batch]:
    """The batches, before anything is observed: sizes as Ansible, each capped by the budget.

    Batch 0 is the canary. A unit the host rule keeps out of a batch goes first into the next one,
    so every unit is in exactly one batch.
    """
    if len(set(instances)) != len(instances):
        raise FleetError("rollout: an instance is listed twice: " + ", ".join(sorted({str(r) for r in instances})))
    units = units_of(instances, unit)
    total_units = len(units)
    budget = budget_of(max_unavailable, len(instances))
    host_size = _host_sizes(instances)
    too_big = [u for u in units if len(u) > budget]
    if too_big:
        host = too_big[0][0].host
        raise FleetError(
            f"rollout: host {host} runs {len(too_big[0])} instances but max_unavailable allows {budget}; "
            'roll per instance (unit: "instance") or raise max_unavailable'
        )
    spec = list(sizes) or [-1]
    queue = list(units)
    batches: list[Batch] = []
    i = 0
    while queue:
        size_spec = spec[min(i, len(spec) - 1)]
        want = len(queue) if size_spec == -1 else resolve_size(size_spec, total_units)
        chosen: list[Unit] = []
        chosen_refs: list[InstanceRef] = []
        rest: list[Unit] = []
        for u in queue:
            fits = len(chosen) < want and len(chosen_refs) + len(u) <= budget
            if fits and unit is BatchUnit.INSTANCE and not whole_host:
                fits = not _takes_whole_host(chosen_refs, u[0], host_size[u[0].host])
            if fits:
                chosen.append(u)
                chosen_refs.extend(u)
            else:
                rest.append(u)
        batches.append(tuple(chosen))
        queue = rest
        i += 1
    return batches


def _host_sizes(instances: Iterable[InstanceRef]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for ref in instances:
        sizes[ref.host] = sizes.get(ref.host, 0) + 1
    return sizes


@dataclass(frozen=True)
class Admission:
    """What may start now: ``admitted`` units (maybe fewer than asked), ``deferred`` for later, or why none."""

    admitted: Batch
    deferred: Batch
    reason: str = ""  #: why some or all units wait; empty when the whole batch goes

    @property
    def blocked(self) -> bool:
        return not self.admitted


def admit(
    batch: Batch,
    unavailable: Collection[InstanceRef],
    budget: int,
    host_instances: Mapping[str, int],
    whole_host: bool = False,
) -> Admission:
    """How much of ``batch`` may stop now without more than ``budget`` instances out of service.

    ``unavailable``: instances observed not serving now (any release, any reason). Members of the
    batch that are already down cost nothing extra. ``host_instances``: instances per host, for
    the rule that a host keeps one serving instance (unless ``whole_host``).
    """
    down = set(unavailable)
    down_elsewhere = sorted(down - {ref for u in batch for ref in u})
    out = set(down)  # everything not serving if we admit what we have admitted so far
    admitted: list[Unit] = []
    deferred: list[Unit] = []
    reasons: list[str] = []
    for u in batch:
        after = out | set(u)
        # Restarting what is already down costs nothing (Kubernetes' cleanupUnhealthyReplicas).
        ok = len(after) <= budget or set(u) <= out
        if not ok and not reasons:
            shown = ", ".join(str(r) for r in down_elsewhere[:5]) + (" ..." if len(down_elsewhere) > 5 else "")
            reasons.append(
                f"max_unavailable is {budget} and {len(down_elsewhere)} instance(s) are already not serving"
                + (f" ({shown})" if down_elsewhere else "")
            )
        # a host keeps one serving instance; restarting one that is already down takes none away
        # (every instance of a host is "down" when, e.g., a balancer holds them all out of traffic)
        if ok and not whole_host and len(u) == 1 and not set(u) <= out:
            ref = u[0]
            n = host_instances.get(ref.host, 1)
            if n > 1 and n - sum(1 for r in after if r.host == ref.host) <= 0:
                ok = False
                reasons.append(f"{ref} would leave host {ref.host} with no serving instance")
        if ok:
            admitted.append(u)
            out = after
        else:
            deferred.append(u)
    return Admission(tuple(admitted), tuple(deferred), "; ".join(reasons))
