"""`fleet plan` as an operator runs it: the installed console script, exit codes, --json, --render."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fleet.cli import main

REPO = Path(__file__).resolve().parents[2]
FLEET = [sys.executable, "-m", "fleet.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run([*FLEET, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)


def test_plan_prod_inventory_table() -> None:
    result = run("plan", "inventory/prod.py")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "gpu-h100-01" in out and "--max-model-len" in out and "KV tokens" in out and "host(s) planned" in out


def test_plan_json_has_argv_and_memory_math() -> None:
    result = run("plan", "inventory/prod.py", "--limit", "edge-a10-01", "--json")
    assert result.returncode == 0, result.stderr
    (host,) = json.loads(result.stdout)["hosts"]
    assert host["ok"] and host["host"] == "edge-a10-01"
    inst = host["instances"][0]
    assert inst["argv"][:3] == ["/opt/fleet/vllm/bin/vllm", "serve", "mistralai/Mistral-7B-Instruct-v0.3"]
    assert inst["memory"]["kv_tokens"] > 0 and inst["memory"]["max_concurrency"] > 1
    assert {f["option"] for f in inst["flags"]} >= {"--max-model-len", "--gpu-memory-utilization"}
    assert all(f["reason"] for f in inst["flags"])


def test_exit_1_when_a_host_has_no_plan(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0, "target_concurrency": 4}
    a10 = {"sku": "a10-24gb"}
    inv.write_text(
        f"ok = [('small', {{'model': 'meta-llama/Llama-3.1-8B-Instruct', 'workload': {wl}, 'gpu': {a10}}})]\n"
        f"bad = [('tiny', {{'model': 'meta-llama/Llama-3.1-70B-Instruct', 'workload': {wl}, 'gpu': {a10}}})]\n"
    )
    result = run("plan", str(inv), "--json")
    assert result.returncode == 1
    hosts = {h["host"]: h for h in json.loads(result.stdout)["hosts"]}
    assert hosts["small"]["ok"] and not hosts["tiny"]["ok"]
    assert hosts["tiny"]["error"]["ways_out"]
    human = run("plan", str(inv))
    assert human.returncode == 1 and "1 of 2 host(s) have no valid plan" in human.stdout


def test_exit_2_on_invalid_inventory(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    inv.write_text("h = [('h1', {'model': 'm/x', 'workload': {}, 'port': 'eighty'})]\n")
    result = run("plan", str(inv))
    assert result.returncode == 2
    assert f"{inv}: host h1: port='eighty'" in result.stderr


def test_render_writes_units_and_private_env_files(tmp_path: Path) -> None:
    result = run("plan", "inventory/prod.py", "--limit", "gpu-l40s-01", "--render", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / "gpu-l40s-01"
    units = sorted((root / "etc/systemd/system").glob("fleet-vllm-*.service"))
    envs = sorted((root / "etc/fleet").glob("vllm-*.env"))
    assert len(units) == len(envs) == 4
    assert all(stat.S_IMODE(e.stat().st_mode) == 0o600 for e in envs)
    assert "VLLM_API_KEY=" not in "".join(u.read_text() for u in units)


def test_invalid_input_json_lists_every_problem_redacted(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    inv.write_text("h = [('h1', {'model': 'm/x', 'workload': {}, 'api_key': 'hf_abcdefghijklmnopqrst'})]\n")
    result = run("plan", str(inv), "--json")
    assert result.returncode == 2 and result.stderr == ""
    body = json.loads(result.stdout)
    assert body["exit_code"] == 2
    fields = {p["field"]: p for p in body["problems"]}
    assert fields["api_key"]["value"] == "<redacted>" and "workload.prefix_reuse" in fields
    assert "hf_abcdefghijklmnopqrst" not in result.stdout


def test_usage_errors_exit_2() -> None:
    assert run("plan").returncode == 2
    assert run("plan", "inventory/prod.py", "--no-such-option").returncode == 2


def _explode(*args: object, **kwargs: object) -> None:
    raise RuntimeError("planner blew up holding hf_abcdefghijklmnopqrst")


def test_internal_error_is_one_line_and_exit_3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fleet.plan.outcomes.plan_fleet", _explode)
    result = CliRunner().invoke(main, ["plan", "inventory/prod.py"])
    assert result.exit_code == 3
    (line,) = result.stderr.strip().splitlines()
    assert "internal error (RuntimeError)" in line and "this is a bug" in line and "--debug" in line
    assert "Traceback" not in result.output and "hf_abc" not in result.output


def test_debug_prints_the_traceback_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fleet.plan.outcomes.plan_fleet", _explode)
    result = CliRunner().invoke(main, ["--debug", "plan", "inventory/prod.py"])
    assert result.exit_code == 3
    assert CliRunner().invoke(main, ["plan", "inventory/prod.py", "--debug"]).stderr == result.stderr
    assert "Traceback" in result.stderr and "_explode" in result.stderr
    assert "hf_abcdefghijklmnopqrst" not in result.stderr and "<redacted>" in result.stderr


def test_render_never_writes_outside_dir(tmp_path: Path) -> None:
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0, "target_concurrency": 4}
    data = {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": wl, "gpu": {"sku": "a10-24gb"}}
    inv.write_text(f"g = [('../escape', {data}), ('/tmp/fleet-escape-test', {data}), ('ok', {data})]\n")
    out = tmp_path / "render"
    result = run("plan", str(inv), "--render", str(out))
    assert result.returncode == 2 and "'../escape'" in result.stderr
    assert not (tmp_path / "escape").exists() and not Path("/tmp/fleet-escape-test").exists()
    assert not out.exists() or not any(out.rglob("*"))


def test_an_unreadable_model_config_is_invalid_input(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0, "target_concurrency": 4}
    data = {"model": "x/y", "model_config": str(bad), "workload": wl, "gpu": {"sku": "a10-24gb"}}
    inv.write_text(f"g = [('h1', {data})]\n")
    result = run("plan", str(inv), "--render", str(tmp_path / "out"))
    assert result.returncode == 2 and str(bad) in result.stderr
    assert not (tmp_path / "out").exists()
