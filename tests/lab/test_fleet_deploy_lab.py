"""``fleet deploy`` (first cut) on a lab host with its driver: --dry touches nothing, a first
deploy installs the release and units, starts them and waits until each instance is healthy and
lists its model, and a second deploy changes nothing."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fleet.lab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT, host_run

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def served_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("deploy-lab")
    octet = free_octet(os.getpid() + 13, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pf{os.getpid()}", octet, 1, ("rtx4090-2",)))
    try:
        yield LabFleet(opts, bring_up(opts))
    finally:
        lab_ops.down(opts.name, opts.state_root)


def fleet_deploy(lab: LabFleet, *args: str) -> tuple[int, dict[str, object] | str]:
    proc = subprocess.run(
        [str(FLEET), "deploy", str(lab.opts.inventory), "--json", "--health-timeout", "120", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def test_dry_run_reports_changes_and_touches_nothing(served_lab: LabFleet) -> None:
    rc, result = fleet_deploy(served_lab, "--dry")
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "would change"
    assert "vLLM system user" in host["operations"] and "vLLM units and env files" in host["operations"]
    assert host_run(served_lab, "test -e /opt/fleet")[0] != 0


def test_unknown_limit_is_refused_before_any_host_is_touched(served_lab: LabFleet) -> None:
    rc, result = fleet_deploy(served_lab, "--limit", "no-such-host")
    assert rc == 2 and isinstance(result, dict) and "--limit" in str(result["error"])


def test_first_deploy_serves_and_a_second_changes_nothing(served_lab: LabFleet) -> None:
    # The model's files are not fleet's to fetch yet (model distribution is its own step): put the
    # config where vLLM's Hugging Face cache lookup finds it, as the vllm user will own it.
    rc, _out, err = host_run(
        served_lab,
        f"sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group vllm "
        f"&& sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee {HUB}/refs/main "
        f"&& echo {base64.b64encode(CONFIG.read_bytes()).decode()} | base64 -d "
        f"| sudo -u vllm tee {HUB}/snapshots/main/config.json >/dev/null",
    )
    assert rc == 0, err
    rc, result = fleet_deploy(served_lab)
    if rc != 0:
        print(host_run(served_lab, "sudo journalctl -u fleet-vllm-0.service --no-pager | tail -20")[1])
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed" and host["reboot_required"] is None
    assert "start fleet-vllm-0.service" in host["operations"]
    assert [e["healthy"] for e in host["endpoints"]] == [True, True]
    assert all("meta-llama/Llama-3.1-8B-Instruct" in e["detail"] for e in host["endpoints"])
    rc, again = fleet_deploy(served_lab)
    assert rc == 0 and isinstance(again, dict), again
    (host,) = again["hosts"]  # type: ignore[misc]
    assert host["status"] == "unchanged" and host["operations"] == [], host
    assert [e["healthy"] for e in host["endpoints"]] == [True, True]
