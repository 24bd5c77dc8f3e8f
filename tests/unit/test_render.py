"""Rendered units: the unit rules of the design, checked by systemd's own analyzer."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import HostPlan, plan_host
from fleet.render.units import HostPaths, env_file, render_host, systemd_arg, unit_file, write_tree
from tests.unit.conftest import spec

L70 = "meta-llama/Llama-3.1-70B-Instruct"


@pytest.fixture
def plan() -> HostPlan:
    s = spec(model=L70, api_key_ref="env:KEY", served_model_name="llama 70b $prod 100%", shutdown_timeout=45)
    return plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb"), load_model(L70))


def test_unit_follows_the_restart_protocol(plan: HostPlan) -> None:
    unit = unit_file(plan, plan.instances[1]).content
    assert unit_file(plan, plan.instances[1]).path == "/etc/systemd/system/fleet-vllm-1.service"
    assert "KillMode=mixed" in unit  # SIGTERM to the API server only; workers killed after the drain
    assert "TimeoutStopSec=75" in unit  # longer than --shutdown-timeout 45
    assert "--shutdown-timeout 45" in unit
    assert "Restart=on-failure" in unit and "LimitNOFILE=65535" in unit
    assert "ExecStart=/opt/fleet/vllm/bin/vllm serve meta-llama/Llama-3.1-70B-Instruct" in unit
    assert "EnvironmentFile=/etc/fleet/vllm-1.env" in unit
    assert "Environment=CUDA_VISIBLE_DEVICES=4,5,6,7" in unit
    devices = [line for line in unit.splitlines() if re.fullmatch(r"DeviceAllow=/dev/nvidia\d+ rw", line)]
    assert devices == [f"DeviceAllow=/dev/nvidia{i} rw" for i in (4, 5, 6, 7)]
    assert "DevicePolicy=closed" in unit and "NoNewPrivileges=yes" in unit and "User=vllm" in unit


def test_secrets_only_in_the_root_only_env_file(plan: HostPlan) -> None:
    files = render_host(plan, api_key="s3cr3t-key", api_key_ref="env:KEY")
    units = [f for f in files if f.path.endswith(".service")]
    envs = [f for f in files if f.path.endswith(".env")]
    assert len(units) == len(envs) == len(plan.instances)
    assert all("s3cr3t-key" not in u.content for u in units)
    assert all('VLLM_API_KEY="s3cr3t-key"' in e.content and e.mode == 0o600 for e in envs)
    placeholder = env_file(plan, plan.instances[0], None, "env:KEY").content
    assert "VLLM_API_KEY=" not in placeholder and "env:KEY" in placeholder
    with pytest.raises(ValueError):
        env_file(plan, plan.instances[0], "two\nlines")


@pytest.mark.parametrize(
    "raw, quoted",
    [
        ("plain-arg", "plain-arg"),
        ("has space", '"has space"'),
        ("$HOME", '"$$HOME"'),
        ("100%", "100%%"),
        ('a"b', '"a\\"b"'),
    ],
)
def test_systemd_argument_quoting(raw: str, quoted: str) -> None:
    assert systemd_arg(raw) == quoted


def test_write_tree_creates_secret_files_0600(plan: HostPlan, tmp_path: Path) -> None:
    written = write_tree(tmp_path, render_host(plan, api_key="k"))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert modes["vllm-0.env"] == 0o600 and modes["fleet-vllm-0.service"] == 0o644


needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


@needs_systemd
def test_systemd_analyze_verify_accepts_every_unit(plan: HostPlan, tmp_path: Path) -> None:
    """systemd's own parser: no unknown keys, bad quoting, or missing executables."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    vllm = venv / "bin" / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    paths = HostPaths(venv=str(venv), env_dir=str(tmp_path / "etc"), unit_dir=str(tmp_path / "units"))
    files = render_host(plan, api_key="k", paths=paths)
    for f in files:
        Path(f.path).parent.mkdir(parents=True, exist_ok=True)
        Path(f.path).write_text(f.content)
    units = [f.path for f in files if f.path.endswith(".service")]
    result = subprocess.run(
        ["systemd-analyze", "verify", *units],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    assert result.returncode == 0, result.stderr
    assert "Unknown key" not in result.stderr and "Ignoring" not in result.stderr, result.stderr


@needs_systemd
def test_systemd_analyze_security_rates_the_unit_ok(plan: HostPlan, tmp_path: Path) -> None:
    f = unit_file(plan, plan.instances[0])
    path = tmp_path / Path(f.path).name
    path.write_text(f.content)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=40", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-2000:]
    exposure = float(result.stdout.split("Overall exposure level for")[1].split(":")[1].split()[0])
    assert exposure <= 4.0, result.stdout[-1500:]
