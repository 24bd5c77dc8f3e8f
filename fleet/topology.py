"""The GPU topology of a probed host: NVLink counts per pair, islands, the ``nvidia-smi topo -m``
matrix, free memory per GPU, and the ``HostGpus`` the planner consumes.

How pairs are read (NVML semantics, ``nvml.h`` and the tools that reimplement ``topo -m``):

* a **direct** NVLink counts for the pair when its remote PCI bus id is the peer GPU's
  (``nvmlDeviceGetNvLinkRemotePciInfo_v2``); this is what NCCL's topology XML ``count=`` shows;
* links to an **NVSwitch** (``nvmlDeviceGetNvLinkRemoteDeviceType`` = SWITCH) join every pair of
  switch-connected GPUs, with ``min(active switch links of a, of b)`` links (PyTorch's
  ``NVLinkDetector::detect`` in ``torch/csrc/distributed/c10d/symm_mem/CudaDMAConnectivity.cpp``);
  so 8 healthy H100 SXM show NV18 everywhere and a GPU with one link down shows NV17;
* without NVLink the symbol is the PCIe level of ``nvmlDeviceGetTopologyCommonAncestor``:
  SINGLE(10) PIX, MULTIPLE(20) PXB, HOSTBRIDGE(30) PHB, NODE(40) NODE, SYSTEM(50) SYS.

An **island** is a set of GPUs that all reach each other over NVLink (directly or through a
switch): tensor parallelism must stay inside one.
"""

from __future__ import annotations

from fleet.facts.hostfacts import REMOTE_GPU, REMOTE_SWITCH, HostFacts
from fleet.gpus import Gpu, HostGpus, sku_for

#: ``nvmlGpuTopologyLevel_t`` -> ``nvidia-smi topo -m`` symbol (INTERNAL, two GPUs on one board,
#: has no legend entry; it is shown as PIX, one on-board switch).
PCIE_SYMBOLS: dict[int, str] = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def switch_links(facts: HostFacts, index: int) -> int:
    """Active NVLinks of one GPU that end at an NVSwitch."""
    return sum(1 for link in facts.gpus[index].active_links if link.remote_type == REMOTE_SWITCH)


def nvlink_counts(facts: HostFacts) -> list[list[int]]:
    """Active NVLinks between every pair of GPUs (0 on the diagonal)."""
    n = len(facts.gpus)
    bus = [g.bus_id for g in facts.gpus]
    counts = [[0] * n for _ in range(n)]
    switch = [switch_links(facts, i) for i in range(n)]
    for i, g in enumerate(facts.gpus):
        for link in g.active_links:
            if link.remote_type == REMOTE_SWITCH or link.remote_bus_id is None:
                continue
            if link.remote_type not in (REMOTE_GPU, None):
                continue
            for j in range(n):
                if j != i and bus[j] == link.remote_bus_id:
                    counts[i][j] += 1
    for i in range(n):
        for j in range(n):
            if i != j and switch[i] and switch[j]:
                counts[i][j] += min(switch[i], switch[j])
    # a direct link seen from one side only (the other GPU's walk failed) still joins the pair
    for i in range(n):
        for j in range(i + 1, n):
            counts[i][j] = counts[j][i] = max(counts[i][j], counts[j][i])
    return counts


def topo_matrix(facts: HostFacts) -> list[list[str]]:
    """The GPU x GPU block of ``nvidia-smi topo -m``: X, NV#, PIX, PXB, PHB, NODE, SYS (``?``: unknown)."""
    counts = nvlink_counts(facts)
    n = len(facts.gpus)
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
            elif counts[i][j]:
                row.append(f"NV{counts[i][j]}")
            else:
                level = facts.common_ancestor[i][j]
                row.append(PCIE_SYMBOLS.get(level, "?") if level is not None else "?")
        out.append(row)
    return out


def format_matrix(matrix: list[list[str]]) -> str:
    """The matrix laid out like ``nvidia-smi topo -m`` (GPU columns only)."""
    n = len(matrix)
    lines = ["\t" + "\t".join(f"GPU{j}" for j in range(n))]
    lines += [f"GPU{i}\t" + "\t".join(row) for i, row in enumerate(matrix)]
    return "\n".join(lines)


def islands(facts: HostFacts) -> tuple[frozenset[int], ...]:
    """NVLink islands: groups of GPUs (NVML indices) that all reach each other over NVLink.

    Connected components of the NVLink graph, each split greedily into fully connected groups
    (a partial mesh such as DGX-1's hybrid cube is not one island for tensor parallelism).
    """
    counts = nvlink_counts(facts)
    n = len(counts)
    left = list(range(n))
    result: list[frozenset[int]] = []
    while left:
        seed = left.pop(0)
        group = [seed]
        for j in list(left):
            if all(counts[j][k] > 0 for k in group):
                group.append(j)
                left.remove(j)
        result.append(frozenset(group))
    return tuple(sorted(result, key=min))


def island_shape(facts: HostFacts) -> str:
    """A short signature of the topology, equal for hosts wired the same way: ``8xNV18`` or ``4x(2xNV12)``."""
    counts = nvlink_counts(facts)
    parts = []
    for island in islands(facts):
        members = sorted(island)
        if len(members) == 1:
            parts.append("1")
            continue
        links = min(counts[a][b] for a in members for b in members if a != b)
        parts.append(f"{len(members)}xNV{links}")
    groups: dict[str, int] = {}
    for p in parts:
        groups[p] = groups.get(p, 0) + 1
    return " + ".join(f"{k}" if v == 1 else f"{v}x({k})" for k, v in groups.items()) or "0"


def free_memory(facts: HostFacts) -> list[int | None]:
    """Free bytes per GPU (NVML v2 ``free``; None where NVML did not answer)."""
    return [g.memory.free if g.memory else None for g in facts.gpus]


def host_gpus(facts: HostFacts) -> HostGpus:
    """The planner's view of a probed host: GPUs with memory in use, and islands from the links.

    ``memory_used`` is NVML v2 ``used`` (memory held by processes, without the driver's reserve);
    ``memory_reserved`` is NVML v2 ``reserved`` (the driver's reserve as this host reports it).
    """
    gpus = []
    for g in facts.gpus:
        total = g.memory.total if g.memory else 0
        used = g.memory.used if g.memory else 0
        gpus.append(
            Gpu(
                index=g.index,
                name=g.name or "GPU",
                memory_total=total,
                memory_used=used,
                uuid=g.uuid or "",
                memory_reserved=g.memory.reserved if g.memory else None,
                compute_capability=(
                    (g.compute_capability[0], g.compute_capability[1])
                    if g.compute_capability is not None and len(g.compute_capability) == 2
                    else None
                ),
            )
        )
    sku = None
    names = {g.name for g in facts.gpus}
    if len(names) == 1:
        try:
            sku = sku_for(names.pop() or "")
        except KeyError:
            sku = None
    return HostGpus(
        gpus=tuple(gpus),
        islands=islands(facts),
        source="probe",
        driver_version=facts.driver_version or "",
        sku=sku,
        cuda_driver_version=facts.cuda_driver_version,
    )
