"""CUDA on a host (issue 23 part 6, issue 24 point 3): the inventory keys, the plan's cuda-compat
decision (table), the units' environment, the apt operation, the audit's way out and gate."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

import pytest
from pyinfra.facts.server import Arch, LinuxDistribution

from fleet.audit.gate import DEPLOY, ROLLOUT, gate
from fleet.audit.rules import audit_host
from fleet.errors import FleetError, PlanError
from fleet.facts.packages import DebPackageStates
from fleet.gpus import CATALOGUE, HostGpus
from fleet.model.arch import load_model
from fleet.operations import nvidia
from fleet.plan.cuda import compat_lib_dir, decide_compat, ld_library_path, plan_cuda
from fleet.plan.planner import plan_host
from fleet.render import part
from fleet.render.units import render_host
from tests.unit.conftest import spec
from tests.unit.test_audit_rules import V, facts

from .opharness import Value, key, run_op

H100 = "NVIDIA H100 80GB HBM3"


# ---- the decision, a table ------------------------------------------------------------------------

# (policy, driver the deploy installs, repository, host's CUDA, forward compatible) -> compat or refusal
DECIDE: list[tuple[str, str | None, bool, int | None, bool | None, str | None, str]] = [
    # the deploy installs a new enough driver: never compat, whatever the host runs now
    ("auto", "580.95.05", True, 12040, True, None, "the deploy installs driver 580.95.05"),
    # the host keeps its driver
    ("auto", None, True, 13000, True, None, "the driver runs CUDA 13.0"),
    ("auto", None, True, 13010, False, None, "the driver runs CUDA 13.1"),
    ("auto", None, True, None, True, None, "decided once NVML answers"),
    ("auto", None, True, 12040, True, "13.0", "cuda-compat-13-0: the host's driver runs CUDA 12.4"),
    ("auto", None, True, 12080, False, "refused", "not a data-centre GPU"),
    ("auto", None, True, 12080, None, "refused", "not in fleet's GPU catalogue"),
    ("auto", None, False, 12080, True, "refused", "comes from NVIDIA's apt repository"),
    ("never", None, True, 12040, True, "refused", "cuda_compat is never"),
    ("never", None, True, 13000, True, None, "not needed"),
]  # fmt: skip


@pytest.mark.parametrize(("policy", "installs", "repo", "cuda", "dc", "compat", "why"), DECIDE)
def test_decide_compat(
    policy: str, installs: str | None, repo: bool, cuda: int | None, dc: bool | None, compat: str | None, why: str
) -> None:
    args = ("gpu-1", policy, "0.33.0", installs, repo, cuda, H100, dc)
    if compat == "refused":
        with pytest.raises(PlanError) as err:
            decide_compat(*args)
        text = str(err.value)
        assert "host gpu-1" in text and why in text and "ways out" in text
        assert "upgrade the driver to branch 580 or newer (CUDA 13.0)" in text or "nvidia_driver_version: keep" in text
        return
    got, reason = decide_compat(*args)
    assert got == compat and why in reason


def test_unknown_vllm_series_plans_no_compat() -> None:
    assert decide_compat("h", "auto", "0.9.0", None, True, 12040, H100, True) == (
        None,
        "cuda-compat: fleet knows no CUDA for vLLM 0.9.0; not planned",
    )


def test_ld_library_path_puts_the_compat_dir_first_once() -> None:
    d = compat_lib_dir("13.0")
    assert d == "/usr/local/cuda-13.0/compat"
    assert ld_library_path(d) == d
    assert ld_library_path(d, f"/opt/x::{d}:/usr/lib") == f"{d}:/opt/x:/usr/lib"


@pytest.mark.parametrize(
    ("sku", "ok"),
    [("h100-sxm-80gb", True), ("h200-sxm-141gb", True), ("a100-sxm-80gb", True), ("l40s-48gb", True),
     ("rtx-4090-24gb", False), ("rtx-a6000-48gb", False)],
)  # fmt: skip
def test_forward_compatible_is_data_centre_boards_only(sku: str, ok: bool) -> None:
    assert CATALOGUE[sku].forward_compatible is ok


# ---- through the plan ------------------------------------------------------------------------------


def _keyring(tmp_path: Path) -> str:
    k = tmp_path / "k.gpg"
    k.write_bytes(b"k")
    return str(k)


def _probed(sku: str, cuda: int | None) -> HostGpus:
    g = HostGpus.from_catalogue(sku, 1)
    return dataclasses.replace(g, source="probe", cuda_driver_version=cuda)


def _keep(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {
        "nvidia_apt_url": "http://127.0.0.1:9/cuda",
        "nvidia_apt_keyring": _keyring(tmp_path),
        "nvidia_driver_version": "keep",
        **more,
    }


def test_plan_with_a_kept_old_driver_on_an_h100_installs_compat_and_sets_the_path(tmp_path: Path) -> None:
    s = spec("gpu-1", **_keep(tmp_path, cuda_toolkit="12.9"))
    plan = plan_host(s, _probed("h100-sxm-80gb", 12080), load_model(s.model))
    assert plan.cuda.compat == "13.0" and plan.cuda.toolkit == "12.9"
    assert plan.cuda.packages == ("cuda-toolkit-12-9", "cuda-compat-13-0")
    assert any("cuda-compat-13-0: the host's driver runs CUDA 12.8" in n for n in plan.notes)
    env = dict(plan.instances[0].env)
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda-13.0/compat"
    assert env["CUDA_HOME"] == "/usr/local/cuda-12.9"
    unit = next(f for f in render_host(plan) if f.path.endswith(".service"))
    assert "Environment=LD_LIBRARY_PATH=/usr/local/cuda-13.0/compat\n" in unit.content
    settings = part.driver_settings(s, plan)
    assert settings is not None and settings.version is None  # the driver is left alone
    assert settings.cuda_packages == ("cuda-toolkit-12-9", "cuda-compat-13-0")


def test_plan_with_a_kept_old_driver_on_a_geforce_is_refused_with_the_upgrade(tmp_path: Path) -> None:
    s = spec("gpu-2", **_keep(tmp_path))
    with pytest.raises(PlanError) as err:
        plan_host(s, _probed("rtx-4090-24gb", 12080), load_model(s.model))
    text = str(err.value)
    assert "host gpu-2" in text and "NVIDIA GeForce RTX 4090 is not a data-centre GPU" in text
    way = "(let fleet install it: remove nvidia_driver_version: keep)"
    assert f"upgrade the driver to branch 580 or newer (CUDA 13.0) {way}" in text


def test_a_managed_driver_plans_no_compat_and_no_note(tmp_path: Path) -> None:
    s = spec("gpu-1", nvidia_apt_url="http://127.0.0.1:9/cuda", nvidia_apt_keyring=_keyring(tmp_path))
    plan = plan_host(s, _probed("h100-sxm-80gb", 12080), load_model(s.model))
    assert plan.cuda.compat is None and "LD_LIBRARY_PATH" not in dict(plan.instances[0].env)
    assert not any("cuda-compat" in n for n in plan.notes)
    settings = part.driver_settings(s, plan)
    assert settings is not None and settings.version == "580.95.05" and settings.cuda_packages == ()


def test_offline_plan_from_the_gpu_entry_decides_nothing_yet(tmp_path: Path) -> None:
    s = spec("gpu-1", **_keep(tmp_path), gpu={"sku": "h100-sxm-80gb", "count": 1})
    assert plan_cuda(s, s.gpu.host_gpus()).compat is None  # type: ignore[union-attr]


# ---- bad input: the one validator ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"cuda_toolkit": 12.9}, "cuda_toolkit"),
        ({"cuda_toolkit": "12"}, "a CUDA version MAJOR.MINOR"),
        ({"cuda_toolkit": "9.2"}, "a CUDA version MAJOR.MINOR"),
        ({"cuda_toolkit": "12.9; rm -rf /"}, "a CUDA version MAJOR.MINOR"),
        ({"cuda_compat": "sometimes"}, "cuda_compat"),
        ({"cuda_compat": True}, "cuda_compat"),
        ({"nvidia_driver_version": "kept"}, "or keep (leave the host's)"),
        ({"cuda_toolkit": "12.9"}, "cuda-toolkit-12-9 comes from NVIDIA's apt repository: set nvidia_apt_url"),
        ({"nvidia_driver_version": "keep"}, "only read with nvidia_apt_url"),
    ],
)
def test_bad_cuda_keys_name_host_field_value_and_way_out(data: dict[str, Any], message: str) -> None:
    with pytest.raises(FleetError) as err:
        spec("gpu-7", **data)
    text = str(err.value)
    assert "gpu-7" in text and message in text
    field = next(iter(data))
    assert field in text


# ---- the apt operation -----------------------------------------------------------------------------


def _facts(dpkg: list[str]) -> dict[Any, Any]:
    return {
        key(LinuxDistribution): Value(
            {"name": "Debian", "major": 12, "release_meta": {"ID": "debian", "VERSION_ID": "12"}}
        ),
        key(Arch): Value("x86_64"),
        key(DebPackageStates): dpkg,
    }  # fmt: skip


def test_cuda_packages_installs_what_is_missing_from_our_source_only() -> None:
    have = ["cuda-toolkit-12-9\t12.9.1-1\tinstall ok installed"]
    run = run_op(nvidia.cuda_packages, _facts(have), packages=["cuda-toolkit-12-9", "cuda-compat-13-0"])
    assert run.texts[0] == shlex.join(nvidia.APT_UPDATE_OURS)
    assert shlex.split(run.texts[1])[-1] == "cuda-compat-13-0" and "cuda-toolkit-12-9" not in run.texts[1]
    assert len(run.texts) == 2


def test_cuda_packages_second_run_changes_nothing() -> None:
    have = ["cuda-toolkit-12-9\t12.9.1-1\tinstall ok installed", "cuda-compat-13-0\t580.95.05-1\tinstall ok installed"]
    run = run_op(nvidia.cuda_packages, _facts(have), packages=["cuda-toolkit-12-9", "cuda-compat-13-0"])
    assert run.texts == []


# ---- the audit: the way out and the gate -----------------------------------------------------------


def _old(d: dict[str, Any]) -> None:
    d["cuda_driver_version"] = 12040


def test_cuda_driver_too_old_names_cuda_compat_on_data_centre_gpus() -> None:
    (f,) = [x for x in audit_host("h", facts("h100-sxm-8", _old), V) if x.rule == "cuda-driver-too-old"]
    assert "upgrade the driver to branch 580 or newer (CUDA 13.0)" in f.way_out
    assert "install cuda-compat-13-0" in f.way_out and "nvidia_driver_version: keep" in f.way_out


def test_cuda_driver_too_old_on_a_geforce_says_compat_does_not_apply() -> None:
    (f,) = [x for x in audit_host("h", facts("rtx4090-2", _old), V) if x.rule == "cuda-driver-too-old"]
    assert "cuda-compat does not apply: NVIDIA GeForce RTX 4090 is not a data-centre GPU" in f.way_out
    assert "install cuda-compat" not in f.way_out


def test_installed_compat_libs_make_the_finding_informational() -> None:
    def change(d: dict[str, Any]) -> None:
        _old(d)
        d["cuda_compat"] = ["12.9", "13.0"]

    got = {(x.rule, x.severity.label) for x in audit_host("h", facts("h100-sxm-8", change), V)}
    assert got == {("cuda-compat-in-use", "info")}

    # the wrong CUDA's compat libs bridge nothing
    def wrong(d: dict[str, Any]) -> None:
        _old(d)
        d["cuda_compat"] = ["12.9"]

    assert ("cuda-driver-too-old", "critical") in {
        (x.rule, x.severity.label) for x in audit_host("h", facts("h100-sxm-8", wrong), V)
    }


def test_probe_output_cuda_compat_is_checked() -> None:
    from fleet.facts.hostfacts import ProbeOutputError

    with pytest.raises(ProbeOutputError, match="cuda_compat"):
        facts("h100-sxm-8", lambda d: d.update(cuda_compat=["13.0; x"]))
    assert facts("h100-sxm-8", lambda d: d.update(cuda_compat=["13.0"])).cuda_compat == ("13.0",)


def test_gate_exempts_cuda_driver_too_old_only_for_a_deploy_that_installs_compat() -> None:
    found = [x for x in audit_host("gpu-1", facts("h100-sxm-8", _old), V) if x.rule == "cuda-driver-too-old"]
    assert gate(found, DEPLOY, compat={"gpu-1"}).ok
    assert not gate(found, DEPLOY).ok  # no compat planned: the driver must be upgraded first
    assert not gate(found, ROLLOUT, compat={"gpu-1"}).ok  # a rollout installs nothing
