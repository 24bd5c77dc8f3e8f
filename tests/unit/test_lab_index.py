"""The lab package index's pure parts: which wheel satisfies a pin for the hosts' Python, the
``pip download`` target options, where the stand-in's source comes from, and where ``fleet lab
up`` writes its inventory by default."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from fleetlab import index
from fleetlab.inventory_writer import default_inventory
from fleetlab.state import LabDir


@pytest.mark.parametrize(
    ("filename", "requirement", "python", "ok"),
    [
        ("prometheus_client-0.26.0-py3-none-any.whl", "prometheus_client==0.26.0", (3, 11), True),
        ("prometheus_client-0.26.0-py3-none-any.whl", "prometheus-client==0.26.0", (3, 12), True),
        ("prometheus_client-0.25.0-py3-none-any.whl", "prometheus_client==0.26.0", (3, 11), False),
        ("setproctitle-1.3.8-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64.whl", "setproctitle==1.3.8",
         (3, 11), True),
        ("setproctitle-1.3.8-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.whl", "setproctitle==1.3.8",
         (3, 11), False),
        ("nvidia_ml_py-13.615.71-py3-none-any.whl", "nvidia-ml-py==13.615.71", (3, 11), True),
        ("not-a-wheel.whl", "nvidia-ml-py==13.615.71", (3, 11), False),
    ],
)  # fmt: skip
def test_wheel_matches(filename: str, requirement: str, python: tuple[int, int], ok: bool) -> None:
    assert index._wheel_matches(Path(filename), requirement, python) is ok


def test_target_args_name_the_hosts_python_and_this_architecture() -> None:
    args = index._target_args((3, 11))
    pairs = list(zip(args[::2], args[1::2], strict=True))
    assert ("--python-version", "3.11") in pairs and ("--abi", "cp311") in pairs
    assert ("--platform", f"manylinux2014_{platform.machine()}") in pairs and ("--platform", "any") in pairs


def test_deploy_requirements_are_pinned_and_cover_the_standins_dependencies() -> None:
    names = {index.normalize(r.partition("==")[0]) for r in index.DEPLOY_REQUIREMENTS}
    assert all("==" in r for r in index.DEPLOY_REQUIREMENTS)
    standin = (index.STANDIN_DIR / "pyproject.toml").read_text()
    for dep in ("nvidia-ml-py", "prometheus-client", "setproctitle"):
        assert dep in names
        assert dep.replace("-", "_") in standin.replace("-", "_")


def test_standin_source_is_found_in_a_checkout_and_hashes_stably() -> None:
    assert (index.STANDIN_DIR / "pyproject.toml").is_file()
    assert index.standin_source_hash() == index.standin_source_hash()


def test_default_inventory_is_in_the_labs_state_dir(tmp_path: Path) -> None:
    path = default_inventory(LabDir("lab", tmp_path / "state"))
    assert path == (tmp_path / "state" / "lab" / "inventory.py").absolute() and path.is_absolute()
