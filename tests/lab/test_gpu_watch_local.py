"""The GPU watcher program against the simulated NVML, on this machine (no lab host, no root).

The program is the exact file a deploy installs (``fleet.gpuwatch.program.watcher_program``),
run with ``python -I`` like its unit, by this venv's Python and by Python 3.6 where pyenv has it;
the real, unmodified pynvml it carries talks to the lab's ``libnvidia-ml.so.1``; faults are
injected through the library's event file (``fleetlab.nvml.faults``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleet.gpuwatch.program import TOO_OLD_EXIT, watcher_program
from fleet.gpuwatch.watcher import CLEARS, RECORD, TEXTFILE
from fleetlab.nvml import build_shim
from fleetlab.nvml.faults import inject
from fleetlab.profiles import load_profile
from tests.lab.polling import wait_for

PY36 = Path.home() / ".pyenv/versions/3.6.15/bin/python"
PY27 = Path.home() / ".pyenv/versions/2.7.18/bin/python"
PYTHONS = [pytest.param(sys.executable, id="venv")]
if PY36.exists():
    PYTHONS.append(pytest.param(str(PY36), id="python3.6"))


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim")).parent


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("program") / "fleet-gpu-watch.py"
    path.write_text(watcher_program())
    return path


@dataclass
class Host:
    """One simulated host on this machine: NVML profile, NVML state dir, the watcher's dirs."""

    root: Path
    shim_dir: Path
    program: Path

    @property
    def profile(self) -> Path:
        return self.root / "nvml-profile"

    @property
    def nvml_state(self) -> Path:
        return self.root / "nvml-state"

    @property
    def state_dir(self) -> Path:
        return self.root / "gpu-watch"

    @property
    def textfile_dir(self) -> Path:
        return self.root / "textfile"

    @property
    def machine_id(self) -> Path:
        return self.root / "machine-id"

    def record(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.state_dir / RECORD).read_text())
        except (OSError, ValueError):
            return {}
        return data

    def textfile(self) -> str:
        try:
            return (self.textfile_dir / TEXTFILE).read_text()
        except OSError:
            return ""

    def events(self, uuid: str) -> list[dict[str, Any]]:
        return list(self.record().get("gpus", {}).get(uuid, {}).get("events", []))

    def start(self, python: str = sys.executable) -> subprocess.Popen[str]:
        env = {
            "PATH": os.environ["PATH"],
            "LD_LIBRARY_PATH": str(self.shim_dir),
            "FLEET_NVML_PROFILE": str(self.profile),
            "FLEET_NVML_STATE_DIR": str(self.nvml_state),
        }
        argv = [python, "-I", str(self.program), "--state-dir", str(self.state_dir),
                "--textfile-dir", str(self.textfile_dir), "--machine-id-file", str(self.machine_id),
                "--wait-ms", "200"]  # fmt: skip
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def make_host(tmp_path: Path, shim_dir: Path, program: Path, profile: str = "h100-sxm-8") -> Host:
    host = Host(tmp_path, shim_dir, program)
    host.nvml_state.mkdir()
    host.textfile_dir.mkdir()
    host.machine_id.write_text("0123456789abcdef0123456789abcdef\n")
    host.profile.write_text(load_profile(profile).render())
    return host


@pytest.fixture
def host(tmp_path: Path, shim_dir: Path, program: Path) -> Host:
    return make_host(tmp_path, shim_dir, program)


