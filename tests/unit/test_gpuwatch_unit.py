"""The GPU watcher's unit and program as the deploy writes them (``fleet.render.gpuwatch``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fleet.deploy.prefetch import gpu_watcher_facts
from fleet.errors import RenderError
from fleet.gpuwatch.program import PROGRAM_PATH, watcher_program
from fleet.render.gpuwatch import UNIT_NAME, WatchSettings, watch_files, watch_unit


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / UNIT_NAME
    unit.write_text(watch_unit().content)
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "Unknown key" not in done.stderr and "Ignoring" not in done.stderr, done.stderr


def test_the_unit_runs_the_program_and_stays_out_of_the_engines_way() -> None:
    d = directives(watch_unit(WatchSettings(cpu_quota_percent=7, memory_max_mib=64)).content)
    assert d["ExecStart"] == [
        f"/usr/bin/python3 -I {PROGRAM_PATH} --state-dir=/var/lib/fleet/gpu-watch"
        " --textfile-dir=/var/lib/prometheus/node-exporter"
    ]
    assert d["Nice"] == ["19"] and d["IOSchedulingClass"] == ["idle"]
    assert d["CPUQuota"] == ["7%"] and d["MemoryMax"] == ["64M"]
    assert d["PrivateNetwork"] == ["yes"] and d["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert d["CapabilityBoundingSet"] == [""] and d["ProtectSystem"] == ["strict"]
    assert d["ReadWritePaths"] == ["/var/lib/fleet/gpu-watch", "-/var/lib/prometheus/node-exporter"]
    assert d["RestartPreventExitStatus"] == ["78"]


@pytest.mark.parametrize(
    "settings",
    [
        {"state_dir": "/var/lib/x y"},
        {"textfile_dir": "relative"},
        {"state_dir": "/var/lib/$HOME"},
        {"cpu_quota_percent": 0},
        {"memory_max_mib": 8},
    ],
)
def test_bad_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises((RenderError, ValueError)):
        WatchSettings(**settings)  # type: ignore[arg-type]


def test_the_program_and_unit_are_the_files() -> None:
    program, unit = watch_files()
    assert (program.path, program.mode, program.content) == (PROGRAM_PATH, 0o644, watcher_program())
    assert unit.path == f"/etc/systemd/system/{UNIT_NAME}"


def test_the_deploy_prefetches_what_the_watcher_operation_reads() -> None:
    asked = {(r.fact.__name__, tuple(sorted((k, str(v)) for k, v in r.kwargs.items()))) for r in gpu_watcher_facts()}
    for f in watch_files():
        assert ("Sha1File", (("path", f.path),)) in asked and ("File", (("path", f.path),)) in asked
    assert ("SystemdStatus", (("services", str([UNIT_NAME])),)) in asked
