"""The NVIDIA repository and driver operations against recorded facts: a first run yields the
commands, a run on a host already in the end state yields none."""

from __future__ import annotations

import base64
import hashlib
import shlex
from pathlib import Path

import pytest
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.server import Arch, LinuxDistribution
from pyinfra.facts.systemd import SystemdEnabled

from fleet.facts.driver import NvidiaKernelModule
from fleet.facts.packages import DebPackageStates, RebootRequired
from fleet.operations import layout, nvidia

from .opharness import Value, key, run_op, written

DEBIAN12 = Value({"name": "Debian", "major": 12, "release_meta": {"ID": "debian", "VERSION_ID": "12"}})
UBUNTU2404 = Value({"name": "Ubuntu", "major": 24, "release_meta": {"ID": "ubuntu", "VERSION_ID": "24.04"}})
V = "580.95.05"
DEBIAN_PKGS = ["nvidia-driver", "libnvidia-ml1", "nvidia-kernel-open-dkms"]


def _sha(text: str | bytes, path: str) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [f"{hashlib.sha1(data).hexdigest()}  {path}"]


def _file(mode: str = "-rw-r--r--") -> list[str]:
    return [f"user=root group=root mode={mode} atime=1700000000 mtime=1700000000 ctime=1700000000 size=10 '/x'"]


def _dpkg(*rows: tuple[str, str, str]) -> list[str]:
    return [f"{name}\t{version}\t{status}" for name, version, status in rows]


def _prefs(packages: list[str]) -> str:
    return layout.apt_preferences(packages, V)


def driver_facts(distro: Value, packages: list[str], dpkg: list[str], module: list[str] | None = None,
                 prefs_written: bool = False, enabled: dict[str, bool] | None = None) -> dict:  # fmt: skip
    facts: dict = {
        key(LinuxDistribution): distro,
        key(Sha1File, path=nvidia.PREFERENCES_PATH): _sha(_prefs(packages), nvidia.PREFERENCES_PATH)
        if prefs_written
        else [],
        key(File, path=nvidia.PREFERENCES_PATH): _file(),
        key(DebPackageStates): dpkg,
        key(NvidiaKernelModule): module or [],
        key(SystemdEnabled, services=[nvidia.FABRIC_MANAGER_UNIT]): Value(enabled or {}),
    }
    return facts


def test_bare_debian_host_installs_pins_holds_and_notes_the_reboot() -> None:
    run = run_op(nvidia.driver, driver_facts(DEBIAN12, DEBIAN_PKGS, []), version=V)
    texts = run.texts
    assert shlex.split(texts[0])[3:] == ["fleet-write", "/etc/apt/preferences.d", "fleet-nvidia", "root:root", "644"]
    assert base64.b64decode(run.commands[0].stdin or "").decode() == _prefs(DEBIAN_PKGS)
    assert "Pin: version 580.95.05-*\nPin-Priority: 1001" in _prefs(DEBIAN_PKGS)
    assert texts[1] == (
        "apt-get update -o Dir::Etc::SourceList=/etc/apt/sources.list.d/fleet-nvidia.sources "
        "-o Dir::Etc::SourceParts=- -o APT::Get::List-Cleanup=0"
    )
    assert shlex.split(texts[2])[-3:] == DEBIAN_PKGS
    assert "--allow-change-held-packages" in texts[2] and "DEBIAN_FRONTEND=noninteractive" in texts[2]
    assert shlex.split(texts[3])[-1] == "nvidia-kernel-open-dkms" and "/var/run/reboot-required" in texts[3]
    assert texts[4] == "apt-mark hold nvidia-driver libnvidia-ml1 nvidia-kernel-open-dkms"
    assert len(texts) == 5


def test_second_run_on_the_installed_and_held_driver_changes_nothing() -> None:
    dpkg = _dpkg(*[(p, f"{V}-1", "hold ok installed") for p in DEBIAN_PKGS], ("bash", "5.2-1", "install ok installed"))
    run = run_op(nvidia.driver, driver_facts(DEBIAN12, DEBIAN_PKGS, dpkg, prefs_written=True), version=V)
    assert run.texts == []
    assert any("installed and held" in n for n in run.noops)


def test_installed_but_not_held_is_only_held() -> None:
    dpkg = _dpkg(*[(p, f"{V}-1", "install ok installed") for p in DEBIAN_PKGS])
    run = run_op(nvidia.driver, driver_facts(DEBIAN12, DEBIAN_PKGS, dpkg, prefs_written=True), version=V)
    assert run.texts == ["apt-mark hold nvidia-driver libnvidia-ml1 nvidia-kernel-open-dkms"]


