"""``fleet audit`` and ``fleet status`` of an instance spanning two lab hosts (the session's shared
lab, no lab of its own): an inventory that declares both hosts alike (one H100 each) and serves a
model neither holds alone, while the hosts really have different GPUs (the lab's 8×H100 SXM and
2×RTX 4090 profiles). The audit finds the difference on the real hosts, classifies each worker's
real TCP connect to the leader's rendezvous port, says the lab's traffic goes over TCP (no RDMA);
``fleet status`` shows the instance as one row with its nodes."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.facts.node_network import REACHABLE, NodeNet, NodeNetwork
from fleet.facts.runner import run_fact_on_hosts, targets_from_inventory
from fleet.inventory.spec import load_inventory

from .conftest import LabFleet
from .deploying import REPO_ROOT

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"


@pytest.fixture(scope="module")
def spanning(lab_fleet: LabFleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The lab's first two hosts as one multi-node group (an inventory beside the lab's own)."""
    lab = runpy.run_path(str(lab_fleet.opts.inventory))
    (group,) = [v for k, v in lab.items() if not k.startswith("_") and isinstance(v, list)]
    hosts: list[tuple[str, dict[str, Any]]] = []
    for name, data in group[:2]:
        data = {k: v for k, v in data.items() if k != "bind_address"}  # one vllm serve for every node
        data.update(model="meta-llama/Llama-3.1-70B-Instruct", weights="fp8", multi_node=True,
                    gpu={"sku": "h100-sxm-80gb", "count": 1})  # fmt: skip
        hosts.append((name, data))
    path = tmp_path_factory.mktemp("multinode") / "pair.py"
    path.write_text(f"pair = {hosts!r}\n")
    return path


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FLEET), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_audit_of_an_instance_over_two_lab_hosts(spanning: Path) -> None:
    proc = fleet("audit", str(spanning), "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]  # the GPUs differ: an error
    report = json.loads(proc.stdout)
    leader, worker = (h["host"] for h in report["hosts"])
    found = {f["rule"]: f for f in report["fleet_findings"]}
    assert all(f["instance"] == f"{leader}/vllm-0" for f in found.values())
    gpus = found["multinode-gpus"]["message"]
    assert f"{leader} (node 0, leader) 8 × NVIDIA H100 80GB HBM3" in gpus and f"{worker} (node 1) 2 × " in gpus
    assert (
        "no RDMA device" in found["multinode-tcp"]["message"] and "NCCL_IB_DISABLE" in found["multinode-tcp"]["message"]
    )
    assert "multinode-mtu" not in found  # both reach the leader over the same loopback
    # the worker's real connect, read again here: the rendezvous finding says what it says
    loaded = load_inventory(spanning)
    address = loaded.hosts[0].ssh_hostname
    assert address is not None
    (answer,) = run_fact_on_hosts(
        targets_from_inventory(loaded.pyinfra, [worker]), NodeNetwork, address=address, port=29501, timeout=3.0
    ).values()
    assert isinstance(answer, NodeNet) and answer.ok and answer.connect is not None
    if answer.connect.outcome in REACHABLE:
        assert "multinode-rendezvous" not in found
    else:  # the lab's air gap between its hosts: rejected (no route) or dropped (timeout)
        assert answer.connect.outcome in ("unreachable", "timeout")
        message = found["multinode-rendezvous"]["message"]
        assert found["multinode-rendezvous"]["host"] == worker and f"{address}:29501" in message


def test_status_shows_the_instance_as_one_row_with_its_nodes(spanning: Path) -> None:
    proc = fleet("status", str(spanning), "--json", "--interval", "0.2")
    assert proc.returncode == 1, proc.stderr[-2000:]  # nothing is deployed as a multi-node instance
    (row,) = json.loads(proc.stdout)["instances"]
    leader, worker = (h for h, _ in runpy.run_path(str(spanning))["pair"])
    assert row["instance"] == f"{leader}/vllm-0" and row["host"] == leader
    assert [(n["host"], n["rank"], n["leader"]) for n in row["nodes"]] == [(leader, 0, True), (worker, 1, False)]
    assert all(n["unit"] is not None for n in row["nodes"])  # every node's unit was read on its host
    if row["nodes"][1]["down"]:
        assert row["state"] in ("node down", "no unit", "stopped", "failed")
        assert any(p.startswith(f"node 1 ({worker}) down: ") for p in row["problems"])
