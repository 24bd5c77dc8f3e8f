"""What a host's inventory data asks the deploy for: driver, fabric manager, release, pruning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError
from fleet.operations import host as host_deploy
from fleet.operations.layout import NVML_PY_REQUIREMENT
from fleet.render import part
from fleet.render.units import HostPaths
from fleet.secret_store import SecretError

BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
    "pip_index_url": "http://127.0.0.1:9000/simple/",
}


# The operations take each host's part of the plan (``fleet.render.part``), built from its
# validated data: these build it from (name, data) as the pyinfra CLI's deploy files do.
def driver_settings(name: str, data: dict[str, Any]) -> part.DriverSettings | None:
    return part.driver_settings(part.spec_of(name, data))


def release_spec(name: str, data: dict[str, Any], python_version: str) -> Any:
    return host_deploy.release_spec(part.host_part(part.spec_of(name, data), None, host_deploy.PATHS), python_version)


def releases_kept(name: str, data: dict[str, Any]) -> int:
    return part.host_part(part.spec_of(name, data), None, host_deploy.PATHS).releases_kept


def rendered_files(name: str, data: dict[str, Any], paths: HostPaths) -> list[Any]:
    return list(part.part_of_data(name, data, paths).files)


def api_key(name: str, data: dict[str, Any]) -> str | None:
    return part.api_key(part.spec_of(name, data))


def test_no_mirror_means_the_driver_is_not_managed() -> None:
    assert driver_settings("gpu-1", BASE) is None


def test_driver_defaults_to_the_vllm_release_driver_and_nvswitch_gets_fabric_manager(tmp_path: Path) -> None:
    key = tmp_path / "k.gpg"
    key.write_bytes(b"k")
    data = {**BASE, "nvidia_apt_url": "http://mirror.internal/cuda/repos", "nvidia_apt_keyring": str(key)}
    sxm = driver_settings("gpu-1", {**data, "gpu": {"sku": "h100-sxm-80gb", "count": 8, "nvlink": "switch"}})
    assert sxm is not None and sxm.version == "580.95.05" and sxm.fabric_manager
    pcie = driver_settings("gpu-1", {**data, "gpu": {"sku": "l40s-48gb", "count": 4}})
    assert pcie is not None and not pcie.fabric_manager
    forced = driver_settings(
        "gpu-1", {**data, "nvidia_fabric_manager": False, "gpu": {"sku": "h100-sxm-80gb", "count": 8}}
    )
    assert forced is not None and not forced.fabric_manager
    typical = driver_settings("gpu-1", {**data, "gpu": {"sku": "h100-sxm-80gb", "count": 8}})
    assert typical is not None and typical.fabric_manager  # the SKU's typical fabric is NVSwitch


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"nvidia_apt_keyring": "/nonexistent/key.gpg"}, "nvidia_apt_keyring='/nonexistent/key.gpg': no such file"),
        ({"nvidia_driver_version": "570.172.08"}, "needs driver branch 580"),
        ({"nvidia_apt_url": "ftp://x y"}, "nvidia_apt_url='ftp://x y': an http:// or https:// URL"),
    ],
)
def test_bad_driver_data_names_host_key_and_value(tmp_path: Path, extra: dict[str, Any], message: str) -> None:
    key = tmp_path / "k.gpg"
    key.write_bytes(b"k")
    data = {**BASE, "nvidia_apt_url": "http://m/", "nvidia_apt_keyring": str(key), **extra}
    with pytest.raises(FleetError) as err:  # the inventory's validation (fleet.inventory.schema)
        driver_settings("gpu-7", data)
    assert "host gpu-7" in str(err.value) and message in str(err.value)


def test_release_spec_and_its_checks() -> None:
    spec = release_spec("gpu-1", BASE, "3.11.2")
    assert spec.requirements() == ["vllm==0.33.0", NVML_PY_REQUIREMENT]
    with pytest.raises(part.HostDataError, match="pip_index_url is not set"):
        release_spec("gpu-1", {k: v for k, v in BASE.items() if k != "pip_index_url"}, "3.11.2")
    with pytest.raises(FleetError, match="vllm_extras"):
        release_spec("gpu-1", {**BASE, "vllm_extras": ["a; rm -rf /"]}, "3.11.2")
    audio = release_spec("gpu-1", {**BASE, "vllm_extras": ["audio", "video"]}, "3.11.2")
    assert audio.requirements()[0] == "vllm[audio,video]==0.33.0"


@pytest.mark.parametrize(("value", "kept"), [(None, 3), (2, 2), (100, 100)])
def test_releases_kept(value: Any, kept: int) -> None:
    data = BASE if value is None else {**BASE, "releases_kept": value}
    assert releases_kept("gpu-1", data) == kept


@pytest.mark.parametrize("value", [1, 0, "x", "5", True, 101, 2.0])
def test_releases_kept_refuses(value: Any) -> None:
    with pytest.raises(FleetError, match="releases_kept"):
        releases_kept("gpu-1", {**BASE, "releases_kept": value})


def test_rendered_files_come_from_the_plan_with_root_only_env_files() -> None:
    files = rendered_files("gpu-1", {**BASE, "gpu": {"sku": "rtx-4090-24gb", "count": 2}}, HostPaths())
    units = [f for f in files if f.path.endswith(".service")]
    envs = [f for f in files if f.path.endswith(".env")]
    assert units and len(units) == len(envs)
    assert all(f.mode == 0o600 for f in envs) and all(f.mode == 0o644 for f in units)


def test_an_api_key_ref_that_cannot_be_read_is_an_error_not_an_open_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_TEST_DEPLOY_KEY", raising=False)
    data = {**BASE, "api_key_ref": "env:FLEET_TEST_DEPLOY_KEY"}
    with pytest.raises(SecretError, match="gpu-1: api_key_ref env:FLEET_TEST_DEPLOY_KEY: the environment variable"):
        api_key("gpu-1", data)
    monkeypatch.setenv("FLEET_TEST_DEPLOY_KEY", "k-" + "x" * 30)
    assert api_key("gpu-1", data) == "k-" + "x" * 30
    key = tmp_path / "key"
    key.write_text("secret-value-that-is-long-enough\n")
    key.chmod(0o644)
    with pytest.raises(SecretError, match="readable by others") as err:
        api_key("gpu-1", {**BASE, "api_key_ref": f"file:{key}"})
    assert "secret-value" not in str(err.value)
    assert api_key("gpu-1", BASE) is None  # no reference: the inventory asks for an open API


def test_a_hosts_part_carries_its_rendered_files_but_never_shows_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "k-" + "s" * 30
    monkeypatch.setenv("FLEET_TEST_PART_KEY", key)
    data = {**BASE, "gpu": {"sku": "rtx-4090-24gb", "count": 2}, "api_key_ref": "env:FLEET_TEST_PART_KEY"}
    p = part.host_part(part.spec_of("gpu-1", data), part.host_plan(part.spec_of("gpu-1", data)), host_deploy.PATHS)
    assert any(key in f.content for f in p.files)  # the env files the deploy writes carry it
    assert p.unit_names == [r.unit.path.rsplit("/", 1)[1] for r in p.revisions] and p.unit_names
    assert key not in repr(p) and key not in str(p)
    assert p.plan is not None and not p.from_probe  # planned from the gpu entry: its units are not enabled yet
