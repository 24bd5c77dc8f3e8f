"""Where a deploy takes a host's GPU facts from (pure): its probe, its inventory gpu entry as a
check, or nothing yet; fed with recorded probe answers (real H100/H200 drivers and lab hosts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import PlanError
from fleet.facts.hostfacts import HostFacts, parse_probe
from fleet.facts.nvml import NvmlProbe
from fleet.gpus import GiB
from fleet.inventory.spec import HostSpec, host_spec
from fleet.plan.gpu_source import GpuMismatch, GpusNotKnownYet, gpu_source, mismatches
from fleet.render import part
from fleet.topology import host_gpus
from fleetlab.inventory_writer import declared_gpus

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"
BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
    "pip_index_url": "http://127.0.0.1:9000/simple/",
}


def raw(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.loads((FIXTURES / f"{name}.json").read_text())["output"][-1])
    return out


def facts(name: str) -> HostFacts:
    return NvmlProbe().process(json.loads((FIXTURES / f"{name}.json").read_text())["output"])


def spec(gpu: dict[str, Any] | None = None, **extra: Any) -> HostSpec:
    data = {**BASE, **extra, **({"gpu": gpu} if gpu is not None else {})}
    return host_spec("inv.py", "gpu-3", (), data)


# ---- the probe answers: planned from it, an inventory entry is checked ---------------------------


@pytest.mark.parametrize(
    ("fixture", "name", "gib"),
    [("h100-80gb-hbm3-vm", "NVIDIA H100 80GB HBM3", 79.6), ("h200-vm", "NVIDIA H200", 140.4)],
)
def test_a_real_driver_answer_plans_the_host_without_an_inventory_entry(fixture: str, name: str, gib: float) -> None:
    source = gpu_source(spec(), facts(fixture))
    assert source.origin == "probe" and source.gpus is not None
    assert [g.name for g in source.gpus.gpus] == [name]
    assert source.gpus.gpus[0].memory_total / GiB == pytest.approx(gib, abs=0.1)
    plan = part.host_plan(part.spec_of("gpu-3", BASE), facts(fixture))
    assert plan.gpus_source == "probe" and len(plan.instances) == 1
    # the reserve the driver really reported is what the plan uses (not the catalogue's)
    assert plan.instances[0].memory.reserve_source == "probe"


@pytest.mark.parametrize(
    ("fixture", "gpu"),
    [
        ("h100-80gb-hbm3-vm", {"sku": "h100-sxm-80gb", "count": 1}),
        ("h200-vm", {"sku": "h200-sxm-141gb", "count": 1}),
        ("h200-vm", {"memory_gib": 140, "count": 1}),  # within 1 % of NVML's 140.4 GiB
        ("h100-sxm-8", {"sku": "h100-sxm-80gb", "count": 8}),  # nvlink: the SKU's switch
        ("h100-sxm-8-link-down", {"sku": "h100-sxm-80gb", "count": 8, "nvlink": "switch"}),  # NV17 still joins
        ("h100-pcie-8-bridged", {"sku": "h100-pcie-80gb", "count": 8, "nvlink": "pairs"}),  # pairs by slot
        ("l40s-4", {"sku": "l40s-48gb", "count": 4}),
        ("rtx4090-2", {"memory_gib": 24, "count": 2}),
    ],
)
def test_an_agreeing_inventory_entry_is_a_passed_check_and_the_probe_plans(fixture: str, gpu: dict[str, Any]) -> None:
    probed = facts(fixture)
    assert mismatches(spec(gpu).gpu, host_gpus(probed)) == []  # type: ignore[arg-type]
    source = gpu_source(spec(gpu), probed)
    assert source.origin == "probe" and source.gpus is not None and source.gpus.source == "probe"


@pytest.mark.parametrize(
    ("fixture", "gpu", "expected"),
    [
        (
            "h100-80gb-hbm3-vm",
            {"sku": "h200-sxm-141gb", "count": 1},
            [
                "model: the inventory says h200-sxm-141gb (NVIDIA H200), "
                "the probe found NVIDIA H100 80GB HBM3 on GPU 0",
                "memory: the inventory says 140.4 GiB per GPU, the probe found 79.6 GiB on GPU 0",
            ],
        ),
        (
            "h200-vm",
            {"sku": "h200-sxm-141gb", "count": 8},
            ["count: the inventory says 8, the probe found 1"],
        ),
        (
            "h100-sxm-8-gpu-missing",  # a GPU fell off the bus
            {"sku": "h100-sxm-80gb", "count": 8},
            ["count: the inventory says 8, the probe found 7"],
        ),
        (
            "l40s-4",  # "48GB" on the box is 48e9 bytes: NVML says 45.0 GiB
            {"memory_gib": 48, "count": 4},
            ["memory: the inventory says 48.0 GiB per GPU, the probe found 45.0 GiB on GPU 0,1,2,3"],
        ),
        (
            "h100-sxm-8",
            {"memory_gib": 79.6, "count": 8, "nvlink": "none"},
            [
                "NVLink: the inventory says nvlink=none (islands {0} {1} {2} {3} {4} {5} {6} {7}), "
                "the probe found islands {0,1,2,3,4,5,6,7}"
            ],
        ),
        (
            "l40s-4",
            {"memory_gib": 45, "count": 4, "nvlink": "pairs"},
            ["NVLink: the inventory says nvlink=pairs (islands {0,1} {2,3}), the probe found islands {0} {1} {2} {3}"],
        ),
    ],
)
def test_a_disagreeing_inventory_entry_refuses_the_host_naming_both_sides(
    fixture: str, gpu: dict[str, Any], expected: list[str]
) -> None:
    with pytest.raises(GpuMismatch) as err:
        gpu_source(spec(gpu), facts(fixture))
    assert err.value.differences == expected
    text = str(err.value)
    assert text.startswith("host gpu-3: the inventory's gpu entry does not match the host's GPUs: ")
    assert "Fix the host's gpu entry, or remove it to plan from the probe" in text
    with pytest.raises(GpuMismatch):  # the deploy's planning function refuses the same way
        part.host_plan(part.spec_of("gpu-3", {**BASE, "gpu": gpu}), facts(fixture))


def test_every_lab_profile_declares_what_its_simulated_nvml_answers() -> None:
    """``fleet lab up`` writes gpu entries; each agrees with its host's probe, but for the profile
    that simulates a failure (a GPU missing: declared as built, so the deploy refuses it)."""
    seen = 0
    for path in sorted(FIXTURES.glob("*.json")):
        source = json.loads(path.read_text()).get("source", "")
        if not source.startswith("probe against the lab NVML library, profile "):
            continue
        profile = source.rsplit(" ", 1)[1]
        found = mismatches(spec(declared_gpus(profile)).gpu, host_gpus(facts(path.stem)))  # type: ignore[arg-type]
        missing = ["count: the inventory says 8, the probe found 7"]
        assert found == (missing if "gpu-missing" in profile else []), profile
        seen += 1
    assert seen >= 10


# ---- NVML does not answer (yet) -------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["driver-not-loaded", "no-nvml-library", "lib-rm-version-mismatch"])
def test_no_driver_yet_plans_from_the_inventory_entry_or_waits(fixture: str) -> None:
    declared = gpu_source(spec({"sku": "rtx-4090-24gb", "count": 2}), facts(fixture))
    assert declared.origin == "inventory" and declared.gpus is not None and declared.gpus.count == 2
    assert declared.why.startswith(f"NVML probe: {facts(fixture).status}")
    waiting = gpu_source(spec(), facts(fixture))
    assert waiting.waiting and waiting.origin == "none"
    with pytest.raises(GpusNotKnownYet, match=r"host gpu-3: its units wait for NVML to answer \(NVML probe: "):
        part.host_plan(part.spec_of("gpu-3", BASE), facts(fixture))


def test_no_nvidia_ml_py_before_the_release_venv_exists_waits() -> None:
    bare = parse_probe({"schema": 1, "status": "no-pynvml", "error": {"class": "ModuleNotFoundError", "message": "x"}})
    assert gpu_source(spec(), bare).waiting


def test_a_driver_without_gpus_refuses() -> None:
    with pytest.raises(GpuMismatch, match="count: the inventory says 2, the probe found none"):
        gpu_source(spec({"sku": "rtx-4090-24gb", "count": 2}), facts("zero-gpus"))
    with pytest.raises(PlanError, match="NVML answers but enumerates no GPU"):
        gpu_source(spec(), facts("zero-gpus"))


def test_a_failed_probe_falls_back_to_the_inventory_entry_or_refuses() -> None:
    failed = parse_probe({"schema": 1, "status": "nvml-error", "error": {"class": "NVMLError_Unknown", "message": "x"}})
    for answer in (failed, "the probe's output was not understood: ..."):
        assert gpu_source(spec({"sku": "a10-24gb", "count": 1}), answer).origin == "inventory"
        with pytest.raises(PlanError, match="no GPU facts: the NVML probe failed"):
            gpu_source(spec(), answer)


def test_not_probed_is_planning_offline_as_before() -> None:
    assert gpu_source(spec({"sku": "a10-24gb", "count": 1}), None).origin == "inventory"
    with pytest.raises(PlanError, match="no GPU facts"):
        gpu_source(spec(), None)
    assert part.host_plan(
        part.spec_of("gpu-3", {**BASE, "gpu": {"sku": "a10-24gb", "count": 1}})
    ).gpus_source.startswith("catalogue:")


# ---- memory our own units hold ----------------------------------------------------------------------


def _with_process(unit: str, used: int | None) -> HostFacts:
    d = raw("a100-sxm-8")
    for g in d["gpus"]:
        g["memory"]["used"] = 70 * GiB
        g["memory"]["free"] = g["memory"]["total"] - g["memory"]["reserved"] - 70 * GiB
        g["processes"] = [{"pid": 100 + g["index"], "used_memory": used, "comm": "python3", "unit": unit}]
    return parse_probe(d)


def _argvs(probed: HostFacts) -> list[list[str]]:
    return [i.argv for i in part.host_plan(part.spec_of("gpu-3", BASE), probed).instances]


def test_memory_our_units_hold_counts_as_free_so_a_serving_host_plans_the_same() -> None:
    idle = _argvs(facts("a100-sxm-8"))
    assert _argvs(_with_process("fleet-vllm-0.service", 70 * GiB)) == idle
    assert _argvs(_with_process("fleet-vllm-0.service", None)) == idle  # NVML did not say how much
    foreign = part.host_plan(part.spec_of("gpu-3", BASE), _with_process("session-4.scope", 70 * GiB))
    assert [i.argv for i in foreign.instances] != idle  # someone else's memory lowers the utilization
    assert all(i.memory.utilization < 0.5 for i in foreign.instances)


# ---- fleet deploy's checks before any host is touched ---------------------------------------------


def test_deploy_checks_need_no_gpu_entry_but_still_refuse_bad_input_first(tmp_path: Path) -> None:
    from fleet.deploy.runner import check_hosts
    from fleet.errors import FleetError
    from fleet.inventory.spec import load_inventory

    inv = tmp_path / "inv.py"
    hosts = [("gpu-1", BASE), ("gpu-2", {**BASE, "gpu": {"sku": "a10-24gb", "count": 1}})]
    inv.write_text(f"gpus = {hosts!r}\n")
    assert list(check_hosts(load_inventory(str(inv)))) == ["gpu-2"]  # gpu-1 is planned from its probe
    bad = [("gpu-1", {**BASE, "model_config": str(tmp_path / "missing" / "config.json")})]
    inv.write_text(f"gpus = {bad!r}\n")
    with pytest.raises(FleetError, match=r"missing/config\.json"):
        check_hosts(load_inventory(str(inv)))


# ---- the one door: every answer in one value (decide_gpus) ---------------------------------------


def test_one_decision_holds_what_is_declared_probed_chosen_and_how_they_differ() -> None:
    from fleet.plan.gpu_source import decide_gpus

    d = decide_gpus(spec({"sku": "h100-sxm-80gb", "count": 2}), facts("h200-vm"))
    assert d.declared is not None and d.declared.count == 2 and d.declared.source == "catalogue:h100-sxm-80gb"
    assert d.probed is not None and [g.name for g in d.probed.gpus] == ["NVIDIA H200"]
    assert any(x.startswith("count: the inventory says 2, the probe found 1") for x in d.differences)
    assert isinstance(d.refusal, GpuMismatch) and d.chosen.gpus is None  # a deploy refuses the host
    assert d.for_plan() is d.probed  # fleet plan shows what the host has

    agreed = decide_gpus(spec({"sku": "h200-sxm-141gb", "count": 1}), facts("h200-vm"))
    assert agreed.differences == () and agreed.refusal is None and agreed.chosen.origin == "probe"

    offline = decide_gpus(spec({"sku": "l40s-48gb", "count": 4}), None)
    assert offline.probed is None and offline.chosen.origin == "inventory" and offline.for_plan() is not None

    waiting = decide_gpus(spec(), "unreachable: 127.0.250.1:22 refused the connection (no sshd listening)")
    assert waiting.declared is None and waiting.for_plan() is None and isinstance(waiting.refusal, PlanError)
