"""The fan-out's pure planning (``fleet.weights.tree``): rounds, limits, failures, the bound."""

from __future__ import annotations

import pytest

from fleet.weights.tree import SOURCE, FanState, Outcome, Send, advance, bound, next_round, plan, start

HOSTS = [f"h{i:02d}" for i in range(1, 17)]


@pytest.mark.parametrize(
    ("n", "sources", "rounds"),
    [(0, 1, 0), (1, 1, 1), (2, 1, 2), (3, 1, 2), (4, 1, 3), (7, 1, 3), (8, 1, 4), (15, 1, 4), (16, 1, 5),
     (200, 1, 8), (2, 2, 1), (6, 2, 2), (3, 3, 1)],
)  # fmt: skip
def test_bound_is_log2_of_n_plus_sources(n: int, sources: int, rounds: int) -> None:
    assert bound(n, sources) == rounds


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 15, 16])
def test_plan_from_one_source_meets_the_bound_and_serves_everyone_once(n: int) -> None:
    rounds = plan([SOURCE], HOSTS[:n], concurrency=64, egress={})
    assert len(rounds) == bound(n)
    receivers = [s.receiver for r in rounds for s in r]
    assert sorted(receivers) == sorted(HOSTS[:n])
    holders = {SOURCE}
    for r in rounds:
        senders = [s.sender for s in r]
        assert len(senders) == len(set(senders)), "a holder sends to at most one host a round"
        assert set(senders) <= holders, "only holders send"
        holders |= {s.receiver for s in r}


def test_the_tree_for_three_hosts() -> None:
    rounds = plan([SOURCE], ["a", "b", "c"], concurrency=8, egress={SOURCE: 10.0, "a": 5.0})
    assert rounds == [
        (Send(SOURCE, "a", 10.0),),
        (Send(SOURCE, "b", 10.0), Send("a", "c", 5.0)),
    ]


def test_concurrency_caps_each_round() -> None:
    rounds = plan([SOURCE], HOSTS[:8], concurrency=2, egress={})
    assert [len(r) for r in rounds] == [1, 2, 2, 2, 1]
    assert len(plan([SOURCE], HOSTS[:8], concurrency=1, egress={})) == 8  # one copy at a time: n rounds


def test_hosts_already_holding_seed_and_are_not_sent_to() -> None:
    rounds = plan([SOURCE, "h01", "h02"], ["h01", "h03", "h04", "h05"], concurrency=8, egress={})
    assert rounds == [(Send(SOURCE, "h03", None), Send("h01", "h04", None), Send("h02", "h05", None))]


def test_next_round_refuses_no_concurrency() -> None:
    with pytest.raises(ValueError, match="concurrency 0"):
        next_round([SOURCE], ["a"], concurrency=0, egress={})


@pytest.mark.parametrize(
    ("outcomes", "holders", "waiting", "failed", "broken"),
    [
        ({"c": Outcome.OK, "d": Outcome.OK}, (SOURCE, "a", "c", "d"), ("e",), (), ()),
        # the sender a failed mid-copy: it sends no more; d waits at the front for another sender
        ({"c": Outcome.OK, "d": Outcome.SENDER_FAILED}, (SOURCE, "c"), ("d", "e"), (), ("a",)),
        # d itself failed (its disk, its verify): named, not retried
        ({"c": Outcome.OK, "d": Outcome.RECEIVER_FAILED}, (SOURCE, "a", "c"), ("e",), ("d",), ()),
        # no outcome reported counts as the receiver's failure
        ({"c": Outcome.OK}, (SOURCE, "a", "c"), ("e",), ("d",), ()),
    ],
)  # fmt: skip
def test_advance(
    outcomes: dict[str, Outcome],
    holders: tuple[str, ...],
    waiting: tuple[str, ...],
    failed: tuple[str, ...],
    broken: tuple[str, ...],
) -> None:
    state = FanState((SOURCE, "a"), ("c", "d", "e"))
    sends = (Send(SOURCE, "c", None), Send("a", "d", None))
    after = advance(state, sends, outcomes)
    assert (after.holders, after.waiting, after.failed, after.broken) == (holders, waiting, failed, broken)


def test_a_receiver_whose_senders_keep_failing_is_named_after_max_tries() -> None:
    state = start([SOURCE, "a", "b", "c"], ["x"])
    for sender in ("a", "b"):
        state = advance(state, [Send(sender, "x", None)], {"x": Outcome.SENDER_FAILED})
        assert state.waiting == ("x",) and not state.failed
    state = advance(state, [Send("c", "x", None)], {"x": Outcome.SENDER_FAILED})
    assert state.failed == ("x",) and state.broken == ("a", "b", "c") and state.holders == (SOURCE,)
    assert state.finished


def test_no_holder_left_fails_everyone_waiting() -> None:
    state = advance(start([SOURCE], ["x", "y"]), [Send(SOURCE, "x", None)], {"x": Outcome.SENDER_FAILED})
    assert state.holders == () and state.waiting == () and state.failed == ("x", "y") and state.finished
