"""``fleet status`` on a lab fleet that ``fleet deploy`` took from bare hosts to serving: the HTTP
side (health, model, metrics) and the SSH side (systemd unit state and uptime, the release, GPU
memory through the lab's NVML) in one view; a stopped unit and a host whose sshd is down are rows
that say so, and the exit status is then non-zero.

The tests run in order on one deployed fleet (each later one breaks a little more).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleetlab import lab as lab_ops
from fleetlab import ssh
from tests.terminal import Terminal, table_rows

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def run_on(lab: LabFleet, index: int, command: str, timeout: float = 120) -> tuple[int, str, str]:
    h = lab.state.hosts[index]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def place_model_config(lab: LabFleet, index: int) -> None:
    """The model's config where vLLM's Hugging Face cache finds it (model download is not fleet's yet)."""
    rc, _out, err = run_on(
        lab,
        index,
        f"sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group vllm "
        f"&& sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee {HUB}/refs/main "
        f"&& echo {base64.b64encode(CONFIG.read_bytes()).decode()} | base64 -d "
        f"| sudo -u vllm tee {HUB}/snapshots/main/config.json >/dev/null",
    )
    assert rc == 0, err


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    """Two lab hosts (2x RTX 4090 each) deployed with ``fleet deploy``; taken down pass or fail."""
    require_lab()
    root = tmp_path_factory.mktemp("status-lab")
    octet = free_octet(os.getpid() + 29, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"ps{os.getpid()}", octet, 2, ("rtx4090-2", "rtx4090-2")))
    try:
        lab = LabFleet(opts, bring_up(opts))
        for i in range(2):
            place_model_config(lab, i)
        proc = subprocess.run(
            [str(FLEET), "deploy", str(opts.inventory), "--json", "--health-timeout", "180"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def fleet_status(lab: LabFleet, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [str(FLEET), "status", str(lab.opts.inventory), "--json", "--interval", "1", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (rc {proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}") from None
    return proc.returncode, data


def rows_of(data: dict[str, Any], host: str) -> list[dict[str, Any]]:
    return [r for r in data["instances"] if r["host"] == host]


def test_every_instance_is_active_with_uptime_release_model_health_and_gpu_memory(served: LabFleet) -> None:
    rc, data = fleet_status(served)
    rows = data["instances"]
    assert len(rows) == 4, rows  # two instances (one per GPU) on each host
    assert {r["host"] for r in rows} == {h.name for h in served.state.hosts}
    for r in rows:
        unit = r["unit"]
        assert r["health"] == "ready", r
        assert r["model"] == MODEL and r["vllm_version"].startswith("0.33.0"), r  # the stand-in: 0.33.0+fleetlab.1
        assert unit["state"] == "active/running", r
        assert unit["uptime_seconds"] is not None and 0 < unit["uptime_seconds"] < 3600, unit
        assert unit["restarts"] == 0 and unit["main_pid"], unit
        assert unit["release"] and unit["release"].startswith("vllm-0.33.0-"), unit
        assert unit["venv"] == f"/opt/fleet/vllm/releases/{unit['release']}", unit
        assert unit["installed_vllm_version"] == "0.33.0", unit  # the release marker's pin
        assert unit["gpu_memory_used_bytes"] > 2**30, unit  # the stand-in holds weights + KV cache
        assert r["problems"] == [], r
    # each instance is charged its own GPU's memory, not the host's total
    a, b = rows_of(data, served.state.hosts[0].name)
    assert a["unit"]["main_pid"] != b["unit"]["main_pid"]
    # what each host's cache holds: the model placed there, its bytes as the host's find counts them
    assert [h["host"] for h in data["hosts"]] == [h.name for h in served.state.hosts], data["hosts"]
    for i, h in enumerate(data["hosts"]):
        rc_find, out, err = run_on(served, i, f"sudo find {HUB} -type f -printf '%s\\n'")
        assert rc_find == 0, err
        assert h["models_error"] is None, h
        assert h["models"] == [
            {"model": MODEL, "bytes": sum(int(x) for x in out.split()), "snapshot": "main", "staging": False}
        ], h
    assert rc == 0, data


def screen_of(lab: LabFleet, tmp_path: Path, columns: int, *args: str) -> str:
    """``fleet status`` in a real terminal ``columns`` wide: what is on the screen when it exits."""
    with Terminal(tmp_path, columns, 50) as term:
        term.start([str(FLEET), "status", str(lab.opts.inventory), "--interval", "1", *args], os.environ, REPO_ROOT)
        _rc, screen = term.wait_exit(timeout=120)
    assert "Traceback" not in screen and all(len(line) <= columns for line in screen.splitlines()), screen
    return screen


def test_the_screen_at_80_columns_and_wide_at_200(served: LabFleet, tmp_path: Path) -> None:
    hosts = [h.name for h in served.state.hosts]
    screen = screen_of(served, tmp_path, 80)
    rows = table_rows(screen)
    assert [(r["host"], r["inst"], r["state"], r["model"]) for r in rows] == [
        (h, str(i), "ready", MODEL.partition("/")[2]) for h in hosts for i in (0, 1)
    ], screen
    assert all(r["run/wait"] == "0/0" for r in rows), screen  # nobody is sending requests
    assert "release" not in screen and "GiB" not in screen, screen  # those are --wide's
    # under the table: both hosts hold the same, so one line names them both
    flat = " ".join(screen.split())
    assert f"{hosts[0]}, {hosts[1]} hold {MODEL}@main (" in flat, screen
    screen = screen_of(served, tmp_path, 200, "--wide")
    rows = table_rows(screen)
    assert [(r["host"], r["inst"], r["state"]) for r in rows] == [(h, str(i), "ready") for h in hosts for i in (0, 1)]
    for r in rows:
        assert r["unit"].startswith("active/running ") and r["restarts"] == "0", screen
        assert r["release"].startswith("vllm-0.33.0-") and r["GPU mem"].endswith(" GiB"), screen
        assert r["vLLM"].startswith("0.33.0") and r["KV"].endswith("%"), screen
    assert screen.count("host ") == 1, screen  # one table: every column fits in 200
    flat = " ".join(screen.split())
    assert all(f"{h} holds {MODEL}@main (" in flat for h in hosts), screen  # --wide: a line per host


def test_watch_refreshes_with_the_ssh_side_until_ctrl_c(served: LabFleet) -> None:
    import threading

    env = {**os.environ, "COLUMNS": "250", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [str(FLEET), "status", str(served.opts.inventory), "--watch", "--wide", "--interval", "1"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read(256), "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        # the first view and at least one refresh (however long a busy machine makes them), then Ctrl-C
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "Ctrl-C to stop" not in "".join(chunks) and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(10)
        out, err = "".join(chunks), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert "Ctrl-C to stop" in out  # refreshed at least once
    assert out.count("active/running") >= 4 and "GiB" in out and "vllm-0.33.0-" in out, out[-3000:]


def test_a_stopped_unit_is_inactive_and_the_exit_status_says_so(served: LabFleet, tmp_path: Path) -> None:
    rc, _out, err = run_on(served, 0, "sudo systemctl stop fleet-vllm-1.service")
    assert rc == 0, err
    rc, data = fleet_status(served)
    assert rc == 1, data
    host0 = served.state.hosts[0].name
    stopped = next(r for r in data["instances"] if r["instance"] == f"{host0}/vllm-1")
    assert stopped["unit"]["state"] == "inactive/dead" and stopped["unit"]["uptime_seconds"] is None, stopped
    assert stopped["unit"]["gpu_memory_used_bytes"] == 0, stopped  # KillMode reaped everything
    assert stopped["health"] == "not listening" and not stopped["ok"]
    assert any("fleet-vllm-1.service is inactive/dead" in p for p in stopped["problems"]), stopped
    others = [r for r in data["instances"] if r is not stopped]
    assert all(r["ok"] and r["unit"]["state"] == "active/running" for r in others), others
    assert stopped["state"] == "stopped" and {r["state"] for r in others} == {"ready"}
    screen = screen_of(served, tmp_path, 80)
    states = {(r["host"], r["inst"]): r["state"] for r in table_rows(screen)}
    assert states[(host0, "1")] == "stopped" and states[(host0, "0")] == "ready", screen
    assert f"{host0}/vllm-1: connection refused" in " ".join(screen.split()), screen


def test_a_host_without_sshd_is_a_row_that_says_unreachable(served: LabFleet) -> None:
    host1 = served.state.hosts[1].name
    # The command's own session survives sshd's stop (it lives in its own scope).
    rc, _out, err = run_on(served, 1, "sudo systemctl stop ssh.socket ssh.service; true")
    assert rc == 0, err
    rc, data = fleet_status(served)
    assert rc == 1, data
    for r in rows_of(data, host1):
        assert r["unit"]["state"] == "unreachable", r
        assert r["unit"]["detail"].startswith("unreachable: "), r  # why, in one line (fleet.facts.sshlink)
        assert r["unit"]["detail"].endswith("refused the connection (no sshd listening)"), r
        assert any("unreachable over SSH" in p for p in r["problems"]), r
        assert r["health"] == "ready"  # vLLM still serves; only the SSH side is gone
    host0_rows = rows_of(data, served.state.hosts[0].name)
    assert {r["unit"]["state"] for r in host0_rows} == {"active/running", "inactive/dead"}
    # its cache could not be listed: said so, and the other host's is still read
    held = {h["host"]: h for h in data["hosts"]}
    assert held[host1]["models"] == [] and held[host1]["models_error"].startswith("host unreachable over SSH"), held
    assert [m["model"] for m in held[served.state.hosts[0].name]["models"]] == [MODEL], held