@pytest.fixture
def running() -> Iterator[list[subprocess.Popen[str]]]:
    """Watchers started by a test, always stopped (SIGTERM, then SIGKILL)."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    return proc.returncode, err


def uuid_of(profile: str, index: int) -> str:
    return load_profile(profile).enumerated[index].uuid


def metric_lines(host: Host) -> set[str]:
    return {line for line in host.textfile().splitlines() if not line.startswith("#")}


def watching(host: Host) -> bool:
    return "fleet_gpu_watch_up 1" in metric_lines(host)


@pytest.mark.parametrize("python", PYTHONS)
def test_an_xid_is_recorded_exported_quarantined_and_cleared(
    host: Host, running: list[subprocess.Popen[str]], python: str
) -> None:
    proc = host.start(python)
    running.append(proc)
    assert wait_for(lambda: watching(host), timeout=30), proc.stderr
    record = host.record()
    gpu2 = uuid_of("h100-sxm-8", 2)
    assert sorted(g["index"] for g in record["gpus"].values()) == list(range(8))
    assert {g["source"] for g in record["gpus"].values()} == {"nvml"}
    assert record["machine_id"] == "0123456789abcdef0123456789abcdef"
    assert f'fleet_gpu_quarantined{{gpu="2",uuid="{gpu2}"}} 0' in host.textfile()

    inject(host.nvml_state, 2, "xid", 79)
    assert wait_for(lambda: len(host.events(gpu2)) == 1, timeout=15)
    (event,) = host.events(gpu2)
    assert (event["kind"], event["xid"], event["action"], event["source"]) == ("xid", 79, "reboot", "nvml")
    assert "GPU has fallen off the bus" in event["meaning"]
    assert all(not g["events"] for u, g in host.record()["gpus"].items() if u != gpu2)
    assert wait_for(lambda: 'action="reboot"' in host.textfile(), timeout=10)
    text = host.textfile()
    assert f'fleet_gpu_quarantined{{gpu="2",uuid="{gpu2}",kind="xid",xid="79",action="reboot"}} 1' in text
    assert f'fleet_gpu_events_total{{gpu="2",uuid="{gpu2}",kind="xid",xid="79",action="reboot"}} 1' in text
    assert f'fleet_gpu_quarantined{{gpu="3",uuid="{uuid_of("h100-sxm-8", 3)}"}} 0' in text

    # an application error and a corrected ECC error: recorded, not critical
    inject(host.nvml_state, 2, "xid", 31)
    inject(host.nvml_state, 2, "sbe")
    assert wait_for(lambda: len(host.events(gpu2)) == 3, timeout=15)
    assert [e["action"] for e in host.events(gpu2)] == ["reboot", "app", "info"]

    # fleet gpu clear writes clears.json: the watcher reads it and the quarantine lifts
    record = host.record()
    clears = {"schema": 1, "gpus": {gpu2: [{"record_id": record["record_id"], "through_seq": record["seq"],
                                            "at": 1.0, "by": "ops@ctl", "why": "reseated"}]}}  # fmt: skip
    (host.state_dir / CLEARS).write_text(json.dumps(clears))
    assert wait_for(lambda: f'fleet_gpu_quarantined{{gpu="2",uuid="{gpu2}"}} 0' in host.textfile(), timeout=10)

    # a double-bit ECC error afterwards quarantines it again
    inject(host.nvml_state, 2, "dbe")
    assert wait_for(lambda: 'kind="dbe",xid="",action="reset"} 1' in host.textfile(), timeout=15)

    code, err = stop(proc)
    assert code == 0, err
    assert "GPU 2" in err and "XID 79" in err  # the journal says what happened


def test_the_watcher_survives_a_driver_reload(host: Host, running: list[subprocess.Popen[str]]) -> None:
    proc = host.start()
    running.append(proc)
    assert wait_for(lambda: watching(host), timeout=30)
    text = host.profile.read_text()
    host.profile.unlink()  # the driver is unloaded
    assert wait_for(lambda: "fleet_gpu_watch_up 0" in metric_lines(host), timeout=15)
    problems = host.record()["problems"]
    assert problems and "NVMLError_Unknown" in problems[-1]["what"]
    # while there is no driver, it tries again and again, backing off
    assert wait_for(lambda: "DriverNotLoaded" in str(host.record()["problems"]), timeout=15)
    assert "fleet_gpu_watch_up 0" in metric_lines(host)
    tmp = host.profile.with_suffix(".new")
    tmp.write_text(text)
    tmp.rename(host.profile)  # ... and loaded again
    assert wait_for(lambda: watching(host), timeout=30)
    inject(host.nvml_state, 5, "xid", 48)
    gpu5 = uuid_of("h100-sxm-8", 5)
    assert wait_for(lambda: len(host.events(gpu5)) == 1, timeout=15)
    assert host.events(gpu5)[0]["action"] == "reset"
    code, err = stop(proc)
    assert code == 0 and "NVML session lost" in err


def test_a_host_without_nvml_events_is_watched_through_the_kernel_log(
    tmp_path: Path, shim_dir: Path, program: Path, running: list[subprocess.Popen[str]]
) -> None:
    """Where NVML offers no XID events the GPU's source is the kernel log (the journal reader
    itself is exercised on a lab host, whose /dev/kmsg is its own: tests/lab/test_gpu_watch_lab.py)."""
    text = load_profile("a10-1").path.read_text().replace("[driver]", "[host]\nnvml_events = false\n\n[driver]", 1)
    custom = tmp_path / "a10-noevents.toml"
    custom.write_text(text)
    root = tmp_path / "h"
    root.mkdir()
    h = make_host(root, shim_dir, program, str(custom))
    proc = h.start()
    running.append(proc)
    assert wait_for(lambda: watching(h), timeout=30)
    (gpu,) = h.record()["gpus"].values()
    assert gpu["source"] == "kernel-log"
    assert 'source="kernel-log"} 1' in h.textfile()
    code, _ = stop(proc)
    assert code == 0


def test_a_corrupt_record_or_one_from_another_machine_is_moved_aside(
    host: Host, running: list[subprocess.Popen[str]]
) -> None:
    host.state_dir.mkdir()
    (host.state_dir / RECORD).write_text("{not json")
    proc = host.start()
    running.append(proc)
    assert wait_for(lambda: watching(host), timeout=30)
    code, err = stop(proc)
    assert code == 0
    aside = sorted(p.name for p in host.state_dir.iterdir() if p.name.startswith(RECORD + ".corrupt-"))
    assert len(aside) == 1 and "is not a watcher record (not JSON" in err
    first_id = host.record()["record_id"]

    host.machine_id.write_text("ffffffffffffffffffffffffffffffff\n")  # the disk went into another machine
    proc = host.start()
    running.append(proc)
    assert wait_for(lambda: host.record().get("machine_id") == "ffffffffffffffffffffffffffffffff", timeout=30)
    code, err = stop(proc)
    assert code == 0 and "was written on another machine" in err
    assert (host.state_dir / f"{RECORD}.from-0123456789abcdef0123456789abcdef").exists()
    assert host.record()["record_id"] != first_id


@pytest.mark.skipif(not PY27.exists(), reason="no Python 2.7 under pyenv")
def test_a_python_too_old_exits_ex_config(host: Host) -> None:
    done = subprocess.run([str(PY27), str(host.program)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == TOO_OLD_EXIT
    assert "needs 3.6 or newer" in done.stdout
