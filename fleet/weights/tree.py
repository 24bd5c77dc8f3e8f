"""The fan-out's rounds, pure: who sends the model to whom, and what happens after a round.

Hosts that hold a verified copy seed the next ones, a tree: each round every holder sends to at
most one host that still needs the model, at most ``concurrency`` copies at once, each at its
sender's egress limit. From one source (the control machine) the holders double every round, so
``n`` hosts need ``⌈log₂(n+1)⌉`` rounds of ``size / rate`` instead of ``n`` (the binomial tree of
a broadcast: each round's receivers send in the next; MPI's ``MPI_Bcast`` binomial algorithm,
Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
MPICH", 2005, section 4.1).

A copy that fails is put down to its sender or to its receiver (``Outcome``): a sender that failed
mid-copy keeps serving what it has (nothing of its own changed) but sends no more in this run,
and its receiver waits for another sender in the next round, up to ``MAX_TRIES`` copies; a receiver
that failed (refused: no room; its copy did not verify) is named and left as it was.

Nothing here does I/O; ``fleet.weights.fanout`` runs the rounds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: The control machine, as a sender in a plan (a host name cannot hold ``(``).
SOURCE = "(control)"
#: Copies one receiver may be given (a first sender and, after a sender's failure, others).
MAX_TRIES = 3


@dataclass(frozen=True)
class Send:
    """One copy of a round: ``sender`` streams the model to ``receiver`` at most ``rate`` bytes/s."""

    sender: str
    receiver: str
    rate: float | None  #: the sender's egress limit, bytes per second (None: no limit)


class Outcome(enum.Enum):
    OK = "ok"
    SENDER_FAILED = "sender failed"  #: the sender stopped mid-copy: the receiver waits for another
    RECEIVER_FAILED = "receiver failed"  #: refused, or its copy did not verify: the receiver is named


def next_round(
    holders: Sequence[str], waiting: Sequence[str], *, concurrency: int, egress: Mapping[str, float | None]
) -> tuple[Send, ...]:
    """The next round: the i-th holder sends to the i-th waiting host, at most ``concurrency``
    copies; a holder with no limit in ``egress`` sends unlimited."""
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: at least 1")
    pairs = list(zip(holders, waiting, strict=False))[:concurrency]
    return tuple(Send(s, r, egress.get(s)) for s, r in pairs)


@dataclass(frozen=True)
class FanState:
    """Where a fan-out stands between rounds."""

    holders: tuple[str, ...]  #: hold a verified copy and may send (the source first)
    waiting: tuple[str, ...]  #: still need the model, in the order they are served
    done: tuple[str, ...] = ()  #: received a copy that verified in this run
    failed: tuple[str, ...] = ()  #: receivers that failed (or ran out of senders/tries), named
    broken: tuple[str, ...] = ()  #: senders that failed mid-copy: keep serving, send no more
    tries: Mapping[str, int] = field(default_factory=dict)  #: copies each receiver was given

    @property
    def finished(self) -> bool:
        return not self.waiting or not self.holders


def start(holders: Sequence[str], waiting: Sequence[str]) -> FanState:
    return FanState(tuple(holders), tuple(h for h in waiting if h not in holders))


def advance(state: FanState, sends: Sequence[Send], outcomes: Mapping[str, Outcome]) -> FanState:
    """The state after a round: ``outcomes`` by receiver. A receiver whose copy verified holds
    (and sends from the next round on); one whose sender failed goes back to the front of the
    queue (unless it had ``MAX_TRIES`` copies); one that failed itself is named. When no holder
    is left, every host still waiting is failed."""
    holders = list(state.holders)
    waiting = [h for h in state.waiting if h not in {s.receiver for s in sends}]
    done, failed, broken = list(state.done), list(state.failed), list(state.broken)
    tries = dict(state.tries)
    retry = []
    for s in sends:
        tries[s.receiver] = tries.get(s.receiver, 0) + 1
        outcome = outcomes.get(s.receiver, Outcome.RECEIVER_FAILED)
        if outcome is Outcome.OK:
            holders.append(s.receiver)
            done.append(s.receiver)
            continue
        if outcome is Outcome.SENDER_FAILED:
            if s.sender in holders:
                holders.remove(s.sender)
                broken.append(s.sender)
            if tries[s.receiver] < MAX_TRIES:
                retry.append(s.receiver)
                continue
        failed.append(s.receiver)
    waiting = retry + waiting
    if not holders:
        failed += waiting
        waiting = []
    return FanState(tuple(holders), tuple(waiting), tuple(done), tuple(failed), tuple(broken), tries)


def plan(
    holders: Sequence[str], waiting: Sequence[str], *, concurrency: int, egress: Mapping[str, float | None]
) -> list[tuple[Send, ...]]:
    """Every round when every copy succeeds (what ``fleet stage --fanout`` will do, for ``--json``
    and the benchmark's bound)."""
    state, rounds = start(holders, waiting), []
    while not state.finished:
        sends = next_round(state.holders, state.waiting, concurrency=concurrency, egress=egress)
        rounds.append(sends)
        state = advance(state, sends, {s.receiver: Outcome.OK for s in sends})
    return rounds


def bound(n: int, sources: int = 1) -> int:
    """Rounds a tree needs for ``n`` hosts from ``sources`` holders, with no concurrency limit:
    the smallest r with ``sources * 2**r >= sources + n`` (``⌈log₂(n+1)⌉`` from one source)."""
    if sources < 1:
        raise ValueError(f"sources {sources}: at least 1")
    rounds, holders = 0, sources
    while holders < sources + n:
        holders *= 2
        rounds += 1
    return rounds
