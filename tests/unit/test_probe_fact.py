"""The NVML probe fact, pyinfra-style: ``process()`` on recorded probe outputs, no hosts.

Fixtures (``tests/fixtures/probe/``) are real outputs of the probe script: against the lab's NVML
library per profile, with no library, with init failing, with zero GPUs, and converted from what a
real driver answered on an H100 80GB HBM3 and an H200 (one GPU passed through to a VM).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.facts.hostfacts import VIRT_PASSTHROUGH, ProbeOutputError, parse_probe
from fleet.facts.nvml import NvmlProbe, probe_command
from fleet.topology import host_gpus

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"


def load(name: str) -> list[str]:
    out: list[str] = json.loads((FIXTURES / f"{name}.json").read_text())["output"]
    return out


# (fixture, status, error class, GPUs, name of GPU0)
CASES = [
    ("h100-sxm-8", "ok", None, 8, "NVIDIA H100 80GB HBM3"),
    ("h100-sxm-8-gpu-missing", "ok", None, 7, "NVIDIA H100 80GB HBM3"),
    ("a100-sxm-8", "ok", None, 8, "NVIDIA A100-SXM4-80GB"),
    ("l40s-4", "ok", None, 4, "NVIDIA L40S"),
    ("rtx4090-2", "ok", None, 2, "NVIDIA GeForce RTX 4090"),
    ("h100-80gb-hbm3-vm", "ok", None, 1, "NVIDIA H100 80GB HBM3"),
    ("h200-vm", "ok", None, 1, "NVIDIA H200"),
    ("h100-sxm-1-passthrough", "ok", None, 1, "NVIDIA H100 80GB HBM3"),
    ("h200-sxm-1-passthrough", "ok", None, 1, "NVIDIA H200"),
    ("no-nvml-library", "no-nvml-library", "LibraryNotFound", 0, None),
    ("driver-not-loaded", "driver-not-loaded", "DriverNotLoaded", 0, None),
    ("lib-rm-version-mismatch", "lib-rm-version-mismatch", "LibRmVersionMismatch", 0, None),
    ("zero-gpus", "no-gpus", "GpuNotFound", 0, None),
]


@pytest.mark.parametrize(("fixture", "status", "error", "count", "name"), CASES)
def test_process_recorded_outputs(fixture: str, status: str, error: str | None, count: int, name: str | None) -> None:
    facts = NvmlProbe().process(load(fixture))
    assert facts.status == status
    assert facts.error_class == error
    assert len(facts.gpus) == count
    if name is not None:
        assert facts.gpus[0].name == name


def test_real_h100_in_a_vm() -> None:
    facts = NvmlProbe().process(load("h100-80gb-hbm3-vm"))
    (g,) = facts.gpus
    assert facts.driver_version == facts.kernel_module_version == "580.159.04"
    assert facts.cuda_driver_version == 13000
    assert g.board_part_number == "692-2G520-0200-000"
    assert g.memory is not None and (g.memory.total, g.memory.reserved, g.memory.used) == (85520809984, 503316480, 0)
    assert g.memory.reserved + g.memory.used + g.memory.free == g.memory.total
    assert g.virtualization_mode == VIRT_PASSTHROUGH and facts.passthrough
    assert g.nvlinks == () and g.nvlink_error == "NotSupported"
    assert g.remapped_rows is not None and not g.remapped_rows.pending
    assert (g.pcie.gen, g.pcie.max_gen, g.pcie.width, g.pcie.max_width) == (5, 5, 16, 16)
    assert g.clock_event_reasons == 1  # GPU idle


def test_links_walk_and_errors_land_on_their_gpu() -> None:
    facts = NvmlProbe().process(load("h100-sxm-8-link-down"))
    g3 = facts.gpus[3]
    assert len(g3.nvlinks) == 18
    assert [link.link for link in g3.nvlinks if not link.active] == [7]
    # the walk ends at the first error past the last link; it is recorded on GPU3, not the host
    assert g3.errors["nvlink.18.state"] in ("InvalidArgument", "NotSupported")
    assert not any(k.startswith("gpu") for k in facts.errors)


def test_function_not_found_is_recorded_not_raised() -> None:
    facts = NvmlProbe().process(load("old-driver-function-not-found"))
    missing = {k for k, v in facts.all_errors().items() if v == "FunctionNotFound"}
    assert facts.ok and len(facts.gpus) == 8
    assert "gpu0.board_part_number" in missing
    assert facts.gpus[0].board_part_number is None


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(schema=2), "schema"),
        (lambda d: d.update(status="fine"), "status"),
        (lambda d: d["gpus"][0].update(bus_id="0000:18:00.0; rm -rf /"), "gpus[0].bus_id"),
        (lambda d: d["gpus"][0].update(index=-1), "gpus[0].index"),
        (lambda d: d["gpus"][0]["nvlinks"][0].update(active="yes"), "gpus[0].nvlinks[0].active"),
        (lambda d: d["gpus"][0]["memory"].update(total="80GB"), "gpus[0].memory.total"),
        (lambda d: d["topology"].update(common_ancestor=[[1]]), "common_ancestor"),
        (lambda d: d.update(errors={"x": "<script>"}), "errors"),
    ],
)
def test_bad_output_is_a_clear_error(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(load("h100-sxm-8")[-1])
    mutate(doc)
    with pytest.raises(ProbeOutputError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_probe(doc)


def test_garbage_output() -> None:
    with pytest.raises(ProbeOutputError, match="nothing"):
        NvmlProbe().process([])
    with pytest.raises(ProbeOutputError, match="not JSON"):
        NvmlProbe().process(["Traceback (most recent call last):"])


def test_command_runs_the_script_and_reports_a_missing_python(tmp_path: Path) -> None:
    """The command itself, through sh: no interpreter is a status naming what was tried."""
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(["sh", "-c", probe_command("/nonexistent/python3")], capture_output=True, text=True,
                          env=env, check=True)  # fmt: skip
    facts = NvmlProbe().process(done.stdout.splitlines())
    assert facts.status == "no-python" and facts.error_message == "none of: /nonexistent/python3 found"
    odd = '/nonexistent/a "b" \\n $(c)'  # quotes, a backslash, a substitution: data, never shell or JSON
    done = subprocess.run(["sh", "-c", probe_command(odd)], capture_output=True, text=True, env=env, check=True)
    assert NvmlProbe().process(done.stdout.splitlines()).error_message == f"none of: {odd} found"


def test_host_gpus_for_the_planner() -> None:
    facts = NvmlProbe().process(load("h100-pcie-8-bridged"))
    hg = host_gpus(facts)
    assert hg.source == "probe" and hg.count == 8
    assert set(hg.islands) == {frozenset({0, 5}), frozenset({1, 2}), frozenset({3, 4}), frozenset({6, 7})}
    assert hg.sku is not None and hg.sku.key == "h100-pcie-80gb"


@pytest.mark.parametrize(
    ("real", "lab"), [("h100-80gb-hbm3-vm", "h100-sxm-1-passthrough"), ("h200-vm", "h200-sxm-1-passthrough")]
)
def test_lab_passthrough_profile_probes_like_the_real_machine(real: str, lab: str) -> None:
    """What the probe concludes on the lab profile equals what it concludes on the real recording."""
    a, b = NvmlProbe().process(load(real)), NvmlProbe().process(load(lab))
    (ga,), (gb,) = a.gpus, b.gpus
    same = ("name", "board_part_number", "memory", "compute_capability", "architecture", "ecc_mode", "persistence",
            "mig_mode", "virtualization_mode", "nvlinks", "nvlink_error", "pcie", "remapped_rows",
            "power_limit_mw")  # fmt: skip
    assert {k: getattr(gb, k) for k in same} == {k: getattr(ga, k) for k in same}
    assert a.driver_version == b.driver_version and a.cuda_driver_version == b.cuda_driver_version


def test_audit_cli_bad_input_is_a_clear_error_before_any_host(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0, "target_concurrency": 4}
    inv.write_text(f"g = [('h1', {{'model': 'm/x', 'workload': {wl}, 'ssh_port': 'twenty-two'}})]\n")
    run = subprocess.run([sys.executable, "-m", "fleet.cli", "audit", str(inv), "--json"], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode == 2
    error = json.loads(run.stdout)["error"]
    assert f"{inv}: host h1: ssh_port='twenty-two'" in error and "integer" in error
    run = subprocess.run([sys.executable, "-m", "fleet.cli", "audit", str(tmp_path / "nope.py")], capture_output=True,
                         text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr and "nope.py" in run.stderr


def test_audit_cli_unreachable_host_is_a_critical_finding(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port on loopback with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0, "target_concurrency": 4}
    inv.write_text(
        f"g = [('h1', {{'model': 'm/x', 'workload': {wl}, 'ssh_hostname': '127.0.0.1', 'ssh_port': {port}}})]\n"
    )
    html = tmp_path / "r.html"
    run = subprocess.run([sys.executable, "-m", "fleet.cli", "audit", str(inv), "--json", "--html", str(html)],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    (h,) = report["hosts"]
    assert not h["reachable"] and str(port) in h["error"]
    assert [(f["rule"], f["severity"]) for f in h["findings"]] == [("host-unreachable", "critical")]
    assert report["summary"]["worst"] == "critical" and "unreachable" in html.read_text()