def test_another_driver_version_is_replaced_and_needs_a_reboot() -> None:
    dpkg = _dpkg(*[(p, "580.82.07-1", "hold ok installed") for p in DEBIAN_PKGS])
    run = run_op(nvidia.driver, driver_facts(DEBIAN12, DEBIAN_PKGS, dpkg, prefs_written=True), version=V)
    assert [t.split()[0] for t in run.texts] == ["apt-get", "env", "sh", "apt-mark"]
    assert "reboot-required" in run.texts[2]


def test_a_driver_loaded_from_outside_apt_is_left_alone() -> None:
    module = ["NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)"]
    run = run_op(nvidia.driver, driver_facts(DEBIAN12, DEBIAN_PKGS, [], module, prefs_written=True), version=V)
    assert run.texts == []
    assert "not installed from packages" in run.noops[-1]


def test_ubuntu_names_and_fabric_manager_on_nvswitch_hosts() -> None:
    pkgs = ["nvidia-driver-580-open", "libnvidia-compute-580", "nvidia-dkms-580-open", "nvidia-fabricmanager-580"]
    run = run_op(nvidia.driver, driver_facts(UBUNTU2404, pkgs, []), version=V, fabric_manager=True)
    assert shlex.split(run.texts[2])[-4:] == pkgs
    assert shlex.split(run.texts[3])[-1] == "nvidia-dkms-580-open"
    assert run.texts[-1] == "systemctl enable nvidia-fabricmanager.service"
    installed = _dpkg(*[(p, f"{V}-0ubuntu1", "hold ok installed") for p in pkgs])
    facts = driver_facts(
        UBUNTU2404, pkgs, installed, prefs_written=True, enabled={"nvidia-fabricmanager.service": True}
    )
    assert run_op(nvidia.driver, facts, version=V, fabric_manager=True).texts == []


def test_unsupported_distribution_is_an_error_naming_it() -> None:
    rhel = Value({"release_meta": {"ID": "rhel", "VERSION_ID": "9.4"}})
    with pytest.raises(layout.LayoutError, match=r"rhel 9\.4 is not supported"):
        run_op(nvidia.driver, driver_facts(rhel, [], []), version=V)


def test_repository_writes_keyring_and_deb822_source_once(tmp_path: Path) -> None:
    keyring = tmp_path / "key.gpg"
    keyring.write_bytes(b"\x99\x00binary key")
    source = layout.deb822_source("http://127.0.0.1:8080/apt/debian12/x86_64/", nvidia.KEYRING_PATH)
    fresh = {
        key(LinuxDistribution): DEBIAN12,
        key(Arch): Value("x86_64"),
        key(Sha1File, path=nvidia.KEYRING_PATH): [],
        key(Sha1File, path=nvidia.SOURCES_PATH): [],
        key(File, path=nvidia.KEYRING_PATH): [],
        key(File, path=nvidia.SOURCES_PATH): [],
    }
    run = run_op(nvidia.repository, fresh, mirror="http://127.0.0.1:8080/apt", keyring=str(keyring))
    assert len(run.commands) == 1  # both files, the keyring first (before: a write, a read, a write)
    assert written(run.commands[0]) == {
        nvidia.KEYRING_PATH: (keyring.read_bytes(), "root:root", "644"),
        nvidia.SOURCES_PATH: (source.encode(), "root:root", "644"),
    }
    assert run.late_reads == []
    assert source == (
        "Types: deb\nURIs: http://127.0.0.1:8080/apt/debian12/x86_64/\nSuites: /\n"
        "Signed-By: /etc/apt/keyrings/fleet-nvidia.gpg\n"
    )
    done = {
        **fresh,
        key(Sha1File, path=nvidia.KEYRING_PATH): _sha(keyring.read_bytes(), nvidia.KEYRING_PATH),
        key(Sha1File, path=nvidia.SOURCES_PATH): _sha(source, nvidia.SOURCES_PATH),
        key(File, path=nvidia.KEYRING_PATH): _file(),
        key(File, path=nvidia.SOURCES_PATH): _file(),
    }
    assert run_op(nvidia.repository, done, mirror="http://127.0.0.1:8080/apt", keyring=str(keyring)).texts == []


def test_reboot_required_is_reported_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    facts = {key(RebootRequired): ["reboot-required", "nvidia-kernel-open-dkms"]}
    run = run_op(nvidia.reboot_required, facts)
    assert run.texts == [] and run.noops == ["reboot required by nvidia-kernel-open-dkms"]
    assert "gpu-1: reboot required (nvidia-kernel-open-dkms)" in caplog.text
    assert run_op(nvidia.reboot_required, {key(RebootRequired): []}).noops == ["no reboot required"]
