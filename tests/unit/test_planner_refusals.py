"""Plans the planner refuses, and the ways out it names: a pinned TP across GPUs without NVLink.

Every way out offered is planned first; the table checks the refusal names the setting that is
the way out (``allow_pcie_tensor_parallel``) with its numbers, and that taking it plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from fleet.errors import PlanError
from fleet.gpus import Fabric, HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import plan_host
from tests.unit.conftest import spec

L70 = "meta-llama/Llama-3.1-70B-Instruct"
L8 = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True)
class Pinned:
    name: str
    model: str
    sku: str
    count: int
    fabric: Fabric
    tp: int
    detail: str  #: in the refusal's details
    ways: tuple[str, ...]  #: prefixes of ways out, in this order (others may follow)
    allow_pcie: bool = False
    absent: tuple[str, ...] = ()  #: in no way out


PINNED = [
    Pinned("70B TP 4 on 4 L40S: TP over PCIe is the way", L70, "l40s-48gb", 4, Fabric.NONE, 4,
           "no NVLink between them: tensor parallelism over PCIe is only planned with allow_pcie_tensor_parallel: true",
           ("allow_pcie_tensor_parallel: true (keeps TP 4; these GPUs have no NVLink, TP over PCIe is slow): "
            "1 instance(s) at TP 4",
            "remove tensor_parallel_size, and more GPUs: 8 × l40s-48gb with allow_pcie_tensor_parallel: true")),
    Pinned("70B TP 2 on 4 L40S: nothing at TP 2, TP 4 over PCIe", L70, "l40s-48gb", 4, Fabric.NONE, 2,
           "allow_pcie_tensor_parallel: true",
           ("no tensor_parallel_size fits as the host is (sizes inside its NVLink islands: 1): the weights do not fit",
            "remove tensor_parallel_size, and allow_pcie_tensor_parallel: true (these GPUs have no NVLink; TP over "
            "PCIe is slow): 1 instance(s) at TP 4")),
    Pinned("8B TP 2 on 4 L40S: every way fits", L8, "l40s-48gb", 4, Fabric.NONE, 2,
           "allow_pcie_tensor_parallel: true",
           ("allow_pcie_tensor_parallel: true (keeps TP 2; these GPUs have no NVLink, TP over PCIe is slow): "
            "2 instance(s) at TP 2",
            "tensor_parallel_size: 1: 4 instance(s) at TP 1",
            "remove tensor_parallel_size (fleet chooses): 4 instance(s) at TP 1"),
           absent=("no tensor_parallel_size fits",)),
    Pinned("70B TP 2 on 2 H100 PCIe without bridges", L70, "h100-pcie-80gb", 2, Fabric.NONE, 2,
           "allow_pcie_tensor_parallel: true",
           ("allow_pcie_tensor_parallel: true (keeps TP 2; these GPUs have no NVLink, TP over PCIe is slow): "
            "1 instance(s) at TP 2",)),
    Pinned("70B TP 4 on bridged pairs: PCIe TP is no way out there", L70, "h100-pcie-80gb", 8, Fabric.PAIRS, 4,
           "TP 4 is larger than the largest NVLink island (2 GPUs)",
           ("tensor_parallel_size: 2: 4 instance(s) at TP 2", "remove tensor_parallel_size (fleet chooses)"),
           absent=("allow_pcie_tensor_parallel",)),
    Pinned("TP 8 on 4 GPUs, PCIe TP allowed", L8, "l40s-48gb", 4, Fabric.NONE, 8,
           "TP 8 is larger than the host's 4 GPUs",
           ("tensor_parallel_size: 1: 4 instance(s) at TP 1", "tensor_parallel_size: 2: 2 instance(s) at TP 2"),
           allow_pcie=True, absent=("keeps TP",)),
]  # fmt: skip


def _refusal(case: Pinned) -> tuple[Any, HostGpus]:
    gpus = HostGpus.from_catalogue(case.sku, case.count, case.fabric)
    s = spec(model=case.model, tensor_parallel_size=case.tp, allow_pcie_tensor_parallel=case.allow_pcie)
    with pytest.raises(PlanError) as err:
        plan_host(s, gpus, load_model(case.model))
    return err.value.problem, gpus


@pytest.mark.parametrize("case", PINNED, ids=[c.name for c in PINNED])
def test_pinned_tp_refusal_names_the_ways_out(case: Pinned) -> None:
    problem, _ = _refusal(case)
    assert problem.summary == f"tensor_parallel_size={case.tp} cannot work for {case.model}"
    assert any(case.detail in d for d in problem.details), problem.details
    found = iter(problem.ways_out)
    for prefix in case.ways:  # in order
        assert any(w.startswith(prefix) for w in found), (prefix, problem.ways_out)
    for text in case.absent:
        assert not any(text in w for w in problem.ways_out), problem.ways_out
    assert "none of the valid sizes" not in str(problem)


@pytest.mark.parametrize("case", [c for c in PINNED if "keeps TP" in c.ways[0]], ids=lambda c: c.name)
def test_the_pcie_way_out_plans_what_it_says(case: Pinned) -> None:
    problem, gpus = _refusal(case)
    numbers = problem.ways_out[0].rsplit(": ", 1)[1]
    s = spec(model=case.model, tensor_parallel_size=case.tp, allow_pcie_tensor_parallel=True)
    plan = plan_host(s, gpus, load_model(case.model))
    assert {i.tensor_parallel_size for i in plan.instances} == {case.tp}
    assert numbers.startswith(f"{len(plan.instances)} instance(s) at TP {case.tp}, {plan.total_kv_tokens:,} KV tokens")
    assert any("PCIe" in w for w in plan.warnings)
