"""The NVML probe of every host of an inventory, all at once (read-only): what each answered, or
why it did not. Which GPU facts a host is then planned from is the planner's decision
(``fleet.plan.gpu_source``), not this module's.
"""

from __future__ import annotations

from typing import Any

from fleet.facts import PROBE_CONNECT_TIMEOUT
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable, run_fact_on_hosts, targets_from_inventory
from fleet.inventory.spec import LoadedInventory


def probe_hosts(
    loaded: LoadedInventory,
    timeout: float = 20.0,
    python: str | None = None,
    connect_timeout: float = PROBE_CONNECT_TIMEOUT,
) -> dict[str, HostFacts | HostUnreachable | None]:
    """Each selected host's NVML probe: its ``HostFacts``, ``HostUnreachable`` (why not), or None
    (the probe could not run).

    Every host's SSH port is connected to at once, each waited for ``connect_timeout`` seconds
    (``runner.open_connections``): hosts that do not answer cost that, together.
    """
    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    kwargs: dict[str, Any] = {"python": python} if python else {}
    results = run_fact_on_hosts(targets, NvmlProbe, timeout=timeout, connect_timeout=connect_timeout, **kwargs)
    return {name: r if isinstance(r, HostFacts | HostUnreachable) else None for name, r in results.items()}
