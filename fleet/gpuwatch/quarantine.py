"""Planning around quarantined GPUs (pure): a quarantined GPU is left out of the host's islands.

The planner places instances only on GPUs inside an NVLink island (``fleet.plan.planner.gpu_groups``;
PCIe tensor parallelism over ``HostGpus.usable``), so a GPU in no island gets no instance, and the
GPU indices keep their meaning (CUDA_VISIBLE_DEVICES, the units' DeviceAllow). Which GPUs are
quarantined comes from the watcher's record (``fleet.gpuwatch.state.WatchState.quarantined``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from fleet.gpus import HostGpus


def usable_gpus(gpus: HostGpus, quarantined: Collection[int]) -> HostGpus:
    """``gpus`` with the ``quarantined`` indices taken out of every island; unchanged when none of
    them is on the host. An NVLink partner of a quarantined GPU stays usable, alone in its island."""
    out = frozenset(quarantined) & {g.index for g in gpus.gpus}
    if not out:
        return gpus
    return replace(gpus, islands=tuple(i - out for i in gpus.islands if i - out))
