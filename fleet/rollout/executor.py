"""What the engine needs done on hosts and over HTTP: the ``Executor`` protocol.

The deploy/rollout CLI implements it over SSH (systemd, NVML, the release link, hooks on the
control machine or on the host) and ``fleet.rollout.probe`` (HTTP gates). Every method is
idempotent: the runner may repeat a step after a crash (stopping a stopped unit, flipping a link
to where it points, starting an active unit are no-ops). A method that cannot do its job raises ``ExecutorError``
with a message for the operator; the runner records it as the step's outcome. The runner calls
the step methods of *different* instances from several threads at once (a batch restarts
together), so they must be safe to call concurrently for different instances.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fleet.errors import FleetError
from fleet.rollout.batches import InstanceRef
from fleet.rollout.gates import Probe
from fleet.rollout.observe import InstanceFacts
from fleet.rollout.policy import HookPlace, RolloutPolicy


class ExecutorError(FleetError):
    """A step could not be taken (SSH failed, systemctl failed, a hook failed)."""


class Executor(Protocol):
    def facts(self, ref: InstanceRef) -> InstanceFacts:
        """Unit state, release link, the release's model, NVML processes on the instance's GPUs,
        in-flight requests and whether it serves. An unreachable host is reported in
        ``InstanceFacts.unreachable`` (after the executor's own bounded retries), not raised."""
        ...

    def probe(self, ref: InstanceRef, policy: RolloutPolicy, model: str) -> Probe:
        """The gate probes over HTTP (unit state included), bounded by ``policy.probe_timeout_s``;
        ``model``: the served model the instance should list now (the completion asks for it)."""
        ...

    def stop_unit(self, ref: InstanceRef) -> str | None:
        """``systemctl stop``: SIGTERM, vLLM drains for ``--shutdown-timeout``; returns once stopped,
        with how the stop ended for the journal (``fleet.rollout.stopping.stop_outcome``: a
        SIGKILL after ``TimeoutStopSec`` is a known outcome, not an error)."""
        ...

    def start_unit(self, ref: InstanceRef) -> None: ...

    def kill(self, ref: InstanceRef, pids: Sequence[int]) -> None:
        """Stop orphaned engine processes of this instance (SIGTERM, then SIGKILL)."""
        ...

    def flip_release(self, ref: InstanceRef, release: str, revision: str | None = None) -> None:
        """Point the instance at an installed release (atomic link swap) and, with ``revision``,
        put that stored configuration revision in place (unit and env file, daemon-reload)."""
        ...

    def set_lb_state(self, ref: InstanceRef, state: str) -> None:
        """Set the instance's server on its load balancer to ``state`` ("drain", "ready", "maint")."""
        ...

    def run_hook(self, ref: InstanceRef, argv: Sequence[str], timeout_s: float, on: HookPlace) -> str:
        """Run a drain/undrain hook for ``ref`` (argv, no shell) on the control machine, or with
        ``on=HookPlace.HOST`` on ``ref``'s host as the SSH user; its output, or raise."""
        ...
