"""CUDA on a lab host (issue 23 part 6, issue 24 point 3): a data-centre GPU whose driver (570,
CUDA 12.8) is older than vLLM 0.33's CUDA 13.0, kept as it is (``nvidia_driver_version: keep``).

``fleet deploy`` installs ``cuda-compat-13-0`` and the ``cuda-toolkit-12-9`` the inventory asks for
from the lab's signed apt repository (stand-ins that put their files where NVIDIA's do), renders
the units with the compat libraries first on ``LD_LIBRARY_PATH``, and the lab's vLLM stand-in,
which refuses a CUDA driver older than its build's as torch does, serves through them. The audit's
critical ``cuda-driver-too-old`` does not refuse that deploy (the deploy fixes it); with
``cuda_compat: never`` it is refused before anything is written. A second deploy changes nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetlab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT, host_run
from .test_deploy_probe_lab import deploy
from .test_fleet_deploy_lab import seed_model_cache

pytestmark = pytest.mark.lab

PROFILE = "h100-sxm-1-passthrough-driver-570"
COMPAT = "/usr/local/cuda-13.0/compat"
CUDA_PACKAGES = "dpkg-query -W -f='${Package} ${Status}\\n' 'cuda-*' 'nvidia-driver' 2>/dev/null | grep ' installed$'"


@pytest.fixture(scope="module")
def old_driver_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("cuda-lab")
    octet = free_octet(os.getpid() + 47, avoid=frozenset({TEST_OCTET}))
    opts = test_lab_options(root, f"pc{os.getpid()}", octet, 1, (PROFILE,))
    try:
        lab = LabFleet(opts, bring_up(opts))
        rc, _out, err = host_run(lab, seed_model_cache())
        assert rc == 0, err
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def inventory(lab: LabFleet, name: str, **data: object) -> Path:
    """A copy of the lab's inventory with ``data`` added to every host."""
    assert lab.opts.inventory is not None
    path = lab.opts.inventory.with_name(f"{name}.py")
    path.write_text(lab.opts.inventory.read_text() + f"for _name, _data in lab:\n    _data.update({data!r})\n")
    return path


def test_cuda_compat_never_refuses_the_host_before_touching_it(old_driver_lab: LabFleet) -> None:
    path = inventory(old_driver_lab, "never", nvidia_driver_version="keep", cuda_compat="never")
    rc, result = deploy(path)
    assert rc == 1 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "refused", host
    text = json.dumps(host)
    assert "CUDA 12.8, older than vLLM 0.33.0's CUDA 13.0" in text and "cuda_compat is never" in text, text
    assert "upgrade the driver to branch 580 or newer" in text, text
    assert host_run(old_driver_lab, CUDA_PACKAGES)[1] == ""
    assert host_run(old_driver_lab, "test -e /etc/apt/sources.list.d/fleet-nvidia.sources")[0] != 0


def test_deploy_installs_cuda_compat_and_serves_through_it_then_changes_nothing(old_driver_lab: LabFleet) -> None:
    path = inventory(old_driver_lab, "compat", nvidia_driver_version="keep", cuda_toolkit="12.9")
    rc, result = deploy(path)
    if rc != 0:
        print(host_run(old_driver_lab, "sudo journalctl -u fleet-vllm-0.service --no-pager | tail -20")[1])
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed", host
    assert "CUDA packages cuda-toolkit-12-9 cuda-compat-13-0" in host["operations"], host["operations"]
    assert [e["healthy"] for e in host["endpoints"]] == [True], host
    # the packages from the signed repository; the host's own driver left alone (no driver package)
    rc, installed, err = host_run(old_driver_lab, CUDA_PACKAGES)
    assert sorted(line.split()[0] for line in installed.splitlines()) == ["cuda-compat-13-0", "cuda-toolkit-12-9"]
    assert "570.172.08" in host_run(old_driver_lab, "cat /proc/driver/nvidia/version")[1]
    rc, nvcc, err = host_run(old_driver_lab, "/usr/local/cuda-12.9/bin/nvcc --version")
    assert rc == 0 and "Cuda compilation tools, release 12.9, V12.9.1" in nvcc, nvcc + err
    assert host_run(old_driver_lab, f"test -L {COMPAT}/libcuda.so.1 && test -r {COMPAT}/README.fleet-lab")[0] == 0
    # the unit, and the running process, carry the compat libraries first on LD_LIBRARY_PATH
    rc, unit, err = host_run(old_driver_lab, "cat /etc/systemd/system/fleet-vllm-0.service")
    assert f"Environment=LD_LIBRARY_PATH={COMPAT}\n" in unit and "Environment=CUDA_HOME=/usr/local/cuda-12.9\n" in unit
    pid = "$(systemctl show -p MainPID --value fleet-vllm-0.service)"
    rc, environ, err = host_run(old_driver_lab, f"sudo cat /proc/{pid}/environ | tr '\\0' '\\n'")
    assert f"LD_LIBRARY_PATH={COMPAT}" in environ.splitlines(), environ + err
    # without them the release's vLLM (the stand-in, as torch does) refuses the driver's CUDA 12.8
    check = "sudo env {}/opt/fleet/vllm/current/bin/python -c " + shlex.quote(
        "from vllm.standin.gpus import check_cuda_driver, nvml_init; check_cuda_driver(nvml_init()); print('ok')"
    )
    rc, out, err = host_run(old_driver_lab, check.format(""))
    assert rc != 0 and "The NVIDIA driver on your system is too old (found version 12080)" in err, out + err
    rc, out, err = host_run(old_driver_lab, check.format(f"LD_LIBRARY_PATH={COMPAT} "))
    assert rc == 0 and out.strip() == "ok", out + err
    # idempotent: nothing to do the second time (the packages are there, the audit now says "bridged")
    rc, again = deploy(path)
    assert rc == 0 and isinstance(again, dict), again
    (host,) = again["hosts"]  # type: ignore[misc]
    assert host["status"] == "unchanged" and host["operations"] == [], host
    audit = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "audit", str(path), "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    (audited,) = json.loads(audit.stdout)["hosts"]
    rules = {(f["rule"], f["severity"]) for f in audited["findings"]}
    assert ("cuda-compat-in-use", "info") in rules and ("cuda-driver-too-old", "critical") not in rules, rules
