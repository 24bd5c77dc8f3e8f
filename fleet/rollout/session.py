"""One rollout from start to end, as a library call: check the policy, take the fleet's lock,
build the targets, journal the rollout, run it, release the lock.

``fleet rollout``/``restart``/``rollback`` call it with a live view; ``fleet deploy`` calls it for
the serving hosts whose release or configuration it changed. How the loop is run (``run``) is
the caller's: the command line adds its live view and Ctrl-C handling, a library caller takes
``headless``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleet.rollout.engine import RolloutState, Target, new_rollout
from fleet.rollout.fleet_inventory import RolloutFleet
from fleet.rollout.journal import Journal, default_path, new_rollout_id
from fleet.rollout.runner import Runner, open_rollout
from fleet.rollout.ssh_executor import SshExecutor

#: runs a journaled rollout to its end (or until stopped) and returns its last state
RunLoop = Callable[[RolloutState, SshExecutor, Journal], RolloutState]


def headless(state: RolloutState, executor: SshExecutor, journal: Journal) -> RolloutState:
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


def open_journal(path: Path | None = None) -> Journal:
    p = path or default_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    return Journal(p)


def run_rollout(
    fleet: RolloutFleet,
    kind: str,
    targets_of: Callable[[SshExecutor], list[Target]],
    overrides: Mapping[str, Any] | None = None,
    *,
    journal_path: Path | None = None,
    take_over: bool = False,
    gates_over_ssh: Sequence[str] = (),
    run: RunLoop = headless,
    lb: bool = True,
    warn: Callable[[str], None] = lambda _m: None,
) -> RolloutState:
    """Run one rollout of ``kind`` over ``targets_of(executor)``; its final (or stopped) state.

    Raises ``FleetError`` for a bad policy or targets (nothing touched), ``LockHeld`` when another
    rollout holds the fleet's lock, ``BalancerMisconfigured``/``BalancerDown`` when a load balancer
    in front of the instances cannot be used or does not answer (nothing touched either; ``lb=False``
    rolls without it). ``warn`` hears, once, that clients will see failed requests when nothing
    takes the instances out of traffic.
    """
    policy = fleet.policy(overrides)
    executor = fleet.executor(gates_over_ssh, lb=lb)
    try:
        executor.traffic.preflight()
        unsteered = [r for r in fleet.instances if executor.traffic.seat(r.host, r.instance) is None]
        if unsteered and policy.hooks.drain is None:
            warn(no_balancer_warning(len(unsteered), len(fleet.instances), lb))
        with open_journal(journal_path) as journal:
            now = time.time()
            rollout_id = new_rollout_id(now)
            journal.acquire(fleet.name, rollout_id, takeover=take_over)
            try:
                state = open_rollout(
                    journal, new_rollout(rollout_id, fleet.name, kind, targets_of(executor), policy, now)
                )
                return run(state, executor, journal)
            finally:
                journal.release(fleet.name, rollout_id)
    finally:
        executor.close()
