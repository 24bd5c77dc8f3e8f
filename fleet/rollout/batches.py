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

An instance spanning hosts (``fleet.plan.multinode``: one node per host, one ``InstanceRef`` per
node, ``host/vllm-N`` on each) is one unit: its nodes are in the same batch, always all of them,
and the budget counts the instance once (``Groups``: every node's ref → the instance's nodes,
leader first). In host mode the hosts an instance spans are one unit together.
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


#: What a batch counts: one instance (every node of one spanning hosts), or every instance of one host.
Unit = tuple[InstanceRef, ...]
Batch = tuple[Unit, ...]
#: The instances spanning hosts: each node's ref → every node's ref of its instance, leader first
#: (single-host instances are not in it).
Groups = Mapping[InstanceRef, tuple[InstanceRef, ...]]


def instance_key(ref: InstanceRef, groups: Groups) -> InstanceRef:
    """The ref that stands for ``ref``'s instance: its leader's for a node of an instance spanning
    hosts, else ``ref`` itself."""
    nodes = groups.get(ref)
    return nodes[0] if nodes else ref


def count_instances(refs: Iterable[InstanceRef], groups: Groups) -> int:
    """How many instances ``refs`` hold: the nodes of one instance spanning hosts count once."""
    return len({instance_key(r, groups) for r in refs})


def spanning(unit: Unit, groups: Groups) -> bool:
    """Whether ``unit`` is the nodes of one instance spanning hosts."""
    return len(unit) > 1 and set(groups.get(unit[0], ())) == set(unit)


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


def units_of(instances: Sequence[InstanceRef], unit: BatchUnit, groups: Groups | None = None) -> list[Unit]:
    """The units in rollout order.

    Host mode: one unit per host, in inventory order; the hosts an instance spans are one unit
    (at the first of them). Instance mode: round robin over the hosts (every host's first
    instance, then every host's second, ...), so consecutive units sit on different hosts and a
    batch spreads its cost over the fleet; an instance spanning hosts is one unit of all its nodes
    (leader first), where its first node comes.
    """
    groups = groups or {}
    by_host: dict[str, list[InstanceRef]] = {}
    for ref in instances:
        by_host.setdefault(ref.host, []).append(ref)
    if unit is BatchUnit.HOST:
        return _host_units(by_host, groups)
    out: list[Unit] = []
    seen: set[InstanceRef] = set()
    depth = max((len(v) for v in by_host.values()), default=0)
    for i in range(depth):
        for refs in by_host.values():
            if i >= len(refs) or refs[i] in seen:
                continue
            nodes = tuple(n for n in groups.get(refs[i], (refs[i],)) if n in set(instances)) or (refs[i],)
            seen.update(nodes)
            out.append(nodes)
    return out


def _host_units(by_host: Mapping[str, list[InstanceRef]], groups: Groups) -> list[Unit]:
    """Host mode: each host a unit, hosts joined by an instance spanning them merged into one."""
    owner = {h: h for h in by_host}

    def root(h: str) -> str:
        while owner[h] != h:
            h = owner[h]
        return h

    for refs in by_host.values():
        for ref in refs:
            for node in groups.get(ref, ()):
                if node.host in owner:
                    a, b = root(ref.host), root(node.host)
                    if a != b:  # the earlier host (inventory order) stays the root
                        first, second = sorted((a, b), key=list(by_host).index)
                        owner[second] = first
    merged: dict[str, list[InstanceRef]] = {}
    for host, refs in by_host.items():
        merged.setdefault(root(host), []).extend(refs)
    return [tuple(refs) for refs in merged.values()]


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
    groups: Groups | None = None,
) -> list[Batch]:
    """The batches, before anything is observed: sizes as Ansible, each capped by the budget.

    Batch 0 is the canary. A unit the host rule keeps out of a batch goes first into the next one,
    so every unit is in exactly one batch. ``groups``: the instances spanning hosts (each one unit,
    counted once by sizes and budget alike).
    """
    groups = groups or {}
    if len(set(instances)) != len(instances):
        raise FleetError("rollout: an instance is listed twice: " + ", ".join(sorted({str(r) for r in instances})))
    units = units_of(instances, unit, groups)
    total_units = len(units)
    budget = budget_of(max_unavailable, count_instances(instances, groups))
    host_size = _host_sizes(instances)
    too_big = [u for u in units if count_instances(u, groups) > budget]
    if too_big:
        hosts = list(dict.fromkeys(r.host for r in too_big[0]))
        where = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {', '.join(hosts)} (an instance spans them)"
        raise FleetError(
            f"rollout: {where} run{'s' if len(hosts) == 1 else ''} {count_instances(too_big[0], groups)} instances "
            f'but max_unavailable allows {budget}; roll per instance (unit: "instance") or raise max_unavailable'
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
            fits = len(chosen) < want and count_instances([*chosen_refs, *u], groups) <= budget
            if fits and unit is BatchUnit.INSTANCE and not whole_host:
                fits = not any(_takes_whole_host(chosen_refs, ref, host_size[ref.host]) for ref in u)
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
    groups: Groups | None = None,
) -> Admission:
    """How much of ``batch`` may stop now without more than ``budget`` instances out of service.

    ``unavailable``: instances observed not serving now (any release, any reason; every node of an
    instance spanning hosts that does not serve). Members of the batch that are already down cost
    nothing extra. ``host_instances``: instances (nodes) per host, for the rule that a host keeps
    one serving instance (unless ``whole_host``). ``groups``: the instances spanning hosts, each
    counted once.
    """
    groups = groups or {}
    down = set(unavailable)
    down_elsewhere = sorted(down - {ref for u in batch for ref in u})
    out = set(down)  # everything not serving if we admit what we have admitted so far
    admitted: list[Unit] = []
    deferred: list[Unit] = []
    reasons: list[str] = []
    for u in batch:
        after = out | set(u)
        # Restarting what is already down costs nothing (Kubernetes' cleanupUnhealthyReplicas).
        ok = count_instances(after, groups) <= budget or set(u) <= out
        if not ok and not reasons:
            shown = ", ".join(str(r) for r in down_elsewhere[:5]) + (" ..." if len(down_elsewhere) > 5 else "")
            reasons.append(
                f"max_unavailable is {budget} and {count_instances(down_elsewhere, groups)} instance(s) are already "
                "not serving" + (f" ({shown})" if down_elsewhere else "")
            )
        # a host keeps one serving instance; restarting one that is already down takes none away
        # (every instance of a host is "down" when, e.g., a balancer holds them all out of traffic)
        if ok and not whole_host and (len(u) == 1 or spanning(u, groups)) and not set(u) <= out:
            for ref in u:
                n = host_instances.get(ref.host, 1)
                if n > 1 and n - sum(1 for r in after if r.host == ref.host) <= 0:
                    ok = False
                    reasons.append(f"{ref} would leave host {ref.host} with no serving instance")
                    break
        if ok:
            admitted.append(u)
            out = after
        else:
            deferred.append(u)
    return Admission(tuple(admitted), tuple(deferred), "; ".join(reasons))
