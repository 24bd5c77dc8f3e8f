"""GPU facts for the planner from live hosts: probe every reachable host, say why others were not.

``fleet plan`` uses these instead of the inventory's ``gpu`` data wherever a host answers (as
``fleet deploy`` plans them: memory our own units hold counts as free); a host
that cannot be probed (unreachable, no driver, no Python 3.6+) keeps the inventory's data, and
the note says so.
"""

from __future__ import annotations

from typing import Any

from fleet.facts import PROBE_CONNECT_TIMEOUT
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable, run_fact_on_hosts, targets_from_inventory
from fleet.gpus import HostGpus
from fleet.inventory.spec import LoadedInventory
from fleet.plan.gpu_source import planning_gpus


def probe_host_gpus(
    loaded: LoadedInventory,
    timeout: float = 20.0,
    python: str | None = None,
    connect_timeout: float = PROBE_CONNECT_TIMEOUT,
) -> tuple[dict[str, HostGpus], dict[str, str]]:
    """``({host: probed HostGpus}, {host: why it was not probed})`` for every host of ``loaded``.

    Every host's SSH port is connected to at once, each waited for ``connect_timeout`` seconds
    (``runner.open_connections``): hosts that do not answer cost that, together, and are planned
    from the inventory.
    """
    targets = targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])
    kwargs: dict[str, Any] = {"python": python} if python else {}
    results = run_fact_on_hosts(targets, NvmlProbe, timeout=timeout, connect_timeout=connect_timeout, **kwargs)
    gpus: dict[str, HostGpus] = {}
    notes: dict[str, str] = {}
    for name, result in results.items():
        if isinstance(result, HostUnreachable):
            notes[name] = f"not probed: {result.reason}"
        elif isinstance(result, HostFacts) and result.ok and result.gpus:
            gpus[name] = planning_gpus(result)  # as fleet deploy plans it: our own units' memory is free
        else:
            notes[name] = f"probe answered {result.status}" + (f" ({result.error_class})" if result.error_class else "")
    return gpus, notes
