"""``fleet drain`` / ``fleet undrain`` as library calls: hosts out of service for maintenance and back.

A drain is a rollout of kind ``drain`` through the same engine, journal and lock as any other:
every instance of the hosts gets a ``stop_only`` target (``fleet.rollout.engine.Target``), so it
leaves its balancer's traffic (``drain``), its sessions and in-flight requests finish (each wait
bounded by ``drain_timeout_s``), its unit is stopped, its GPUs are checked free, and its server is
left in ``maint``. Around the engine, and journaled as steps of the same rollout:

* before anything is stopped, the host's marker (``fleet.facts.drain``: who, when, why) is written
  on every host, so from then on a rollout, restart or deploy from any control machine skips it
  (``fleet.rollout.session.run_rollout``); the marker's text is the journaled step's outcome too,
  which is what a rollout from this journal goes by for a host that does not answer.
  A marker that cannot be written stops the drain before any instance is touched (markers this
  drain wrote are removed again);
* once every instance is stopped, its units are disabled (``systemctl disable``), so a reboot
  during the maintenance does not bring them back (Kubernetes' ``kubectl drain`` cordons the node
  first for the same reason: nothing may come back while it is out).

An undrain is a rollout of kind ``undrain``: the units are enabled again, then each instance is
started on the release its host's ``current`` link names, gated (unit, ``/health``, ``/v1/models``,
a real completion) and put back ``ready``; the marker of a host is removed only when every one of
its instances is back. Both take all of the hosts' instances at once (``batches: [-1]``, the
availability budget lifted: a drained host is out of service on purpose) and halt on a failure.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleet.facts.drain import MARKER_PATH, DrainMarker, read_markers
from fleet.rollout.engine import Phase, RolloutState, RolloutStatus, Target
from fleet.rollout.executor import ExecutorError
from fleet.rollout.fleet_inventory import RolloutFleet
from fleet.rollout.journal import RolloutJournal, _user
from fleet.rollout.session import RunLoop, headless, run_rollout
from fleet.rollout.ssh_executor import SshExecutor

#: Every instance of the hosts at once; nothing to go "back" to.
POLICY: Mapping[str, Any] = {
    "batches": [-1],
    "max_unavailable": "100%",
    "whole_host": True,
    "on_failure": "halt",
    "canary_bake_s": 0,
}


def who() -> str:
    """``user@control-machine``: who drained a host."""
    return f"{_user()}@{socket.gethostname()}"


def _units(fleet: RolloutFleet, host: str) -> list[str]:
    return [s.unit for r, s in fleet.instances.items() if r.host == host]


def _releases(fleet: RolloutFleet, executor: SshExecutor) -> dict[str, str | None]:
    return {h: executor.links(h)[0] for h in fleet.hosts}


def drain(
    fleet: RolloutFleet,
    reason: str,
    *,
    by: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    journal_path: Path | None = None,
    take_over: bool = False,
    lb: bool = True,
    run: RunLoop = headless,
    warn: Callable[[str], None] = lambda _m: None,
    clock: Callable[[], float] = time.time,
) -> RolloutState:
    """Take every instance of ``fleet``'s hosts out of service (see the module docstring).

    ``reason`` was checked by ``fleet.inventory.schema.drain_reason``. Raises what ``run_rollout``
    raises (nothing touched)."""
    who_ = by or who()

    def targets_of(executor: SshExecutor) -> list[Target]:
        return [replace(t, stop_only=True) for t in fleet.targets(_releases(fleet, executor), restart=False)]

    def around(state: RolloutState, executor: SshExecutor, journal: RolloutJournal) -> RolloutState:
        written: list[str] = []
        for host in fleet.hosts:
            instances = tuple(r.instance for r in fleet.instances if r.host == host)
            marker = DrainMarker(who_, clock(), reason, state.id, instances)
            try:
                executor.write_root_file(host, MARKER_PATH, marker.to_json(), 0o600)
            except ExecutorError as exc:
                journal.record(state, "marker:drained", f"host {host}: {marker.describe()}", False, str(exc), clock(),
                               host)  # fmt: skip
                return _marker_failed(state, executor, journal, host, str(exc), written, clock)
            written.append(host)
            # the marker's text is the step's outcome: the journal answers for a host that is down
            journal.record(state, "marker:drained", f"host {host}: {marker.describe()} ({MARKER_PATH})", True,
                           marker.to_json().strip(), clock(), host)  # fmt: skip
        final = run(state, executor, journal)
        if final.status is not RolloutStatus.DONE:
            return final
        for host in fleet.hosts:
            units = _units(fleet, host)
            try:
                executor.set_enabled(host, units, False)
                journal.record(final, "units:disabled", f"host {host}: {' '.join(units)}", True, "", clock(), host)
            except ExecutorError as exc:
                journal.record(final, "units:disabled", f"host {host}: {' '.join(units)}", False, str(exc), clock(),
                               host)  # fmt: skip
                warn(f"host {host}: its units are stopped but still enabled (they start at the next boot): {exc}")
        return final

    return run_rollout(
        fleet, "drain", targets_of, {**POLICY, **(overrides or {})}, journal_path=journal_path,
        take_over=take_over, run=lambda s, e, j: around(s, e, j), lb=lb, warn=warn, skip_drained=False,
    )  # fmt: skip


def _marker_failed(
    state: RolloutState,
    executor: SshExecutor,
    journal: RolloutJournal,
    host: str,
    why: str,
    written: Sequence[str],
    clock: Callable[[], float],
) -> RolloutState:
    """A marker could not be written: nothing was stopped; the markers this drain wrote go again."""
    for other in written:
        try:
            executor.remove_file(other, MARKER_PATH)
            journal.record(state, "marker:removed", f"host {other}", True, "the drain stopped", clock(), other)
        except ExecutorError as exc:
            journal.record(state, "marker:removed", f"host {other}", False, str(exc), clock(), other)
    reason = f"could not write the drain marker on host {host} ({why}); no instance was touched"
    final = replace(state, status=RolloutStatus.HALTED, reason=reason)
    journal.save(final, clock())
    return final


def undrain(
    fleet: RolloutFleet,
    *,
    overrides: Mapping[str, Any] | None = None,
    journal_path: Path | None = None,
    take_over: bool = False,
    lb: bool = True,
    run: RunLoop = headless,
    warn: Callable[[str], None] = lambda _m: None,
    clock: Callable[[], float] = time.time,
) -> RolloutState:
    """Put every instance of ``fleet``'s hosts back into service (see the module docstring)."""
    drained: dict[str, DrainMarker] = {}

    def targets_of(executor: SshExecutor) -> list[Target]:
        return fleet.targets(_releases(fleet, executor), restart=False)

    def around(state: RolloutState, executor: SshExecutor, journal: RolloutJournal) -> RolloutState:
        drained.update(read_markers(fleet.ssh[h] for h in fleet.hosts))
        for host in fleet.hosts:
            if host not in drained:
                warn(f"host {host} is not drained (no {MARKER_PATH}); its instances are started and put back if "
                     "they are not serving")  # fmt: skip
        for host in fleet.hosts:
            units = _units(fleet, host)
            try:
                executor.set_enabled(host, units, True)
            except ExecutorError as exc:
                journal.record(state, "units:enabled", f"host {host}: {' '.join(units)}", False, str(exc), clock(),
                               host)  # fmt: skip
                final = replace(
                    state,
                    status=RolloutStatus.HALTED,
                    reason=f"could not enable the units of host {host} ({exc}); no instance was started",
                )
                journal.save(final, clock())
                return final
            journal.record(state, "units:enabled", f"host {host}: {' '.join(units)}", True, "", clock(), host)
        final = run(state, executor, journal)
        for host in fleet.hosts:
            mine = [i for r, i in final.instances.items() if r.host == host]
            if not all(i.phase is Phase.DONE for i in mine):
                continue
            if host not in drained:
                continue
            try:
                executor.remove_file(host, MARKER_PATH)
                journal.record(final, "marker:removed", f"host {host}", True, "every instance serves", clock(), host)
            except ExecutorError as exc:
                journal.record(final, "marker:removed", f"host {host}", False, str(exc), clock(), host)
                warn(f"host {host} serves again but its drain marker could not be removed: {exc}; run `fleet "
                     f"undrain` again")  # fmt: skip
        return final

    return run_rollout(
        fleet, "undrain", targets_of, {**POLICY, **(overrides or {})}, journal_path=journal_path,
        take_over=take_over, run=lambda s, e, j: around(s, e, j), lb=lb, warn=warn, skip_drained=False,
    )  # fmt: skip


__all__ = ["POLICY", "drain", "undrain", "who"]
