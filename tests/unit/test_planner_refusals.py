"""Plans the planner refuses, and the ways out it names: a pinned TP across GPUs without NVLink.

Every way out offered is planned first; the table checks the refusal names the setting that is
the way out (``allow_pcie_tensor_parallel``) with its numbers, and that taking it plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import PlanError
from fleet.gpus import Fabric, HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import candidate_tps, plan_host
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


# -- block-quantized FP8 checkpoints: vLLM 0.33's rule depends on the TP and the GPU generation ----------

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
QWEN_MOE_FP8 = str(FIXTURES / "qwen3-30b-a3b-fp8")  # 768-wide experts, 128×128 blocks
QWEN_DENSE_FP8 = str(FIXTURES / "qwen3-4b-fp8")  # intermediate 9728, 128×128 blocks
BUSY = {"p95_input_tokens": 30000, "p95_output_tokens": 2000, "prefix_reuse": 0.0, "target_concurrency": 400}


@dataclass(frozen=True)
class Fp8Case:
    name: str
    model: str
    gpus: HostGpus
    candidates: tuple[int, ...]  #: the TP sizes fleet may choose
    pinned: int | None = None
    refused: str = ""  #: in the refusal's details ("" : it plans)
    ways: tuple[str, ...] = ()  #: prefixes of ways out, in order
    note: str = ""  #: in the plan's notes
    warning: str = ""  #: in the plan's warnings


def _uniform(count: int) -> HostGpus:
    return HostGpus.uniform(count, 80 * 1024**3, Fabric.SWITCH)


FP8 = [
    Fp8Case("MoE on H100: TP 4 with refined 64×64 scales", QWEN_MOE_FP8, HostGpus.from_catalogue("h100-sxm-80gb"),
            (1, 2, 4, 8), pinned=4, note="vLLM refines the block scales to 64×64"),
    Fp8Case("MoE on H100: TP 8 with refined 32×32 scales", QWEN_MOE_FP8, HostGpus.from_catalogue("h100-sxm-80gb"),
            (1, 2, 4, 8), pinned=8, note="vLLM refines the block scales to 32×32"),
    Fp8Case("MoE on A100: TP 4 has no kernel", QWEN_MOE_FP8, HostGpus.from_catalogue("a100-sxm-80gb"), (1, 2),
            pinned=4, refused="No FP8 MoE backend supports the deployment configuration",
            ways=("tensor_parallel_size: 1: 8 instance(s) at TP 1", "tensor_parallel_size: 2: 4 instance(s) at TP 2",
                  "remove tensor_parallel_size (fleet chooses): 4 instance(s) at TP 2",
                  "GPUs with native FP8 (compute capability ≥ 8.9", f"the 16-bit checkpoint of {QWEN_MOE_FP8}")),
    Fp8Case("MoE on A100: TP 8 has no kernel", QWEN_MOE_FP8, HostGpus.from_catalogue("a100-sxm-80gb"), (1, 2),
            pinned=8, refused="these GPUs are 8.0", ways=("tensor_parallel_size: 1",)),
    Fp8Case("MoE on A100, fleet's choice stays below TP 4", QWEN_MOE_FP8, HostGpus.from_catalogue("a100-sxm-80gb"),
            (1, 2)),
    Fp8Case("MoE at TP 16: no refinement (gcd 16)", QWEN_MOE_FP8, HostGpus.from_catalogue("h100-sxm-80gb", 16),
            (1, 2, 4, 8), pinned=16,
            refused="The output_size of gate's and up's weight = 48 is not divisible by weight quantization block_n",
            ways=("tensor_parallel_size: 1",)),
    Fp8Case("MoE on GPUs known by memory only: planned, with what it needs", QWEN_MOE_FP8, _uniform(8), (1, 2, 4, 8),
            pinned=4, note="refines the block scales to 64×64", warning="compute capability is not known"),
    Fp8Case("dense at TP 8: down_proj slice 1216", QWEN_DENSE_FP8, HostGpus.from_catalogue("h100-sxm-80gb"),
            (1, 2, 4), pinned=8,
            refused="Weight input_size_per_partition = 1216 is not divisible by weight quantization block_k = 128",
            ways=("tensor_parallel_size: 1", "tensor_parallel_size: 2", "tensor_parallel_size: 4")),
    Fp8Case("dense at TP 4: fine everywhere", QWEN_DENSE_FP8, HostGpus.from_catalogue("a100-sxm-80gb"), (1, 2, 4),
            pinned=4),
]  # fmt: skip


@pytest.mark.parametrize("case", FP8, ids=[c.name for c in FP8])
def test_block_fp8_checkpoints_plan_where_vllm_loads_them(case: Fp8Case) -> None:
    arch = load_model(case.model)
    free = spec(model=case.model, workload=BUSY)
    assert tuple(candidate_tps(arch, case.gpus, free, False)) == case.candidates
    s = spec(model=case.model, workload=BUSY, tensor_parallel_size=case.pinned)
    if case.refused:
        with pytest.raises(PlanError) as err:
            plan_host(s, case.gpus, arch)
        problem = err.value.problem
        assert any(case.refused in d for d in problem.details), problem.details
        found = iter(problem.ways_out)
        for prefix in case.ways:  # in order
            assert any(w.startswith(prefix) for w in found), (prefix, problem.ways_out)
        return
    plan = plan_host(s, case.gpus, arch)
    assert all(i.tensor_parallel_size in case.candidates for i in plan.instances)
    notes, warnings = " ".join(plan.notes), " ".join(plan.warnings)
    assert (case.note in notes) if case.note else "refines the block scales" not in notes
    assert (case.warning in warnings) if case.warning else "compute capability" not in warnings


def test_a_probed_host_is_judged_by_its_own_compute_capability() -> None:
    """No catalogue model, but the probe's compute capability: an Ampere board refuses the refined scales."""
    arch = load_model(QWEN_MOE_FP8)
    base = _uniform(8)
    for capability, tps in (((8, 0), (1, 2)), ((9, 0), (1, 2, 4, 8))):
        gpus = dataclasses.replace(
            base, gpus=tuple(dataclasses.replace(g, compute_capability=capability) for g in base.gpus)
        )
        assert tuple(candidate_tps(arch, gpus, spec(model=QWEN_MOE_FP8), False)) == tps
