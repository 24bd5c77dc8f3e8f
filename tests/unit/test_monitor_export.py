"""`fleet monitor export`: thresholds from the inventory, targets from the plan, rules for the pinned
vLLM's metric names, checked by promtool (check config, check rules) and unit-tested with
`promtool test rules` against synthetic series for each alert: the bad instance fires, the
others stay quiet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleet.monitor.export import ExportOptions, export_files
from fleet.monitor.findings import FindingsError, parse_findings, textfile
from fleet.monitor.metric_names import TABLE, UnknownVllmVersion, names_for
from fleet.monitor.rules import group_hosts, rules_file
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds, duration_seconds, parse_thresholds

REPO = Path(__file__).resolve().parents[2]
FLEET = [sys.executable, "-m", "fleet.cli"]
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) not installed")

WL = {"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 8}
A10 = {"sku": "a10-24gb", "count": 1}
MISTRAL = "mistralai/Mistral-7B-Instruct-v0.3"


def write_inventory(path: Path, b_alerts: dict[str, Any] | None = None, a_alerts: Any = None) -> Path:
    common = {"model": MISTRAL, "workload": WL, "gpu": A10}
    a = {**common, "ssh_hostname": "10.0.0.1", **({"alerts": a_alerts} if a_alerts is not None else {})}
    b = {**common, "ssh_hostname": "10.0.0.2", "port": 9000, **({"alerts": b_alerts} if b_alerts else {})}
    c = {**common, "served_model_name": "mistral", "bind_address": "127.0.0.1"}
    path.write_text(f"chat = [('a', {a!r}), ('b', {b!r})]\nedge = [('c', {c!r})]\n")
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120"}
    return subprocess.run([*FLEET, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


# ---- thresholds -----------------------------------------------------------------------------------


def test_thresholds_defaults_and_overrides() -> None:
    assert parse_thresholds("inv.py", "h", None) == (Thresholds(), [])
    th, problems = parse_thresholds("inv.py", "h", {"kv_cache_usage": 0.8, "waiting_requests": 5, "for": "30s"})
    assert not problems
    assert (th.kv_cache_usage, th.waiting_requests) == (0.8, 5)
    # the blanket "for" sets every *_for; an explicit one wins
    assert (th.kv_cache_for, th.latency_for, th.instance_down_for) == ("30s", "30s", "30s")
    th, _ = parse_thresholds("inv.py", "h", {"for": "30s", "kv_cache_for": "2m"})
    assert (th.kv_cache_for, th.waiting_for) == ("2m", "30s")
    assert th.preemption_window == Thresholds().preemption_window  # windows are not durations of "for"


@pytest.mark.parametrize(
    ("raw", "field", "allowed"),
    [
        ({"kv_cache_usage": 1.5}, "alerts.kv_cache_usage", "a fraction in (0, 1]"),
        ({"kv_cache_usage": True}, "alerts.kv_cache_usage", "a fraction in (0, 1]"),
        ({"preemption_ratio": 0}, "alerts.preemption_ratio", "a fraction in (0, 1]"),
        ({"waiting_requests": -1}, "alerts.waiting_requests", "a whole number >= 0"),
        ({"waiting_requests": 2.5}, "alerts.waiting_requests", "a whole number >= 0"),
        ({"e2e_p99_seconds": "fast"}, "alerts.e2e_p99_seconds", "a number of seconds > 0"),
        ({"kv_cache_for": "10 minutes"}, "alerts.kv_cache_for", "a Prometheus duration"),
        ({"restart_window": "0s"}, "alerts.restart_window", "a Prometheus duration"),
        ({"kv_cache_usge": 0.9}, "alerts.kv_cache_usge", "unknown key; allowed: kv_cache_usage"),
        ("high", "alerts", "a dict with keys"),
    ],
)
def test_threshold_errors_name_file_host_field_value_allowed(raw: Any, field: str, allowed: str) -> None:
    _, problems = parse_thresholds("inventory/x.py", "gpu-7", raw)
    (p,) = problems
    assert (p.inventory, p.host, p.field) == ("inventory/x.py", "gpu-7", field)
    assert allowed in p.allowed
    assert "inventory/x.py: host gpu-7: " + field in str(p)


def test_durations() -> None:
    assert duration_seconds("1h30m") == 5400
    assert duration_seconds("90s") == 90
    assert duration_seconds("500ms") == 0.5


# ---- names, targets, findings ----------------------------------------------------------------


def test_metric_names_are_v1_names() -> None:
    names = names_for("0.33.0")
    assert names.kv_cache_usage == "vllm:kv_cache_usage_perc"
    assert names.preemptions == "vllm:num_preemptions_total"
    assert all("gpu_cache_usage" not in str(v) for v in vars(names).values())
    with pytest.raises(UnknownVllmVersion, match=r"inv.py: host h9: vllm_version='0.10.2'.*known: 0.33.0"):
        names_for("0.10.2", "h9", "inv.py")
    assert list(TABLE) == ["0.33.0"]


def test_findings_to_textfile_parses_back() -> None:
    findings = parse_findings(
        {
            "hosts": [
                {
                    "host": "a",
                    "findings": [{"severity": "error", "check": "nvlink_down", "gpu": 3, "message": 'x "y"'}],
                },
                {"host": "b", "findings": [{"severity": "warning", "check": "pcie_width", "message": "x8"}]},
            ]
        }
    )
    text = textfile([*findings, findings[0]], 1700000000.0)  # a duplicate is written once
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["fleet_audit_finding"].samples
    assert [(s.labels["host"], s.labels["severity"], s.labels["gpu"]) for s in samples] == [
        ("a", "error", "3"),
        ("b", "warning", ""),
    ]
    assert samples[0].labels["message"] == 'x "y"'
    assert families["fleet_audit_last_run_timestamp_seconds"].samples[0].value == 1700000000.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"findings": [{"host": "a", "check": "x", "severity": "bad"}]}, "findings[0]: severity='bad': one of error"),
        ({"findings": [{"check": "x"}]}, "findings[0]: host=None: a non-empty string"),
        ({"findings": [{"host": "a", "check": "x", "gpu": -1}]}, "gpu=-1: a GPU index"),
        (42, "expected a list of findings"),
    ],
)
def test_bad_findings(data: Any, message: str) -> None:
    with pytest.raises(FindingsError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_findings(data, "audit.json")


def test_rule_groups_split_by_thresholds() -> None:
    t = [Target(h, "g", "m", 0, h, 8000, "0.33.0") for h in ("a", "b", "c")]
    groups = group_hosts(t, {"b": Thresholds(kv_cache_usage=0.4)})
    assert [g.hosts for g in groups] == [("a", "c"), ("b",)]
    rules = rules_file(groups)["groups"]
    kv = [next(r for r in g["rules"] if r["alert"] == "VllmKvCacheHigh") for g in rules]
    assert kv[0]["expr"] == 'vllm:kv_cache_usage_perc{job="fleet-vllm", host=~"a|c"} > 0.9'
    assert kv[1]["expr"] == 'vllm:kv_cache_usage_perc{job="fleet-vllm", host=~"b"} > 0.4'
    for group in rules:
        for rule in group["rules"]:
            assert set(rule["annotations"]) == {"summary", "description", "runbook"}
            assert rule["labels"]["severity"] in ("page", "ticket")


# ---- the CLI and promtool --------------------------------------------------------------------


@needs_promtool
def test_export_cli_writes_a_config_promtool_accepts(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path / "inv.py", b_alerts={"kv_cache_usage": 0.4})
    findings = tmp_path / "audit.json"
    findings.write_text(json.dumps([{"host": "a", "severity": "error", "check": "nvlink_down", "gpu": 3}]))
    out = tmp_path / "prom"
    result = cli("monitor", "export", str(inv), str(out), "--findings", str(findings),
                 "--audit-exporter", "127.0.0.1:9101", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_instance = {t["instance"]: t for t in report["targets"]}
    assert by_instance["a/vllm-0"]["target"] == "10.0.0.1:8000"
    assert by_instance["b/vllm-0"]["target"] == "10.0.0.2:9000"
    assert by_instance["c/vllm-0"]["target"] == "c:8000"
    assert by_instance["c/vllm-0"]["model"] == "mistral" and by_instance["c/vllm-0"]["group"] == "edge"
    (warning,) = report["warnings"]
    assert warning.startswith("host c: vLLM binds 127.0.0.1 (bind_address)")
    sd = json.loads((out / "targets/vllm.json").read_text())
    assert sd[0]["labels"] == {"host": "a", "group": "chat", "model": MISTRAL, "instance": "a/vllm-0",
                               "unit": "fleet-vllm-0.service", "vllm_version": "0.33.0"}  # fmt: skip
    assert PROMTOOL
    check = subprocess.run([PROMTOOL, "check", "config", str(out / "prometheus.yml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout + check.stderr
    rules = subprocess.run([PROMTOOL, "check", "rules", str(out / "rules/fleet-vllm.yml")], capture_output=True,
                           text=True)  # fmt: skip
    assert rules.returncode == 0 and "SUCCESS: 20 rules found" in rules.stdout, rules.stdout + rules.stderr
    metrics = subprocess.run([PROMTOOL, "check", "metrics"], input=(out / "textfile/fleet_audit.prom").read_text(),
                             capture_output=True, text=True)  # fmt: skip
    assert metrics.returncode == 0, metrics.stdout + metrics.stderr


def test_export_cli_rejects_bad_thresholds_before_writing(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path / "inv.py", b_alerts={"kv_cache_usage": 90, "waiting_for": "soon"})
    out = tmp_path / "prom"
    result = cli("monitor", "export", str(inv), str(out), "--json")
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert f"{inv}: host b: alerts.kv_cache_usage=90: a fraction in (0, 1]" in error
    assert f"{inv}: host b: alerts.waiting_for='soon': a Prometheus duration" in error
    assert "Traceback" not in result.stderr
    human = cli("monitor", "export", str(inv), str(out))
    assert human.returncode == 2 and "alerts.kv_cache_usage=90" in human.stderr and "Traceback" not in human.stderr
    assert not out.exists()
    bad = cli("monitor", "export", str(inv), str(out), "--scrape-interval", "often")
    assert bad.returncode == 2 and "--scrape-interval='often'" in bad.stderr


# ---- promtool test rules: every alert fires for the bad instance only -------------------------


def _labels(host: str, group: str = "g") -> dict[str, str]:
    return {"job": "fleet-vllm", "host": host, "group": group, "model": "m", "instance": f"{host}/vllm-0",
            "unit": "fleet-vllm-0.service", "vllm_version": "0.33.0"}  # fmt: skip


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _histogram(name: str, labels: dict[str, str], slow: bool) -> list[dict[str, str]]:
    """10 requests a minute, all in the fast bucket or all in the slow one."""
    out = []
    for le, fast_rate, slow_rate in (("1", 10, 0), ("100", 10, 0), ("200", 10, 10), ("+Inf", 10, 10)):
        rate = slow_rate if slow else fast_rate
        out.append(_series(name + "_bucket", {**labels, "le": le}, f"0+{rate}x40"))
    return out


def _strip(rules: dict[str, Any]) -> dict[str, Any]:
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    return rules


@needs_promtool
def test_promtool_unit_tests_each_alert(tmp_path: Path) -> None:
    th_b = Thresholds(kv_cache_usage=0.4, e2e_p99_seconds=250.0)  # p99 of the slow bucket (100, 200] is 199
    targets = [Target(h, "g", "m", 0, h, 8000, "0.33.0") for h in ("a", "b", "c")]
    files = {f.path: f.content for f in export_files(targets, {"b": th_b}, ExportOptions())}
    rules = yaml.safe_load(files["rules/fleet-vllm.yml"])
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(_strip(rules)))
    group_of = {h: g.name for g in group_hosts(targets, {"b": th_b}) for h in g.hosts}
    assert group_of == {"a": "fleet-vllm-0.33.0-a-and-1-more", "b": "fleet-vllm-0.33.0-b", "c": group_of["a"]}
    a, b, c = _labels("a"), _labels("b"), _labels("c")
    node = {"job": "fleet-node", "host": "a", "group": "g"}
    series = [
        _series("up", a, "0x40"), _series("up", b, "1x40"), _series("up", c, "1x40"),
        _series("vllm:kv_cache_usage_perc", a, "0.95x40"),
        _series("vllm:kv_cache_usage_perc", b, "0.5x40"),  # above b's own threshold 0.4
        _series("vllm:kv_cache_usage_perc", c, "0.5x40"),
        _series("vllm:num_requests_waiting", a, "50x40"), _series("vllm:num_requests_waiting", c, "3x40"),
        _series("vllm:num_preemptions_total", a, "0+5x40"),
        _series("vllm:request_success_total", {**a, "finished_reason": "length"}, "0+10x40"),
        _series("vllm:num_preemptions_total", c, "0+0x40"),
        _series("vllm:request_success_total", {**c, "finished_reason": "stop"}, "0+10x40"),
        *_histogram("vllm:e2e_request_latency_seconds", a, slow=True),
        *_histogram("vllm:e2e_request_latency_seconds", b, slow=True),  # b tolerates 250 s
        *_histogram("vllm:e2e_request_latency_seconds", c, slow=False),
        *_histogram("vllm:time_to_first_token_seconds", a, slow=True),
        *_histogram("vllm:time_to_first_token_seconds", c, slow=False),
        _series("node_systemd_service_restart_total", {**node, "name": "fleet-vllm-0.service"}, "0+1x40"),
        _series("node_systemd_service_restart_total", {**node, "name": "ssh.service"}, "0+5x40"),
        _series("node_systemd_service_restart_total", {**node, "host": "c", "name": "fleet-vllm-0.service"}, "0x40"),
        _series("fleet_audit_finding", {"job": "fleet-audit", "host": "a", "check": "nvlink_down", "severity": "error",
                                        "gpu": "3", "message": "link 2 down"}, "1x40"),
        _series("fleet_audit_finding", {"job": "fleet-audit", "host": "c", "check": "pcie_width",
                                        "severity": "warning", "gpu": "0", "message": "x8"}, "1x40"),
        _series("fleet_gpu_quarantined", {**node, "gpu": "2", "uuid": "GPU-2", "kind": "xid", "xid": "79",
                                          "action": "reboot"}, "1x40"),
        _series("fleet_gpu_quarantined", {**node, "gpu": "0", "uuid": "GPU-0"}, "0x40"),
        _series("fleet_gpu_watch_up", node, "1x40"),
        _series("fleet_gpu_watch_up", {**node, "host": "c"}, "0x40"),
    ]  # fmt: skip
    by = {k: a[k] for k in ("host", "group", "model", "instance")}
    expected = {
        "VllmInstanceDown": [{**a, "severity": "page"}],
        "VllmKvCacheHigh": [{**a, "severity": "ticket"}, {**b, "severity": "ticket"}],
        "VllmRequestsWaiting": [{**a, "severity": "ticket"}],
        "VllmPreemptionsHigh": [{**by, "severity": "ticket"}],
        "VllmE2eLatencyP99High": [{**by, "severity": "ticket"}],
        "VllmTtftP99High": [{**by, "severity": "ticket"}],
        "FleetUnitRestartLoop": [{**node, "name": "fleet-vllm-0.service", "severity": "page"}],
        "FleetGpuAuditFinding": [{"job": "fleet-audit", "host": "a", "check": "nvlink_down", "severity": "error",
                                  "gpu": "3", "message": "link 2 down"}],
        "FleetGpuQuarantined": [{**node, "gpu": "2", "uuid": "GPU-2", "kind": "xid", "xid": "79", "action": "reboot",
                                 "severity": "ticket"}],
        "FleetGpuWatcherDown": [{**node, "host": "c", "severity": "ticket"}],
    }  # fmt: skip
    # FleetGpuAuditFinding's own severity label ("ticket") replaces the series' "error".
    expected["FleetGpuAuditFinding"][0]["severity"] = "ticket"
    for exp in expected.values():
        for labels in exp:
            labels["fleet_rules"] = group_of[labels["host"]]
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} == set(expected)
    tests = {
        "rule_files": [str(tmp_path / "rules.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "35m", "alertname": name, "exp_alerts": [{"exp_labels": labels} for labels in exp]}
                    for name, exp in expected.items()
                ]
                # before its `for:` has passed, an alert is pending, not firing
                + [{"eval_time": "1m", "alertname": "VllmKvCacheHigh", "exp_alerts": []}],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    assert PROMTOOL
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_expands_the_annotations(tmp_path: Path) -> None:
    targets = [Target("a", "g", "m", 0, "a", 8000, "0.33.0")]
    files = {f.path: f.content for f in export_files(targets, {}, ExportOptions())}
    (tmp_path / "rules.yml").write_text(files["rules/fleet-vllm.yml"])
    labels = _labels("a")
    th = Thresholds()
    tests = {
        "rule_files": [str(tmp_path / "rules.yml")],
        "tests": [
            {
                "interval": "1m",
                "input_series": [_series("up", labels, "0x10")],
                "alert_rule_test": [
                    {
                        "eval_time": "5m",
                        "alertname": "VllmInstanceDown",
                        "exp_alerts": [
                            {
                                "exp_labels": {**labels, "severity": "page", "fleet_rules": "fleet-vllm-0.33.0-a"},
                                "exp_annotations": {
                                    "summary": "vLLM instance a/vllm-0 (m) is down",
                                    "description": "Prometheus has not been able to scrape a/vllm-0's /metrics for "
                                    f"{th.instance_down_for}: the unit is stopped or crash-looping, the engine is "
                                    "still loading, or the host is unreachable.",
                                    "runbook": "Run `fleet status INVENTORY --limit a`; on the host `systemctl status "
                                    "fleet-vllm-0.service` and `journalctl -u fleet-vllm-0.service -n 200`. A restart "
                                    "loop or an engine error: `fleet restart INVENTORY --limit a`; a dead host: take "
                                    "it out of the load balancer and open a hardware ticket.",
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    assert PROMTOOL
    result = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "tests.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
