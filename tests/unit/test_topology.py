"""The topo -m matrix from probed facts equals real ``nvidia-smi topo -m`` outputs of the same
machine types (GPU x GPU blocks, NIC columns dropped), quoted from public issues:

* DGX/HGX H100 8x SXM, NV18 everywhere: HazyResearch/ThunderKittens#167;
* DGX A100 8x SXM, NV12 everywhere: NVIDIA/nccl#1505, NVIDIA/DCGM#149;
* 4x L40S, NODE within a NUMA node, SYS across: warpem/miss-alignment#106;
* 8x H100 PCIe with NVLink bridges in pairs, NV12: a public repository file (driver 580.126.09);
* 2x consumer GPUs on one root complex, PHB: noonghunna/club-3090#1229 (2x RTX 5090).

The facts are the probe's recorded outputs against the lab profiles of those machine types.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.topology import free_memory, host_gpus, island_shape, islands, nvlink_counts, topo_matrix

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"

H100_SXM = "\n".join("\t".join("X" if i == j else "NV18" for j in range(8)) for i in range(8))
A100_SXM = "\n".join("\t".join("X" if i == j else "NV12" for j in range(8)) for i in range(8))
L40S = """\
 X      NODE    SYS     SYS
NODE     X      SYS     SYS
SYS     SYS      X      NODE
SYS     SYS     NODE     X"""
H100_PCIE_BRIDGED = """\
 X      NODE    NODE    SYS     SYS     NV12    SYS     SYS
NODE     X      NV12    SYS     SYS     SYS     SYS     SYS
NODE    NV12     X      SYS     SYS     SYS     SYS     SYS
SYS     SYS     SYS      X      NV12    NODE    NODE    NODE
SYS     SYS     SYS     NV12     X      NODE    NODE    NODE
NV12    SYS     SYS     NODE    NODE     X      NODE    NODE
SYS     SYS     SYS     NODE    NODE    NODE     X      NV12
SYS     SYS     SYS     NODE    NODE    NODE    NV12     X"""
TWO_CONSUMER = """\
 X      PHB
PHB      X"""


def facts(name: str) -> HostFacts:
    return NvmlProbe().process(json.loads((FIXTURES / f"{name}.json").read_text())["output"])


def parse(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


@pytest.mark.parametrize(
    ("fixture", "real"),
    [
        ("h100-sxm-8", H100_SXM),
        ("a100-sxm-8", A100_SXM),
        ("l40s-4", L40S),
        ("h100-pcie-8-bridged", H100_PCIE_BRIDGED),
        ("rtx4090-2", TWO_CONSUMER),
    ],
)
def test_matrix_equals_real_nvidia_smi(fixture: str, real: str) -> None:
    assert topo_matrix(facts(fixture)) == parse(real)


def test_a_link_down_shows_nv17_on_that_gpu_only() -> None:
    m = topo_matrix(facts("h100-sxm-8-link-down"))
    assert [m[3][j] for j in range(8) if j != 3] == ["NV17"] * 7
    assert all(m[i][j] == "NV18" for i in range(8) for j in range(8) if i != j and 3 not in (i, j))


@pytest.mark.parametrize(
    ("fixture", "expected", "shape"),
    [
        ("h100-sxm-8", [set(range(8))], "8xNV18"),
        ("h100-sxm-8-gpu-missing", [set(range(7))], "7xNV18"),
        ("h100-pcie-8-bridged", [{0, 5}, {1, 2}, {3, 4}, {6, 7}], "4x(2xNV12)"),
        ("l40s-4", [{0}, {1}, {2}, {3}], "4x(1)"),
        ("h100-80gb-hbm3-vm", [{0}], "1"),
    ],
)
def test_islands(fixture: str, expected: list[set[int]], shape: str) -> None:
    f = facts(fixture)
    assert [set(i) for i in islands(f)] == expected
    assert island_shape(f) == shape


def test_partial_mesh_splits_into_fully_connected_islands() -> None:
    f = facts("h100-pcie-8-bridged")
    # link 0-5 and 5-1 only would not make {0,1,5} an island: pairs stay pairs
    counts = nvlink_counts(f)
    assert counts[0][5] == counts[5][0] == 12 and counts[0][1] == 0


def test_free_memory_is_nvml_v2_free() -> None:
    f = facts("h100-80gb-hbm3-vm")
    assert free_memory(f) == [85017493504]  # total - 480 MiB driver reserve


def test_host_gpus_carry_the_probed_reserve_and_use() -> None:
    hg = host_gpus(facts("h100-80gb-hbm3-vm"))
    (g,) = hg.gpus
    assert (g.memory_total, g.memory_reserved, g.memory_used) == (85520809984, 503316480, 0)
    assert hg.source == "probe" and hg.sku is not None and hg.sku.memory_reserved == g.memory_reserved
    assert g.compute_capability == hg.compute_capability == (9, 0)  # what picks the FP8 kernels


def test_probed_compute_capability_is_the_gpus_not_the_catalogues() -> None:
    f = facts("h100-80gb-hbm3-vm")
    renamed = dataclasses.replace(f, gpus=tuple(dataclasses.replace(g, name="NVIDIA Unknown") for g in f.gpus))
    hg = host_gpus(renamed)
    assert hg.sku is None and hg.compute_capability == (9, 0)
    unknown = dataclasses.replace(
        renamed, gpus=tuple(dataclasses.replace(g, compute_capability=None) for g in renamed.gpus)
    )
    assert host_gpus(unknown).compute_capability is None
