"""The audit as a gate (``fleet.audit.gate``, pure, table) and on a rollout: critical findings and
a quarantined GPU an instance is planned on refuse, before any host is touched, unless
``--ignore-finding`` lets them through; findings a deploy fixes never refuse a deploy."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fleet.audit.findings import Finding, Severity
from fleet.audit.gate import DEPLOY, ROLLOUT, check_ignored, gate, refuses
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable, SshTarget
from fleet.gpuwatch.state import GpuEvent, GpuWatch, WatchState
from fleet.inventory.spec import HostSpec
from fleet.plan.outcomes import load_for_planning
from fleet.rollout.fleet_inventory import Facts, fleet_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}


def f(rule: str, sev: Severity = Severity.CRITICAL, gpu: int | None = None, host: str = "h1") -> Finding:
    return Finding(rule, sev, host, f"{rule} seen", gpu=gpu, way_out=f"fix {rule}")


@pytest.mark.parametrize(
    ("finding", "command", "planned", "compat", "refused"),
    [
        (f("driver-mismatch"), ROLLOUT, None, False, True),  # a rollout installs no driver
        (f("driver-mismatch"), DEPLOY, None, False, False),  # a driver waiting for its reboot: the deploy fixes it
        (f("driver-not-loaded"), DEPLOY, None, False, False),
        (f("nvml-library-missing"), DEPLOY, None, False, False),
        (f("nvml-library-missing"), ROLLOUT, None, False, True),
        (f("cuda-driver-too-old"), DEPLOY, None, True, False),  # cuda-compat planned
        (f("cuda-driver-too-old"), DEPLOY, None, False, True),
        (f("cuda-driver-too-old"), ROLLOUT, None, True, True),
        (f("row-remap-failed", gpu=3), ROLLOUT, {0, 1}, False, True),
        (f("gpu-missing"), DEPLOY, None, False, True),
        (f("host-unreachable"), ROLLOUT, None, False, False),  # the command reports it itself
        (f("nvlink-down", Severity.ERROR), ROLLOUT, None, False, False),  # not critical
        (f("gpu-quarantined", Severity.ERROR, gpu=2), ROLLOUT, {0, 1, 3}, False, False),  # planned around it
        (f("gpu-quarantined", Severity.ERROR, gpu=2), ROLLOUT, {2, 3}, False, True),  # an instance on it
        (f("gpu-quarantined", Severity.ERROR, gpu=2), DEPLOY, None, False, True),  # placement not known
    ],
)
def test_refuses(finding: Finding, command: str, planned: set[int] | None, compat: bool, refused: bool) -> None:
    assert refuses(finding, command, planned, compat) is refused


def test_an_ignored_finding_is_let_through_and_named() -> None:
    found = [f("driver-mismatch"), f("gpu-missing", host="h2"), f("nvlink-down", Severity.ERROR)]
    verdict = gate(found, ROLLOUT, ["gpu-missing"])
    assert [x.rule for x in verdict.refusing] == ["driver-mismatch"] and verdict.refused_hosts == ("h1",)
    assert [x.rule for x in verdict.overridden] == ["gpu-missing"]
    text = verdict.message("fleet restart")
    assert "h1: driver-mismatch (critical): driver-mismatch seen; fix driver-mismatch" in text
    assert "--ignore-finding driver-mismatch" in text and "before touching any host" in text
    assert gate(found, ROLLOUT, ["gpu-missing", "driver-mismatch"]).ok


@pytest.mark.parametrize("name", ["", "Driver Mismatch", "x", "a;rm -rf /", "-rf"])
def test_a_bad_ignore_finding_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match="--ignore-finding"):
        check_ignored([name])
    assert check_ignored(["driver-mismatch", "gpu-quarantined"]) == ["driver-mismatch", "gpu-quarantined"]


# -- on a rollout: fleet_of's one round of facts, and the CLI ---------------------------------------


def facts(name: str) -> HostFacts:
    return NvmlProbe().process(json.loads((FIXTURES / f"{name}.json").read_text())["output"])


def _inventory(tmp_path: Path) -> Path:
    rows = [
        (name, {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": WORKLOAD, "ssh_hostname": f"127.0.250.{k}",
                "gpu": {"sku": "h100-sxm-80gb", "count": 8}})
        for k, name in ((3, "h1"), (4, "h2"))
    ]  # fmt: skip
    path = tmp_path / "fleet.py"
    path.write_text(f"gpus = {rows!r}\n")
    return path


def _read(probes: Mapping[str, Any], watch: Mapping[str, Any] | None = None) -> Any:
    def read(specs: Sequence[HostSpec], ssh: Mapping[str, SshTarget], conns: Any = None) -> Facts:
        return probes, watch or {}

    return read


def test_a_rollout_onto_a_host_with_a_critical_finding_is_refused_unless_overridden(tmp_path: Path) -> None:
    loaded = load_for_planning(_inventory(tmp_path))
    fleet = fleet_of(loaded, read=_read({"h1": facts("h100-sxm-8-driver-mismatch"), "h2": facts("h100-sxm-8")}))
    verdict = fleet.gate()
    assert verdict.refused_hosts == ("h1",) and {x.rule for x in verdict.refusing} == {"driver-mismatch"}
    assert fleet.gate(["driver-mismatch"]).ok
    healthy = fleet_of(loaded, read=_read({"h1": facts("h100-sxm-8"), "h2": HostUnreachable("h2", "timed out")}))
    assert healthy.gate().ok  # an unreachable host is the rollout's to report, not the gate's


def test_a_quarantined_gpu_planned_around_does_not_refuse(tmp_path: Path) -> None:
    xid = GpuEvent(3, 1.0, "xid", 79, "reboot", "GPU has fallen off the bus")
    record = WatchState("ok", None, "r", 3, (GpuWatch("GPU-2", 2, "0000:02:00.0", (xid,), 0, xid),))
    loaded = load_for_planning(_inventory(tmp_path))
    fleet = fleet_of(loaded, read=_read({"h1": facts("h100-sxm-8"), "h2": facts("h100-sxm-8")}, {"h1": record}))
    assert all(2 not in s.gpus for r, s in fleet.instances.items() if r.host == "h1")
    assert [x.rule for x in fleet.findings] == ["gpu-quarantined"] and fleet.gate().ok


def test_the_cli_refuses_with_exit_1_before_touching_a_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.cli.rollout import restart
    from fleet.rollout import fleet_inventory

    probes = {"h1": facts("h100-sxm-8-driver-mismatch"), "h2": facts("h100-sxm-8")}
    monkeypatch.setattr(fleet_inventory, "read_facts", _read(probes))  # the hosts' answers, recorded
    journal = tmp_path / "journal.db"
    args = [str(_inventory(tmp_path)), "--json", "--journal", str(journal)]
    out = CliRunner().invoke(restart, args)
    assert out.exit_code == 1, out.output
    error = json.loads(out.stdout)["error"]
    assert "h1: driver-mismatch (critical)" in error and "--ignore-finding driver-mismatch" in error
    assert "nothing was touched" in error
    bad = CliRunner().invoke(restart, [*args, "--ignore-finding", "Not A Rule"])
    assert bad.exit_code == 2 and "--ignore-finding 'Not A Rule'" in json.loads(bad.stdout)["error"]


def test_deploy_refuses_a_bad_ignore_finding_with_exit_2(tmp_path: Path) -> None:
    from fleet.cli.deploy import deploy

    out = CliRunner().invoke(deploy, [str(_inventory(tmp_path)), "--json", "--ignore-finding", "x y"])
    assert out.exit_code == 2 and "--ignore-finding 'x y'" in json.loads(out.stdout)["error"]


def test_an_overridden_finding_is_journaled_with_the_rollout(tmp_path: Path) -> None:
    from fleet.rollout.session import open_journal, run_rollout

    loaded = load_for_planning(_inventory(tmp_path))
    fleet = fleet_of(loaded, read=_read({"h1": facts("h100-sxm-8-driver-mismatch"), "h2": facts("h100-sxm-8")}))
    verdict = fleet.gate(["driver-mismatch"])
    journal = tmp_path / "journal.db"
    final = run_rollout(
        fleet, "restart", lambda _ex: [], journal_path=journal, lb=False, overridden=verdict.overridden,
        run=lambda state, _ex, _j: state,  # no instance is touched: only what the rollout journals first
    )  # fmt: skip
    with open_journal(journal) as j:
        steps = [s for s in j.steps(final.id) if s.action == "finding-overridden"]
    assert [s.instance for s in steps] == ["h1"] * len(verdict.overridden) and steps
    assert "driver-mismatch (critical)" in steps[0].detail and "--ignore-finding driver-mismatch" in steps[0].detail
