"""Planning around quarantined GPUs: ``usable_gpus`` (pure) and its call in ``decide_gpus``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import PlanError
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.gpus import HostGpus
from fleet.gpuwatch.quarantine import usable_gpus
from fleet.inventory.spec import HostSpec, host_spec
from fleet.model.arch import load_model
from fleet.plan.gpu_source import decide_gpus
from fleet.plan.planner import plan_host

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"
L8 = "meta-llama/Llama-3.1-8B-Instruct"
L70 = "meta-llama/Llama-3.1-70B-Instruct"
BASE: dict[str, Any] = {
    "model": L8,
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
    "pip_index_url": "http://127.0.0.1:9000/simple/",
}


def facts(name: str) -> HostFacts:
    return NvmlProbe().process(json.loads((FIXTURES / f"{name}.json").read_text())["output"])


def spec(**extra: Any) -> HostSpec:
    return host_spec("inv.py", "gpu-3", (), {**BASE, **extra})


@pytest.mark.parametrize(
    ("sku", "count", "fabric", "quarantined", "islands"),
    [
        ("h100-sxm-80gb", 8, None, {2}, [{0, 1, 3, 4, 5, 6, 7}]),  # NVSwitch: one island less one
        ("h100-pcie-80gb", 4, "pairs", {0}, [{1}, {2, 3}]),  # its NVLink partner stays, alone
        ("l40s-48gb", 4, None, {1, 3}, [{0}, {2}]),
        ("l40s-48gb", 4, None, {9}, [{0}, {1}, {2}, {3}]),  # not on this host: unchanged
        ("l40s-48gb", 2, None, {0, 1}, []),
    ],
)
def test_usable_gpus(sku: str, count: int, fabric: Any, quarantined: set[int], islands: list[set[int]]) -> None:
    gpus = HostGpus.from_catalogue(sku, count, fabric)
    usable = usable_gpus(gpus, quarantined)
    assert [set(i) for i in usable.islands] == islands
    assert usable.gpus == gpus.gpus  # indices keep their meaning
    assert usable.usable == frozenset().union(*islands)


def test_no_instance_lands_on_a_quarantined_gpu() -> None:
    gpus = usable_gpus(HostGpus.from_catalogue("l40s-48gb"), {2})
    plan = plan_host(spec(), gpus, load_model(L8))
    assert [i.gpus for i in plan.instances] == [(0,), (1,), (3,)]


def test_tp4_keeps_off_the_quarantined_gpu() -> None:
    plan = plan_host(spec(model=L70), usable_gpus(HostGpus.from_catalogue("h100-sxm-80gb"), {2}), load_model(L70))
    assert [i.gpus for i in plan.instances] == [(0, 1), (3, 4), (5, 6)]  # 7 GPUs: TP2 thrice, not TP4 once


def test_decide_gpus_plans_around_the_quarantine() -> None:
    decision = decide_gpus(spec(), facts("h100-sxm-8"), {2: "XID 79 (reboot)"})
    assert decision.chosen.gpus is not None and 2 not in decision.chosen.gpus.usable
    assert decision.probed is not None and 2 not in decision.probed.usable
    assert decide_gpus(spec(), facts("h100-sxm-8")).chosen.gpus.usable == frozenset(range(8))  # type: ignore[union-attr]


def test_a_host_with_every_gpu_quarantined_is_refused_with_the_way_out() -> None:
    decision = decide_gpus(spec(), facts("a10-1"), {0: "XID 79 (reboot): fell off the bus"})
    assert isinstance(decision.refusal, PlanError)
    text = str(decision.refusal)
    assert "every GPU is quarantined (GPU 0: XID 79 (reboot): fell off the bus)" in text
    assert "fleet gpu clear gpu-3" in text
    assert decision.chosen.gpus is None  # a deploy waits: gpu_source raises the refusal


def test_the_fleet_plan_moves_instances_off_a_quarantined_gpu_and_says_why_a_host_is_refused(tmp_path: Path) -> None:
    from fleet.plan.outcomes import build_fleet_plan, load_for_planning

    workload = BASE["workload"]
    rows = [("a", {"model": L8, "workload": workload, "ssh_hostname": "127.0.250.3"}),
            ("b", {"model": L8, "workload": workload, "ssh_hostname": "127.0.250.4"})]  # fmt: skip
    path = tmp_path / "fleet.py"
    path.write_text(f"gpus = {rows!r}\n")
    loaded = load_for_planning(path)
    probes = {"a": facts("l40s-4"), "b": facts("a10-1")}
    held = {"a": {2: "XID 79 (reboot)"}, "b": {0: "DBE (reset)"}}
    for deploy in (False, True):
        fleet = build_fleet_plan(loaded, probes, deploy=deploy, quarantine=held)
        a = fleet.host("a").plan
        assert a is not None and [i.gpus for i in a.instances] == [(0,), (1,), (3,)]
        assert fleet.host("b").plan is None and "every GPU is quarantined (GPU 0: DBE (reset))" in str(
            fleet.host("b").refusal
        )
    assert [i.gpus for i in build_fleet_plan(loaded, probes).host("a").plan.instances] == [(0,), (1,), (2,), (3,)]  # type: ignore[union-attr]


def test_quarantine_of_a_watch_state() -> None:
    from fleet.gpuwatch.state import GpuEvent, GpuWatch, WatchState, quarantine_of

    e = GpuEvent(3, 10.0, "xid", 79, "reboot", "GPU has fallen off the bus")
    gpus = (GpuWatch("GPU-a", 2, "00000000:1B:00.0", (e,), 0, e), GpuWatch("GPU-b", 0, "", (), 0, None))
    assert quarantine_of(WatchState("ok", None, "r", 3, gpus)) == {2: "XID 79 (reboot): GPU has fallen off the bus"}
    assert quarantine_of(WatchState("foreign", "cloned", "r", 3, gpus)) == {}
    assert quarantine_of(None) == {}


@pytest.mark.parametrize(
    ("status", "quarantined", "expected"),
    [
        ("ok", True, [("gpu-quarantined", "error", 2)]),
        ("ok", False, []),
        ("none", False, []),  # no watcher deployed: nothing to say
        ("no-root", False, []),
        ("foreign", False, [("gpu-watch-record", "warning", None)]),
        ("bad-record", False, [("gpu-watch-record", "warning", None)]),
    ],
)
def test_the_audit_shows_the_quarantine(
    status: str, quarantined: bool, expected: list[tuple[str, str, int | None]]
) -> None:
    from fleet.audit.quarantine import rule_quarantine
    from fleet.gpuwatch.state import GpuEvent, GpuWatch, WatchState

    e = GpuEvent(3, 10.0, "xid", 79, "reboot", "GPU has fallen off the bus")
    gpus = (GpuWatch("GPU-a", 2, "", (e,), 0, e if quarantined else None),)
    findings = rule_quarantine("h", WatchState(status, "why" if status != "ok" else None, "r", 3, gpus))
    assert [(f.rule, f.severity.label, f.gpu) for f in findings] == expected
    if quarantined:
        assert "XID 79 (reboot)" in findings[0].message and "fleet gpu clear INVENTORY h 2 --why" in findings[0].way_out
