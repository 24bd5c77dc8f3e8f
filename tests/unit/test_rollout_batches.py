"""Batch arithmetic: Ansible's ``serial`` tables, Kubernetes' budget rounding, the host rule, properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.errors import FleetError
from fleet.rollout.batches import (
    InstanceRef,
    admit,
    budget_of,
    count_instances,
    plan_batches,
    resolve_size,
    serialized_sizes,
    units_of,
)
from fleet.rollout.policy import BatchUnit


def fleet(*counts: int) -> list[InstanceRef]:
    """Hosts h0, h1, ... with the given number of instances each (i0, i1, ...)."""
    return [InstanceRef(f"h{h}", f"i{i}") for h, n in enumerate(counts) for i in range(n)]


# Ansible test/units/executor/test_playbook_executor.py and the worked example in its docs.
@pytest.mark.parametrize(
    ("sizes", "total", "expected"),
    [
        ([1, 2, 3], 10, [1, 2, 3, 3, 1]),
        ([1, "20%", -1], 10, [1, 2, 7]),
        (["20%"], 3, [1, 1, 1]),
        (["20%"], 11, [2, 2, 2, 2, 2, 1]),
        ([1, 5, "20%"], 20, [1, 5, 4, 4, 4, 2]),
        ([1, 5, "20%"], 8, [1, 5, 1, 1]),
        ([-1], 5, [5]),
        ([], 4, [4]),
        ([1, "25%"], 4, [1, 1, 1, 1]),
        ([2], 1, [1]),
    ],
)
def test_serialized_sizes_like_ansible(sizes: list[int | str], total: int, expected: list[int]) -> None:
    assert serialized_sizes(sizes, total) == expected


@pytest.mark.parametrize(
    ("size", "total", "expected"),
    [
        ("20%", 11, 2),  # floored
        ("1%", 10, 1),  # at least 1
        ("100%", 7, 7),
        ("29%", 100, 29),  # Ansible's float arithmetic gives 28 here; we give the stated percentage
        ("39%", 10, 3),  # Kubernetes TestResolveFenceposts: 39% of 10 unavailable → 3
        (3, 10, 3),
        (-1, 10, 10),
    ],
)
def test_resolve_size_floors_with_minimum_one(size: int | str, total: int, expected: int) -> None:
    assert resolve_size(size, total) == expected


def test_budget_is_at_least_one() -> None:
    assert budget_of("25%", 3) == 1
    assert budget_of("25%", 8) == 2
    assert budget_of(5, 8) == 5


def test_units_round_robin_over_hosts() -> None:
    units = units_of(fleet(2, 1, 2), BatchUnit.INSTANCE)
    assert [str(u[0]) for u in units] == ["h0/i0", "h1/i0", "h2/i0", "h0/i1", "h2/i1"]
    hosts = units_of(fleet(2, 1), BatchUnit.HOST)
    assert [[str(r) for r in u] for u in hosts] == [["h0/i0", "h0/i1"], ["h1/i0"]]


def names(batches: list[tuple[tuple[InstanceRef, ...], ...]]) -> list[list[str]]:
    return [[str(r) for u in b for r in u] for b in batches]


def test_plan_four_single_instance_hosts_canary_first() -> None:
    assert names(plan_batches(fleet(1, 1, 1, 1), [1, 2, "25%"], 2)) == [
        ["h0/i0"],
        ["h1/i0", "h2/i0"],
        ["h3/i0"],
    ]


def test_plan_caps_batches_at_the_budget() -> None:
    batches = plan_batches(fleet(1, 1, 1, 1, 1, 1), [1, -1], 2)
    assert [len(b) for b in batches] == [1, 2, 2, 1]


def test_plan_never_takes_every_instance_of_a_host() -> None:
    # One host with two instances, batches of 2: the two instances go in different batches.
    batches = plan_batches(fleet(2), [2], 2)
    assert names(batches) == [["h0/i0"], ["h0/i1"]]
    # Unless asked.
    assert names(plan_batches(fleet(2), [2], 2, whole_host=True)) == [["h0/i0", "h0/i1"]]


def test_plan_host_units_count_hosts_and_refuse_hosts_larger_than_budget() -> None:
    assert names(plan_batches(fleet(2, 2, 2), [1, 2], 4, unit=BatchUnit.HOST)) == [
        ["h0/i0", "h0/i1"],
        ["h1/i0", "h1/i1", "h2/i0", "h2/i1"],
    ]
    with pytest.raises(FleetError, match="host h0 runs 4 instances but max_unavailable allows 2"):
        plan_batches(fleet(4, 1), [1], 2, unit=BatchUnit.HOST)


def test_admit_whole_batch_when_budget_allows() -> None:
    batch = tuple((r,) for r in fleet(1, 1)[:2])
    a = admit(batch, [], 2, {"h0": 1, "h1": 1})
    assert a.admitted == batch and not a.deferred and a.reason == ""


def test_admit_counts_instances_already_down_and_shrinks() -> None:
    refs = fleet(1, 1, 1, 1)
    batch = ((refs[0],), (refs[1],))
    a = admit(batch, [refs[3]], 2, {f"h{i}": 1 for i in range(4)})
    assert a.admitted == ((refs[0],),) and a.deferred == ((refs[1],),)
    assert "1 instance(s) are already not serving (h3/i0)" in a.reason


def test_admit_blocks_when_budget_is_spent_by_sick_instances() -> None:
    refs = fleet(1, 1, 1, 1)
    a = admit(((refs[0],),), refs[2:], 2, {f"h{i}": 1 for i in range(4)})
    assert a.blocked
    assert a.reason == "max_unavailable is 2 and 2 instance(s) are already not serving (h2/i0, h3/i0)"


def test_admit_sick_member_of_the_batch_costs_nothing_extra() -> None:
    refs = fleet(1, 1)
    a = admit(((refs[0],),), [refs[0]], 1, {"h0": 1, "h1": 1})
    assert a.admitted == ((refs[0],),)
    # even when the fleet is already over its budget: restarting a sick instance loses nothing
    refs = fleet(1, 1, 1)
    a = admit(((refs[0],), (refs[1],)), refs, 1, {"h0": 1, "h1": 1, "h2": 1})
    assert a.admitted == ((refs[0],), (refs[1],))


def test_admit_keeps_one_serving_instance_per_host() -> None:
    refs = fleet(2)
    a = admit(((refs[0],),), [refs[1]], 5, {"h0": 2})
    assert a.blocked and a.reason == "h0/i0 would leave host h0 with no serving instance"
    assert admit(((refs[0],),), [refs[1]], 5, {"h0": 2}, whole_host=True).admitted


def test_an_instance_already_down_may_restart_even_when_its_whole_host_is_down() -> None:
    """Every instance of a host out of service (e.g. held out of traffic by a balancer whose
    backend is new): restarting one of them takes no serving instance away from the host."""
    refs = fleet(2, 2)
    a = admit(((refs[0],),), refs, 1, {"h0": 2, "h1": 2})
    assert a.admitted == ((refs[0],),) and not a.blocked
    # one already down, the other serving: the serving one still may not go
    assert admit(((refs[1],),), [refs[0]], 5, {"h0": 2, "h1": 2}).blocked


# ---- properties ---------------------------------------------------------------------------------

sizes_st = st.lists(st.one_of(st.integers(1, 6), st.sampled_from(["10%", "25%", "50%", "100%", -1])), max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    sizes=sizes_st,
    max_unavailable=st.one_of(st.integers(1, 8), st.sampled_from(["10%", "25%", "50%"])),
    whole_host=st.booleans(),
)
def test_plan_properties(
    counts: list[int], sizes: list[int | str], max_unavailable: int | str, whole_host: bool
) -> None:
    refs = fleet(*counts)
    budget = budget_of(max_unavailable, len(refs))
    batches = plan_batches(refs, sizes, max_unavailable, whole_host=whole_host)
    flat = [r for b in batches for u in b for r in u]
    assert sorted(flat) == sorted(refs)  # every instance exactly once
    assert all(b for b in batches)  # no empty batch
    assert all(sum(len(u) for u in b) <= budget for b in batches)  # never over the budget
    canary = min(resolve_size((sizes or [-1])[0], len(refs)), budget, len(refs))
    assert len(batches[0]) == canary or any(c > 1 for c in counts)  # canary first, at its size
    assert len(batches[0]) <= canary
    if not whole_host:
        for b in batches:
            for h, n in enumerate(counts):
                if n > 1:
                    assert sum(1 for u in b for r in u if r.host == f"h{h}") < n


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    sizes=sizes_st,
    budget=st.integers(1, 5),
    sick=st.sets(st.integers(0, 17), max_size=4),
    heal=st.booleans(),
)
def test_rollout_loop_never_exceeds_budget(
    counts: list[int], sizes: list[int | str], budget: int, sick: set[int], heal: bool
) -> None:
    """Run plan + admit the way the engine does: the budget holds at every step, no unit runs twice."""
    refs = fleet(*counts)
    down = {refs[i] for i in sick if i < len(refs)}
    per_host = {f"h{h}": n for h, n in enumerate(counts)}
    queue = list(plan_batches(refs, sizes, budget))
    visited: list[InstanceRef] = []
    while queue:
        batch = queue.pop(0)
        a = admit(batch, down, budget, per_host)
        if a.blocked:
            costs = all(len(down | set(u)) > budget and not set(u) <= down for u in batch)
            assert costs or "no serving instance" in a.reason
            if not heal:
                return  # the engine waits, then halts at the progress deadline
            down = set()  # the sick instances recover; try again
            queue.insert(0, batch)
            continue
        stopped = {r for u in a.admitted for r in u}
        # never more out of service than the budget, unless that many were down already (then
        # only instances already down may restart: it costs nothing)
        assert len(down | stopped) <= max(budget, len(down))
        visited.extend(stopped)
        down -= stopped  # restarted and healthy again
        if a.deferred:
            queue.insert(0, a.deferred)
    assert sorted(visited) == sorted(refs)


# ---- instances spanning hosts: one unit, counted once -----------------------------------------------

A0, B0, C0, D0 = (InstanceRef(h, "i0") for h in ("h0", "h1", "h2", "h3"))
#: one instance over h0 (leader) and h1; h2 and h3 each serve one on their own
SPAN = {A0: (A0, B0), B0: (A0, B0)}


@pytest.mark.parametrize(
    ("refs", "expected"),
    [
        ([A0, B0], 1),  # both nodes of one instance
        ([A0], 1),
        ([B0, C0], 2),
        ([A0, B0, C0, D0], 3),
        ([], 0),
    ],
)
def test_count_instances_counts_the_nodes_of_an_instance_once(refs: list[InstanceRef], expected: int) -> None:
    assert count_instances(refs, SPAN) == expected


def test_units_hold_every_node_of_an_instance_spanning_hosts_leader_first() -> None:
    order = [B0, A0, C0, D0]  # the worker's host comes first in the inventory: the unit still leads with A0
    assert [[str(r) for r in u] for u in units_of(order, BatchUnit.INSTANCE, SPAN)] == [
        ["h0/i0", "h1/i0"],
        ["h2/i0"],
        ["h3/i0"],
    ]
    # host mode: the hosts the instance spans are one unit (at the first of them)
    hosts = units_of([A0, C0, B0, D0], BatchUnit.HOST, SPAN)
    assert [[str(r) for r in u] for u in hosts] == [["h0/i0", "h1/i0"], ["h2/i0"], ["h3/i0"]]


@pytest.mark.parametrize(
    ("sizes", "max_unavailable", "expected"),
    [
        # the canary is the whole instance (two nodes), counted as one against a budget of 1
        ([1, 1], 1, [["h0/i0", "h1/i0"], ["h2/i0"], ["h3/i0"]]),
        ([1, 2], 2, [["h0/i0", "h1/i0"], ["h2/i0", "h3/i0"]]),
        ([2], 2, [["h0/i0", "h1/i0", "h2/i0"], ["h3/i0"]]),  # 2 instances: 3 nodes
        (["50%"], 3, [["h0/i0", "h1/i0"], ["h2/i0"], ["h3/i0"]]),  # 50% of 3 instances: 1
        ([-1], 1, [["h0/i0", "h1/i0"], ["h2/i0"], ["h3/i0"]]),  # the budget caps "all", never half an instance
    ],
)
def test_plan_counts_an_instance_spanning_hosts_once_and_never_splits_it(
    sizes: list[int | str], max_unavailable: int, expected: list[list[str]]
) -> None:
    assert names(plan_batches([A0, B0, C0, D0], sizes, max_unavailable, groups=SPAN)) == expected


@pytest.mark.parametrize(
    ("unavailable", "budget", "admitted", "reason"),
    [
        ([], 1, ["h0/i0", "h1/i0"], ""),  # both nodes, one instance: fits a budget of 1
        ([C0], 1, [], "max_unavailable is 1 and 1 instance(s) are already not serving (h2/i0)"),
        ([A0, B0], 1, ["h0/i0", "h1/i0"], ""),  # the instance is down already: restarting it costs nothing
        ([C0], 2, ["h0/i0", "h1/i0"], ""),
    ],
)
def test_admit_counts_an_instance_spanning_hosts_once(
    unavailable: list[InstanceRef], budget: int, admitted: list[str], reason: str
) -> None:
    a = admit(((A0, B0),), unavailable, budget, {"h0": 1, "h1": 1, "h2": 1}, groups=SPAN)
    assert [str(r) for u in a.admitted for r in u] == admitted
    assert a.reason == reason


def test_admit_keeps_a_serving_instance_on_a_host_the_spanning_instance_shares() -> None:
    # h0 also runs i1 on its own; the spanning instance (h0/i0 + h1/i0) may go while i1 serves,
    # but not in the same batch as i1
    a = admit(((A0, B0), (InstanceRef("h0", "i1"),)), [], 3, {"h0": 2, "h1": 1}, groups=SPAN)
    assert [[str(r) for r in u] for u in a.admitted] == [["h0/i0", "h1/i0"]]
    assert a.reason == "h0/i1 would leave host h0 with no serving instance"


def test_a_host_unit_spanning_instance_larger_than_the_budget_is_refused_counting_instances() -> None:
    refs = [A0, InstanceRef("h0", "i1"), B0, InstanceRef("h1", "i1")]
    why = r"hosts h0, h1 \(an instance spans them\) run 3 instances but max_unavailable allows 2"
    with pytest.raises(FleetError, match=why):
        plan_batches(refs, [1], 2, unit=BatchUnit.HOST, groups=SPAN)
