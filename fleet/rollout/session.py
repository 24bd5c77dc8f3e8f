"""One rollout from start to end, as a library call: check the policy, take the fleet's lock,
build the targets, journal the rollout, run it, release the lock.

``fleet rollout``/``restart``/``rollback`` call it with a live view; ``fleet deploy`` calls it for
the serving hosts whose release or configuration it changed; ``fleet rollout --resume`` calls
``resume_rollout``. How the loop is run (``run``) is the caller's: the command line adds its live
view and Ctrl-C handling, a library caller takes ``headless``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from fleet.audit.findings import Finding
from fleet.facts.drain import Drained, DrainMarker, drained_view
from fleet.facts.runner import HostUnreachable
from fleet.rollout.claims import ClaimRequest, HostClaims
from fleet.rollout.engine import RolloutState, RolloutStatus, Target, new_rollout, resume
from fleet.rollout.errors import JournalError
from fleet.rollout.fleet_inventory import RolloutFleet, load_fleet
from fleet.rollout.journal import JournalLocation, RolloutJournal, new_rollout_id
from fleet.rollout.journals import open_journal as _open
from fleet.rollout.runner import Runner, open_rollout
from fleet.rollout.ssh_executor import SshExecutor

#: runs a journaled rollout to its end (or until stopped) and returns its last state
RunLoop = Callable[[RolloutState, SshExecutor, RolloutJournal], RolloutState]


def headless(state: RolloutState, executor: SshExecutor, journal: RolloutJournal) -> RolloutState:
    return Runner(executor, journal).run(state)


def no_balancer_warning(count: int, total: int, lb: bool) -> str:
    """Why clients will see failed requests during this rollout (said once, before it starts)."""
    which = "--no-lb: " if not lb else f"{count} of {total} instance(s) have no load balancer (`balancer`) and "
    return (
        f"{which}nothing takes an instance out of traffic before it restarts (no `balancer` entry, no "
        "rollout.hooks.drain): clients that reach it while it drains get errors, because vLLM keeps /health "
        "at 200 while draining and answers new requests with HTTP 500 (vllm/v1/engine/async_llm.py: "
        "AsyncLLM.shutdown), so a balancer polling /health keeps sending them"
    )


def open_journal(where: str | Path | JournalLocation | None = None) -> RolloutJournal:
    """The journal to write (``--journal``, ``$FLEET_JOURNAL``, the config file, or the default)."""
    return _open(where, write=True)


def run_rollout(
    fleet: RolloutFleet,
    kind: str,
    targets_of: Callable[[SshExecutor], list[Target]],
    overrides: Mapping[str, Any] | None = None,
    *,
    journal_path: str | Path | None = None,
    take_over: bool = False,
    gates_over_ssh: Sequence[str] = (),
    run: RunLoop = headless,
    lb: bool = True,
    warn: Callable[[str], None] = lambda _m: None,
    skip_drained: bool = True,
    on_skipped: Callable[[Mapping[str, DrainMarker]], None] = lambda _d: None,
    overridden: Sequence[Finding] = (),
) -> RolloutState:
    """Run one rollout of ``kind`` over ``targets_of(executor)``; its final (or stopped) state.

    ``overridden``: the audit findings the operator let through (``--ignore-finding``), each
    journaled as a ``finding-overridden`` step of the rollout before anything is touched.

    With ``skip_drained`` (not for ``fleet drain``/``undrain`` themselves), the instances of hosts
    drained for maintenance are left out (their marker, ``fleet.facts.drain``, read once the journal
    is open and the lock held; for a host that does not answer, this journal's word), each said by
    ``warn`` and all given to ``on_skipped``; ``executor.skipped`` names them for ``targets_of``.

    Raises ``FleetError`` for a bad policy or targets (nothing touched), ``LockHeld`` when another
    rollout holds the fleet's lock (``HostClaimed`` when another rollout holds one of its hosts),
    ``JournalError`` when the journal cannot be opened, ``BalancerMisconfigured``/``BalancerDown``
    when a load balancer in front of the instances cannot be used or does not answer (nothing
    touched either; ``lb=False`` rolls without it). ``warn`` hears, once, that clients will see
    failed requests when nothing takes the instances out of traffic.
    """
    policy = fleet.policy(overrides)
    with open_journal(journal_path) as journal:
        executor = fleet.executor(gates_over_ssh, lb=lb)
        try:
            executor.traffic.preflight()
            # a headless node of an instance spanning hosts has no seat of its own: its leader's counts
            served = [r for r, s in fleet.instances.items() if not s.headless]
            unsteered = [r for r in served if executor.traffic.seat(r.host, r.instance) is None]
            if unsteered and policy.hooks.drain is None:
                warn(no_balancer_warning(len(unsteered), len(served), lb))
            now = time.time()
            rollout_id = new_rollout_id(now)
            journal.acquire(fleet.name, rollout_id, takeover=take_over)
            try:
                drained = find_drained(fleet, journal, executor) if skip_drained else {}
                executor.skipped = frozenset(drained)
                for name, marker in drained.items():
                    warn(f"host {name} skipped: {marker.describe()}; `fleet undrain {fleet.inventory} {name}` puts "
                         "it back")  # fmt: skip
                on_skipped(drained)
                targets = fleet.with_nodes([t for t in targets_of(executor) if t.ref.host not in drained])
                state = new_rollout(rollout_id, fleet.name, kind, targets, policy, now)
                with claimed(executor, state):
                    opened = open_rollout(journal, state)
                    for f in overridden:
                        detail = f"{f.where}: {f.rule} ({f.severity.label}): {f.message} (--ignore-finding {f.rule})"
                        journal.record(opened, "finding-overridden", detail, True, "overridden", now, f.host)
                    return run(opened, executor, journal)
            finally:
                _release(journal, fleet.name, rollout_id)
        finally:
            executor.close()


def find_drained(fleet: RolloutFleet, journal: RolloutJournal, executor: SshExecutor) -> dict[str, DrainMarker]:
    """The fleet's hosts drained for maintenance: their markers (all hosts at once, over the
    executor's connections, which its steps then use: no login of its own), and for a host that
    does not answer, whether this journal drained it (``fleet.facts.drain.drained_view``)."""
    answers = executor.read_fact(list(fleet.hosts), Drained)
    down = [h for h, a in answers.items() if isinstance(a, HostUnreachable)]
    return drained_view(answers, journal.drained_hosts(fleet.name) if down else {})


def resume_rollout(
    rollout_id: str | None,
    *,
    journal_path: str | Path | None = None,
    take_over: bool = False,
    gates_over_ssh: Sequence[str] = (),
    run: RunLoop = headless,
    lb: bool = True,
    warn: Callable[[str], None] = lambda _m: None,
) -> RolloutState:
    """``--resume``: the journaled rollout ``rollout_id`` (None: the newest unfinished one), under
    the fleet's lock, with its clocks restarted; the runner re-observes every instance. Its own
    instances are its to finish, on a host drained since too (``warn`` says so).

    Raises ``JournalError`` (no such rollout, nothing to resume, the journal cannot be opened),
    ``LockHeld`` and ``BalancerMisconfigured``/``BalancerDown`` before any host is touched."""
    with open_journal(journal_path) as journal:
        rid = rollout_id or next((r.id for r in journal.history(None, 200) if r.status in RUNNING_SHOWN), None)
        if not rid:
            raise NothingToResume("no unfinished rollout in the journal (`fleet history` lists them)")
        saved = journal.latest_state(rid)
        if saved.status is not RolloutStatus.RUNNING:
            raise JournalError(f"rollout {rid} is {saved.status.value} ({saved.reason}); nothing to resume")
        fleet = load_fleet(saved.fleet, sorted({r.host for r in saved.instances}), keep_connections=True)
        executor = fleet.executor(gates_over_ssh, lb=lb)
        try:
            for name, marker in executor.read_fact(list(fleet.hosts), Drained).items():
                if isinstance(marker, DrainMarker):
                    warn(f"host {name} is {marker.describe()}; rollout {rid} began before that, and goes on with it")
            executor.traffic.preflight()
            journal.acquire(saved.fleet, rid, takeover=take_over)
            try:
                with claimed(executor, saved):  # this rollout's own claims are its to take, from anywhere
                    return run(resume(saved, time.time()), executor, journal)
            finally:
                _release(journal, saved.fleet, rid)
        finally:
            executor.close()


@contextmanager
def claimed(executor: SshExecutor, state: RolloutState) -> Iterator[HostClaims]:
    """Every host of ``state`` claimed for it before anything is changed (``HostClaimed``, naming
    the owners, when another rollout holds one), renewed while the block runs, released after."""
    request = ClaimRequest.mine(state.id)
    claims = HostClaims(
        lambda host, mode, stale: executor.claim_host(host, request, mode, stale),
        tuple(sorted({r.host for r in state.instances})),
    )
    with claims:
        executor.claims = claims
        try:
            yield claims
        finally:
            executor.claims = None


#: what ``history`` shows for a rollout that has not ended
RUNNING_SHOWN = ("running", "interrupted")


class NothingToResume(JournalError):
    """The journal holds no unfinished rollout."""


def _release(journal: RolloutJournal, fleet: str, rollout_id: str) -> None:
    """Give the fleet's lock back; a journal that went away took the lock with it (PostgreSQL) or
    keeps a lock whose owner is gone, which ``--take-over`` takes (SQLite)."""
    with suppress(JournalError):
        journal.release(fleet, rollout_id)
