"""Audit rules, table-tested on probe facts: recorded outputs, and the same with one value changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleet.audit.findings import Severity
from fleet.audit.fleet_rules import fleet_findings
from fleet.audit.rules import Expectation, audit_host, vllm_cuda_requirement
from fleet.facts.hostfacts import HostFacts, parse_probe

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"
V = Expectation(vllm_version="0.33.0")


def doc(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.loads((FIXTURES / f"{name}.json").read_text())["output"][-1])
    return out


def facts(name: str, change: Callable[[dict[str, Any]], object] | None = None) -> HostFacts:
    d = doc(name)
    if change is not None:
        change(d)
    return parse_probe(d)


def found(f: HostFacts, expect: Expectation = V) -> set[tuple[str, str, int | None, int | None]]:
    return {(x.rule, x.severity.label, x.gpu, x.link) for x in audit_host("h", f, expect)}


def gpu(i: int, **values: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        d["gpus"][i].update(values)

    return change


# (fixture, change, expectation, findings)
TABLE: list[tuple[str, Callable[[dict[str, Any]], object] | None, Expectation, set[Any]]] = [
    # healthy machines of every kind: nothing
    ("h100-sxm-8", None, V, set()),
    ("a100-sxm-8", None, V, set()),
    ("l40s-4", None, V, set()),  # PCIe-only: no NVLink expected, no false alarm
    ("a10-1", None, V, set()),
    ("h100-pcie-8-bridged", None, V, set()),
    # the lab's faulty profiles
    ("h100-sxm-8-link-down", None, V, {("nvlink-down", "error", 3, 7)}),
    ("h100-sxm-8-gpu-missing", None, V, {("gpu-missing", "error", None, None)}),
    ("h100-sxm-8-gpu-missing", None, Expectation(8, "h100-sxm-80gb", "0.33.0"), {("gpu-missing", "critical", None, None)}),
    # GPU2 trained at Gen4 x8: the width counts; the generation not, the GPU is idle (clock-event reason GpuIdle)
    ("h100-sxm-8-pcie-degraded", None, V, {("pcie-width-degraded", "error", 2, None)}),
    ("h100-sxm-8-pcie-degraded", gpu(2, clock_event_reasons=0), V,
     {("pcie-width-degraded", "error", 2, None), ("pcie-gen-degraded", "error", 2, None)}),
    ("h100-sxm-8-driver-mismatch", None, V, {("driver-mismatch", "critical", None, None)}),
    ("a100-sxm-8-ecc-errors", None, V, {("ecc-uncorrected", "error", 4, None), ("row-remap-pending", "error", 4, None)}),
    ("rtx4090-2", None, V, {("persistence-off", "warning", 0, None), ("persistence-off", "warning", 1, None)}),
    # a real GPU passed through to a VM: the VM finding only, never "links down"
    ("h100-80gb-hbm3-vm", None, V, {("nvlink-not-visible-vm", "info", 0, None)}),
    ("h200-vm", None, V, {("nvlink-not-visible-vm", "info", 0, None)}),
    # and the lab profiles that mirror those machines
    ("h100-sxm-1-passthrough", None, V, {("nvlink-not-visible-vm", "info", 0, None)}),
    ("h200-sxm-1-passthrough", None, V, {("nvlink-not-visible-vm", "info", 0, None)}),
    # the same GPU with no NVLink answer but not in a VM is a real problem
    # (and one SXM GPU on bare metal is not a baseboard)
    ("h100-80gb-hbm3-vm", gpu(0, virtualization_mode=0), V,
     {("nvlink-not-reported", "error", 0, None), ("gpu-missing", "error", None, None)}),
    # no NVML / no driver / mismatch / zero GPUs: one clear finding each
    ("no-nvml-library", None, V, {("nvml-library-missing", "critical", None, None)}),
    ("driver-not-loaded", None, V, {("driver-not-loaded", "critical", None, None)}),
    ("lib-rm-version-mismatch", None, V, {("driver-mismatch", "critical", None, None)}),
    ("zero-gpus", None, V, {("no-gpus", "critical", None, None)}),
    # a GPU on the PCI bus that NVML does not enumerate
    ("h100-sxm-8", lambda d: d.update(pci_gpus=9), V, {("gpu-missing", "critical", None, None)}),
    # idle GPUs drop their link generation: not a finding at idle, a finding at load
    ("h100-80gb-hbm3-vm", gpu(0, pcie={"gen": 1, "max_gen": 5, "gpu_max_gen": 5, "width": 16, "max_width": 16}), V,
     {("nvlink-not-visible-vm", "info", 0, None)}),
    ("h100-80gb-hbm3-vm", gpu(0, clock_event_reasons=0, pcie={"gen": 3, "max_gen": 5, "gpu_max_gen": 5, "width": 16,
                                                              "max_width": 16}), V,
     {("nvlink-not-visible-vm", "info", 0, None), ("pcie-gen-degraded", "error", 0, None)}),
    ("h100-80gb-hbm3-vm", gpu(0, pcie={"gen": 4, "max_gen": 4, "gpu_max_gen": 5, "width": 16, "max_width": 16}), V,
     {("nvlink-not-visible-vm", "info", 0, None), ("pcie-slot-capped", "warning", 0, None)}),
    # throttling
    ("h100-sxm-8", gpu(1, clock_event_reasons=0x40), V, {("throttle-thermal", "error", 1, None)}),
    ("h100-sxm-8", gpu(1, clock_event_reasons=0x20), V, {("throttle-thermal", "warning", 1, None)}),
    ("h100-sxm-8", gpu(1, clock_event_reasons=0x80), V, {("throttle-power", "error", 1, None)}),
    ("h100-sxm-8", gpu(1, clock_event_reasons=0x4), V, {("throttle-power", "warning", 1, None)}),
    ("h100-sxm-8", gpu(1, clock_event_reasons=0x1), V, set()),  # idle is not throttling
    # memory health
    ("h100-sxm-8", gpu(2, remapped_rows=[0, 0, 0, 1]), V, {("row-remap-failed", "critical", 2, None)}),
    ("h100-sxm-8", gpu(2, remapped_rows=None, retired_pages={"sbe": 50, "dbe": 12, "pending": 0}), V,
     {("retired-pages", "error", 2, None)}),
    ("h100-sxm-8", gpu(2, remapped_rows=None, retired_pages={"sbe": 1, "dbe": 0, "pending": 1}), V,
     {("retired-pages-pending", "error", 2, None)}),
    ("h100-sxm-8", gpu(2, ecc_mode=[0, 0], ecc_errors=None), V, {("ecc-disabled", "warning", 2, None)}),
    # configuration
    ("h100-sxm-8", gpu(5, persistence=0), V, {("persistence-off", "warning", 5, None)}),
    ("h100-sxm-8", gpu(5, mig_mode=[1, 1]), V, {("mig-enabled", "error", 5, None)}),
    ("h100-sxm-8", gpu(5, mig_mode=[0, 1]), V, {("mig-pending", "warning", 5, None)}),
    ("h100-sxm-8", gpu(0, fabric={"state": 2, "status": 0, "clique_id": 0, "cluster_uuid": "0" * 32}), V,
     {("fabric-not-ready", "error", 0, None)}),
    ("h100-sxm-8", gpu(0, fabric={"state": 3, "status": 23, "clique_id": 0, "cluster_uuid": "0" * 32}), V,
     {("fabric-not-ready", "error", 0, None)}),
    ("h100-sxm-8", lambda d: d.update(cuda_driver_version=12040), V, {("cuda-driver-too-old", "critical", None, None)}),
    ("h100-sxm-8", lambda d: d.update(cuda_driver_version=12090), Expectation(vllm_version="0.11.0"), set()),
    ("h100-sxm-8", gpu(6, processes=[{"pid": 4242, "used_memory": 3 * 2**30, "comm": "python3", "unit": "session-3.scope"}]),
     V, {("foreign-process", "warning", 6, None)}),
    ("h100-sxm-8", gpu(6, processes=[{"pid": 4243, "used_memory": 9 * 2**30, "comm": "VLLM::Worker_TP0",
                                      "unit": "fleet-vllm-0.service"}]), V, set()),
    ("h100-sxm-8", None, Expectation(8, "a100-sxm-80gb", "0.33.0"), {("gpu-model-mismatch", "error", i, None) for i in range(8)}),
    ("h100-sxm-8", gpu(0, board_part_number="692-2G520-0282-000"), V, {("gpu-board-unexpected", "warning", 0, None)}),
]  # fmt: skip


@pytest.mark.parametrize(("fixture", "change", "expect", "expected"), TABLE)
def test_rules(fixture: str, change: Any, expect: Expectation, expected: set[Any]) -> None:
    assert found(facts(fixture, change), expect) == expected


def test_severities_order() -> None:
    assert Severity.CRITICAL > Severity.ERROR > Severity.WARNING > Severity.INFO
    assert Severity.parse("Error") is Severity.ERROR
    with pytest.raises(ValueError, match="one of"):
        Severity.parse("bad")


@pytest.mark.parametrize(("version", "cuda"), [("0.33.0", 13000), ("0.20.1", 13000), ("0.18.0", 12090), ("0.11.0", 12080),
                                               ("0.10.0", None), ("main", None)])  # fmt: skip
def test_vllm_cuda_requirement(version: str, cuda: int | None) -> None:
    assert vllm_cuda_requirement(version) == cuda


def test_fleet_rules_name_the_odd_host_and_what_differs() -> None:
    healthy = facts("h100-sxm-8")
    hosts = {
        "a": healthy,
        "b": healthy,
        "c": healthy,
        "d": facts("h100-sxm-8-link-down"),
        "e": facts("h100-sxm-8-gpu-missing"),
        "f": replace(healthy, driver_version="570.1"),
        "l": facts("l40s-4"),  # another model in the same group: not compared with the H100s
        "vm": facts("h100-80gb-hbm3-vm"),  # a VM is not compared with bare metal
    }
    findings = fleet_findings(hosts, {"prod": list(hosts)})
    got = {(f.host, f.rule) for f in findings}
    assert got == {("d", "fleet-topology"), ("e", "fleet-gpu-count"), ("e", "fleet-topology"), ("f", "fleet-driver")}
    (drv,) = [f for f in findings if f.rule == "fleet-driver"]
    assert "570.1" in drv.message and "580.95.05" in drv.message and drv.severity is Severity.WARNING


def test_fleet_rules_need_a_majority_of_three() -> None:
    a, b = facts("h100-sxm-8"), facts("h100-sxm-8-link-down")
    assert fleet_findings({"a": a, "b": b}, {"g": ["a", "b"]}) == []


def test_function_not_found_is_one_finding_listing_the_queries() -> None:
    f = facts("old-driver-function-not-found")
    (x,) = [x for x in audit_host("h", f, V) if x.rule == "nvml-function-missing"]
    assert x.severity is Severity.WARNING and x.gpu is None
    assert "board_part_number" in x.message and "clock_event_reasons" in x.message
