"""The GPU watcher's quarantine in ``fleet audit`` (pure): a quarantined GPU is an error finding
with the event that quarantined it and the way out; a watcher record fleet cannot trust (another
machine's, corrupt) is a warning. No record at all says nothing: the watcher is not deployed."""

from __future__ import annotations

from fleet.audit.findings import Finding, Severity
from fleet.gpuwatch.state import WatchState


def rule_quarantine(host: str, state: WatchState | None) -> list[Finding]:
    if state is None or state.status in ("none", "no-root"):
        return []
    if not state.ok:
        return [
            Finding(
                "gpu-watch-record",
                Severity.WARNING,
                host,
                f"the GPU watcher's record cannot be used ({state.status}): {state.error}",
                way_out="restart the watcher (systemctl restart fleet-gpu-watch): it moves a foreign or corrupt "
                "record aside and begins a new one",
            )
        ]
    return [
        Finding(
            "gpu-quarantined",
            Severity.ERROR,
            host,
            f"GPU {index} is quarantined since {event.describe()}: deploys and rollouts plan around it",
            gpu=index,
            way_out=f"repair the GPU as NVIDIA's action says, then: "
            f"fleet gpu clear INVENTORY {host} {index} --why TEXT",
        )
        for index, event in sorted(state.quarantined().items())
    ]
