"""The lab's signed apt repository on a bare lab host: the stand-in NVIDIA driver installs from
it with signature checking on (a repository signed by another key is refused), is pinned and
held, asks for a reboot, and NVML answers only after the host restarts; then ``fleet audit`` of
the host, which has a driver and a python3 but nothing of fleet's (no release, no nvidia-ml-py),
reads its GPUs through the pynvml the probe carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.facts.nvml import NvmlProbe, carried_pynvml, probe_command
from fleetlab.apt_repo import DRIVER_VERSIONS, ensure_key

from .conftest import LabFleet
from .deploying import REPO_ROOT, host_run, pyinfra, restart

pytestmark = pytest.mark.lab

OLD, NEW = DRIVER_VERSIONS
NVIDIA = ("nvidia-driver", "libnvidia-ml1", "nvidia-kernel-open-dkms", "nvidia-fabricmanager-580")


def _packages(lab: LabFleet) -> dict[str, str]:
    _rc, out, _err = host_run(lab, "dpkg-query -W -f='${Package} ${Version} ${Status}\\n'")
    rows = [line.split(" ", 2) for line in out.splitlines()]
    return {r[0]: f"{r[1]} {r[2]}" for r in rows if r[0] in NVIDIA and r[2].endswith(" installed")}


def _nvml(lab: LabFleet) -> dict[str, object]:
    """What the host's NVML answers through fleet's probe (the unmodified pynvml it carries)."""
    rc, out, err = host_run(lab, probe_command())
    assert rc == 0, err
    facts = NvmlProbe().process(out.splitlines())
    assert facts.pynvml == carried_pynvml().origin, facts
    if not facts.ok:
        return {"error": facts.status}
    return {"count": len(facts.gpus), "driver": facts.driver_version, "name": facts.gpus[0].name}


def test_a_bare_host_has_no_driver(bare_lab: LabFleet) -> None:
    rc, _out, err = host_run(bare_lab, "python3 -c 'import ctypes; ctypes.CDLL(\"libnvidia-ml.so.1\")'")
    assert rc != 0 and "libnvidia-ml.so.1" in err
    assert host_run(bare_lab, "test -e /proc/driver/nvidia/version")[0] != 0
    assert _packages(bare_lab) == {}


def test_a_repository_signed_by_another_key_is_refused(bare_lab: LabFleet, tmp_path: Path) -> None:
    _fpr, wrong = ensure_key(tmp_path / "other-key")
    run = pyinfra(bare_lab, "nvidia_driver.py", f"nvidia_apt_keyring={wrong}", f"nvidia_driver_version={OLD}")
    assert run.returncode != 0, run.output
    assert "NO_PUBKEY" in run.output or "not signed" in run.output, run.output
    assert _packages(bare_lab) == {}


def test_driver_installs_pinned_and_held_then_needs_a_reboot(bare_lab: LabFleet) -> None:
    # OLD is not the newest in the repository: only the pin makes apt take it.
    run = pyinfra(bare_lab, "nvidia_driver.py", f"nvidia_driver_version={OLD}")
    assert run.returncode == 0 and run.changed, run.output
    assert _packages(bare_lab) == {p: f"{OLD}-1 hold ok installed" for p in NVIDIA}
    assert "reboot required (nvidia-kernel-open-dkms)" in run.output
    _rc, pkgs, _err = host_run(bare_lab, "cat /var/run/reboot-required.pkgs")
    assert pkgs.split() == ["nvidia-kernel-open-dkms"]
    assert _nvml(bare_lab) == {"error": "driver-not-loaded"}
    again = pyinfra(bare_lab, "nvidia_driver.py", f"nvidia_driver_version={OLD}")
    assert again.unchanged, again.output


def test_after_a_restart_nvml_answers_and_the_fabric_manager_runs(bare_lab: LabFleet) -> None:
    restart(bare_lab)
    assert _nvml(bare_lab) == {"count": 8, "driver": OLD, "name": "NVIDIA H100 80GB HBM3"}
    assert host_run(bare_lab, "test -e /var/run/reboot-required")[0] != 0
    _rc, out, _err = host_run(bare_lab, "systemctl is-active nvidia-fabricmanager.service")
    assert out.strip() == "active"


def test_fleet_audit_of_a_host_with_a_driver_and_nothing_of_fleet(bare_lab: LabFleet) -> None:
    """Auditing a new machine before trusting it: the driver from the repository, no fleet deploy."""
    assert host_run(bare_lab, "python3 -c 'import pynvml'")[0] != 0  # no nvidia-ml-py on the host
    assert host_run(bare_lab, "test -e /opt/fleet")[0] != 0  # nor any release of fleet's
    run = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "audit", str(bare_lab.opts.inventory), "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (host,) = json.loads(run.stdout)["hosts"]
    assert host["reachable"] and host["status"] == "ok", host
    assert host["python"] == "/usr/bin/python3" and host["pynvml"] == carried_pynvml().origin, host
    assert [g["name"] for g in host["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 8
    assert host["driver_version"] == host["kernel_module_version"] == OLD
    assert [g["active_nvlinks"] for g in host["gpus"]] == [18] * 8 and host["topology"] == "8xNV18", host
    assert host["findings"] == [], host["findings"]


def test_a_driver_upgrade_reports_reboot_and_takes_effect_after_it(bare_lab: LabFleet) -> None:
    run = pyinfra(bare_lab, "nvidia_driver.py")  # the default driver for vLLM 0.33: NEW
    assert run.returncode == 0 and run.changed, run.output
    assert _packages(bare_lab) == {p: f"{NEW}-1 hold ok installed" for p in NVIDIA}
    assert host_run(bare_lab, "test -e /var/run/reboot-required")[0] == 0
    _rc, loaded, _err = host_run(bare_lab, "cat /proc/driver/nvidia/version")
    assert OLD in loaded  # still the old module until the restart
    restart(bare_lab)
    assert _nvml(bare_lab)["driver"] == NEW
