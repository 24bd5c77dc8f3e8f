"""What the engine decides from: facts observed about each instance, as plain data.

The executor fills these in (over SSH for systemd, NVML and the release marker; over HTTP for the
gates); the engine never does I/O itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.lb.runtime import ServerView
from fleet.rollout.batches import InstanceRef
from fleet.rollout.gates import Probe, UnitState


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on one of the instance's GPUs, as NVML lists it.

    ``ours``: the executor traced it to this instance's unit (its cgroup or its service user), so
    it is an engine the stopped unit left behind; anything else fleet does not stop.
    """

    pid: int
    name: str
    gpu: int
    used_bytes: int
    ours: bool

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name}) holding {self.used_bytes / 2**30:.1f} GiB on GPU {self.gpu}"


@dataclass(frozen=True)
class InstanceFacts:
    """One instance as it is now."""

    ref: InstanceRef
    unit: UnitState | None = None
    release: str | None = None  #: the release the instance's link points at (the host's marker)
    model: str | None = None  #: the served model name its configuration names
    revision: str | None = None  #: its configuration revision (the live unit and env file), when known
    #: the LoRA adapters that revision serves (its ``revision.json``); None when not recorded
    adapters: tuple[str, ...] | None = None
    gpu_processes: tuple[GpuProcess, ...] = ()
    in_flight: float | None = None  #: vllm:num_requests_running + waiting; None when /metrics gave nothing
    serving: bool = False  #: unit active and /health 200 (for the availability budget)
    unreachable: str = ""  #: why the host could not be asked; empty when it answered
    #: with ``unreachable``: when the host was last heard from (wall clock), when the executor knows
    unreachable_since: float | None = None
    probe: Probe | None = None  #: gate probes, made only for instances waiting on their gates
    #: another rollout holds the host's claim (``fleet.rollout.claims``): who; fleet must not touch it
    claimed_by: str = ""
    #: what the instance's load balancer says about its server (None: no balancer in front of it)
    lb: ServerView | None = None
    lb_error: str = ""  #: why its balancer could not be asked; empty when it answered (or there is none)

    @property
    def available(self) -> bool:
        """Serving clients: healthy and, behind a balancer, in its traffic (for the availability budget)."""
        return self.serving and (self.lb is None or self.lb.in_traffic) and not self.lb_error

    @property
    def process_gone(self) -> bool:
        """The unit has no process left (stopped, failed, or never started)."""
        return self.unit is not None and self.unit.active_state in ("inactive", "failed") and not self.unit.main_pid


@dataclass(frozen=True)
class Observations:
    at: float
    instances: Mapping[InstanceRef, InstanceFacts] = field(default_factory=dict)

    def of(self, ref: InstanceRef) -> InstanceFacts:
        return self.instances.get(ref) or InstanceFacts(ref, unreachable="not observed")
