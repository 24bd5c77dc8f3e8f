"""NVIDIA's apt layout and the facts the operations read, from recorded host output."""

from __future__ import annotations

import pytest

from fleet.facts.driver import NvidiaKernelModule, PythonVersion
from fleet.facts.packages import DebPackageStates, RebootRequired
from fleet.facts.releases import VllmReleases
from fleet.operations import layout
from fleet.operations.layout import Distro


@pytest.mark.parametrize(
    ("os_release", "arch", "path"),
    [
        ({"ID": "ubuntu", "VERSION_ID": "22.04"}, "x86_64", "ubuntu2204/x86_64"),
        ({"ID": "ubuntu", "VERSION_ID": "24.04"}, "aarch64", "ubuntu2404/sbsa"),
        ({"ID": "debian", "VERSION_ID": "12"}, "amd64", "debian12/x86_64"),
    ],
)
def test_repository_path_per_distribution(os_release: dict[str, str], arch: str, path: str) -> None:
    assert layout.repo_path(layout.distro_of(os_release), arch) == path


def test_unsupported_distribution_and_bad_mirror_are_named() -> None:
    with pytest.raises(layout.LayoutError, match=r"ubuntu 20\.04 is not supported"):
        layout.distro_of({"ID": "ubuntu", "VERSION_ID": "20.04"})
    with pytest.raises(layout.LayoutError, match="not an http"):
        layout.repo_url("mirror.example; rm -rf /", Distro("debian", "12"), "x86_64")
    assert (
        layout.repo_url("http://m/cuda/repos/", Distro("debian", "12"), "x86_64")
        == "http://m/cuda/repos/debian12/x86_64/"
    )


def test_package_names_per_distribution() -> None:
    assert layout.driver_packages(Distro("debian", "12"), "580.95.05") == (
        "nvidia-driver", "libnvidia-ml1", "nvidia-kernel-open-dkms",
    )  # fmt: skip
    assert layout.driver_packages(Distro("ubuntu", "22.04"), "580.95.05") == (
        "nvidia-driver-580-open", "libnvidia-compute-580", "nvidia-dkms-580-open",
    )  # fmt: skip
    assert layout.fabric_manager_package("580.95.05") == "nvidia-fabricmanager-580"


@pytest.mark.parametrize(
    ("deb", "upstream"),
    [("580.95.05-1", "580.95.05"), ("1:580.95.05-0ubuntu1", "580.95.05"), ("580.95.05", "580.95.05"), ("", "")],
)
def test_upstream_version(deb: str, upstream: str) -> None:
    assert layout.upstream_version(deb) == upstream


def test_driver_version_is_checked_against_the_vllm_release() -> None:
    assert layout.check_driver_version("580.95.05", "0.33.0") == "580.95.05"
    with pytest.raises(layout.LayoutError, match="needs driver branch 580"):
        layout.check_driver_version("570.172.08", "0.33.0")
    with pytest.raises(layout.LayoutError, match="not a driver version"):
        layout.check_driver_version("latest", "0.33.0")


# -- facts from recorded output ---------------------------------------------------------------


def test_dpkg_states_read_hold_and_skip_removed_packages() -> None:
    out = [
        "nvidia-driver\t580.95.05-1\thold ok installed",
        "libnvidia-ml1\t580.95.05-1\tinstall ok installed",
        "nvidia-kernel-open-dkms\t580.82.07-1\tdeinstall ok config-files",
        "garbage line",
    ]
    assert DebPackageStates().process(out) == {
        "nvidia-driver": {"version": "580.95.05-1", "held": True},
        "libnvidia-ml1": {"version": "580.95.05-1", "held": False},
    }


def test_reboot_required() -> None:
    assert RebootRequired().process([]) is None
    assert RebootRequired().process(["reboot-required", "nvidia-kernel-open-dkms", "linux-image", ""]) == [
        "linux-image",
        "nvidia-kernel-open-dkms",
    ]


@pytest.mark.parametrize(
    ("line", "version"),
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024", "550.54.15"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs@x)", "580.95.05"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.82.07  Release Build", "580.82.07"),
        ("something else", None),
    ],
)
def test_kernel_module_version(line: str, version: str | None) -> None:
    assert NvidiaKernelModule().process([line, "GCC version:  gcc version 12.2.0"]) == version


def test_python_version_and_releases() -> None:
    assert PythonVersion().process(["3.11.2"]) == "3.11.2"
    assert PythonVersion().process(["Traceback"]) is None
    out = ["release 200 1 b", "release 100 0 a", "current releases/b", "previous "]
    assert VllmReleases().process(out) == {
        "releases": [{"name": "a", "mtime": 100, "complete": False}, {"name": "b", "mtime": 200, "complete": True}],
        "current": "b",
        "previous": None,
    }


def test_the_python_version_is_what_the_interpreter_says_of_itself() -> None:
    """Without its site module, user site and PYTHON* variables (``-E -s -S``), the interpreter
    still says its own version: the same as ``python -c`` with all of them."""
    import subprocess
    import sys

    command = PythonVersion().command(python=sys.executable)
    assert "-E -s -S" in command
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    plain = [sys.executable, "-c", 'import sys; print("%d.%d.%d" % sys.version_info[:3])']
    assert (
        PythonVersion().process(out.splitlines())
        == subprocess.run(plain, capture_output=True, text=True).stdout.strip()
    )
    assert PythonVersion().process(out.splitlines()) == ".".join(str(n) for n in sys.version_info[:3])
    missing = PythonVersion().command(python="/nonexistent/python3")
    gone = subprocess.run(["sh", "-c", missing], capture_output=True, text=True, check=True).stdout
    assert PythonVersion().process(gone.splitlines()) is None
