"""The report: JSON shape, --fail-on semantics, HTML escaping and the SVG's links, without hosts."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path

import pytest
from rich.console import Console

from fleet.audit.findings import Severity
from fleet.audit.report import LINK_DOWN, LINK_HIDDEN, LINK_OK, AuditReport, HostAudit, topology_svg
from fleet.audit.rules import Expectation, audit_host, unreachable
from fleet.facts.hostfacts import HostFacts, parse_probe

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"


def facts(name: str, **top: object) -> HostFacts:
    d = json.loads(json.loads((FIXTURES / f"{name}.json").read_text())["output"][-1])
    d.update(top)
    return parse_probe(d)


def report(*names: str) -> AuditReport:
    hosts = []
    for n in names:
        f = facts(n)
        hosts.append(HostAudit(n, f, None, audit_host(n, f, Expectation(vllm_version="0.33.0"))))
    hosts.append(HostAudit("gone", None, "cannot reach gone:22", [unreachable("gone", "cannot reach gone:22")]))
    return AuditReport("inv.py", hosts, [])


def test_json_summary_and_fail_on() -> None:
    r = report("h100-sxm-8", "h100-sxm-8-link-down", "rtx4090-2")
    data = r.to_json()
    assert data["summary"]["findings"] == {"info": 0, "warning": 2, "error": 1, "critical": 1}
    assert data["summary"]["unreachable"] == 1 and data["summary"]["worst"] == "critical"
    link_down = next(h for h in data["hosts"] if h["host"] == "h100-sxm-8-link-down")
    assert link_down["topology"] == "8xNV17" and link_down["gpus"][3]["active_nvlinks"] == 17
    assert r.failed(Severity.CRITICAL) and r.failed(Severity.ERROR)
    clean = report("h100-sxm-8")
    clean.hosts = clean.hosts[:1]
    assert not clean.failed(Severity.INFO) and clean.to_json()["summary"]["worst"] is None


def test_tables_render() -> None:
    out = io.StringIO()
    report("h100-sxm-8-link-down").print(Console(file=out, width=160, highlight=False))
    text = out.getvalue()
    assert "nvlink-down" in text and "GPU3 link 7" in text and "fleet summary" in text and "unreachable" in text


def test_html_escapes_what_hosts_say() -> None:
    d = json.loads(json.loads((FIXTURES / "h100-sxm-8.json").read_text())["output"][-1])
    d["gpus"][0]["name"] = "<script>alert(1)</script>"
    evil = parse_probe(d)
    r = AuditReport("<inv>.py", [HostAudit("h'1", evil, None, audit_host("h'1", evil, Expectation()))], [])
    page = r.to_html()
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;inv&gt;.py" in page
    assert "data-host='h&#x27;1'" in page


def test_svg_marks_links() -> None:
    healthy = topology_svg("a", facts("h100-sxm-8"), [])
    assert healthy.count("class='switch'") == 4 and LINK_OK in healthy and LINK_DOWN not in healthy
    down = facts("h100-sxm-8-link-down")
    svg = topology_svg("b", down, audit_host("b", down, Expectation()))
    assert "class='nvlink down'" in svg and LINK_DOWN in svg
    vm = topology_svg("c", facts("h100-sxm-1-passthrough"), [])
    assert LINK_HIDDEN in vm and "not visible (VM)" in vm and LINK_OK not in vm
    pcie = topology_svg("d", facts("l40s-4"), [])
    assert "PCIe only" in pcie and "class='nvlink" not in pcie
    pairs = topology_svg("e", facts("h100-pcie-8-bridged"), [])
    assert pairs.count("<path class='nvlink'") == 4 and pairs.count(">NV12<") == 4


def test_audit_html_is_written_atomically_and_a_missing_directory_refused_before_any_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fleet audit --html FILE``: the report replaces FILE whole (fleet.localfs.atomic_write,
    0644, no temporary left); a FILE in a directory that does not exist is refused with exit 2
    before any host is probed (before: the hosts were probed, then a FileNotFoundError traceback)."""
    from click.testing import CliRunner

    from fleet.cli import audit as audit_cli
    from tests.unit.test_audit_gate import _inventory

    probed: list[str] = []
    made = report("h100-sxm-8")
    monkeypatch.setattr(audit_cli, "probe", lambda loaded, **_: probed.append("nvml") or {})
    monkeypatch.setattr(audit_cli, "probe_acs", lambda loaded, **_: {})
    monkeypatch.setattr(audit_cli, "probe_watch", lambda loaded, **_: {})
    monkeypatch.setattr(audit_cli, "plan_multi_node", lambda loaded, results: ([], []))
    monkeypatch.setattr(audit_cli, "judge", lambda *a, **k: made)
    inventory = str(_inventory(tmp_path))
    missing = tmp_path / "no-such-dir" / "audit.html"
    out = CliRunner().invoke(audit_cli.audit, [inventory, "--json", "--html", str(missing)])
    assert out.exit_code == 2, out.output
    error = json.loads(out.stdout)["error"]
    assert str(missing) in error and "no host was probed" in error
    assert probed == [] and not missing.parent.exists()

    reports = tmp_path / "reports"
    reports.mkdir()
    html = reports / "audit.html"
    html.write_text("an older report")
    out = CliRunner().invoke(audit_cli.audit, [inventory, "--json", "--html", str(html)])
    assert probed == ["nvml"] and out.exit_code == 1, out.output  # the report's unreachable host fails it
    assert html.read_text(encoding="utf-8") == made.to_html()
    assert stat.S_IMODE(html.stat().st_mode) == 0o644
    assert [p.name for p in reports.iterdir()] == ["audit.html"]
