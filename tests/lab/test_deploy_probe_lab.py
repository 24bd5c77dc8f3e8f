"""``fleet deploy`` plans from each host's NVML probe (issue 12), on a lab host with its driver.

An inventory without ``gpu`` entries deploys in one run (the first probe, before any release, runs
on the host's python3, which has no nvidia-ml-py, through the pynvml the probe carries, and the
units are planned from what the host has) and each instance serves with the flags planned from
the probe; a second run changes nothing. An inventory whose ``gpu`` entry disagrees with the host's
(simulated) GPUs is refused, naming both sides and the way out, and nothing on the host changes.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe, carried_pynvml
from fleet.facts.runner import SshTarget, run_fact_on_hosts
from fleet.inventory.spec import load_inventory
from fleet.plan.planner import HostPlan
from fleet.render import part as host_part
from fleet.rollout.fleet_inventory import load_fleet
from fleetlab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT, host_run
from .test_fleet_deploy_lab import FLEET, seed_model_cache

pytestmark = pytest.mark.lab

PROFILE = "rtx4090-2"
#: what the host has: two GeForce RTX 4090 (24 GiB, no NVLink)
WRONG_GPU = {"sku": "l40s-48gb", "count": 4}
#: the files a deploy writes on a host, with their checksums, and the releases installed
WRITTEN = (
    "sudo sh -c 'sha256sum /etc/systemd/system/fleet-vllm-*.service /etc/fleet/*.env 2>&1; "
    "ls -l --time-style=+%s /opt/fleet/vllm /opt/fleet/vllm/releases 2>&1'"
)
PIDS = "systemctl show -p MainPID --value fleet-vllm-0.service fleet-vllm-1.service"


@pytest.fixture(scope="module")
def probed_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("deploy-probe-lab")
    octet = free_octet(os.getpid() + 41, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pp{os.getpid()}", octet, 1, (PROFILE,)))
    try:
        lab = LabFleet(opts, bring_up(opts))
        rc, _out, err = host_run(lab, seed_model_cache())
        assert rc == 0, err
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def host_plan(name: str, data: Mapping[str, object], facts: HostFacts) -> HostPlan:
    """The host's plan from its data and probe, as the deploy makes it (``fleet.render.part``)."""
    return host_part.host_plan(host_part.spec_of(name, data), facts)


def inventory(lab: LabFleet, name: str, gpu: dict[str, object] | None) -> Path:
    """A copy of the lab's inventory with every host's gpu entry removed, or replaced by ``gpu``."""
    assert lab.opts.inventory is not None
    path = lab.opts.inventory.with_name(f"{name}.py")
    change = f'_data["gpu"] = {gpu!r}' if gpu is not None else '_data.pop("gpu", None)'
    path.write_text(lab.opts.inventory.read_text() + f"for _name, _data in lab:\n    {change}\n")
    return path


def deploy(path: Path, *args: str) -> tuple[int, dict[str, object] | str]:
    proc = subprocess.run(
        [str(FLEET), "deploy", str(path), "--json", "--health-timeout", "180", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def hosts_data(path: Path) -> list[tuple[str, dict[str, object]]]:
    loaded = load_inventory(str(path))
    return [(s.name, loaded.pyinfra.get_host(s.name).data.dict()) for s in loaded.hosts]


def probe(path: Path) -> tuple[str, dict[str, object], HostFacts]:
    """The host's name, data and what its NVML answers now (fleet's probe, run over SSH)."""
    loaded = load_inventory(str(path))
    (spec,) = loaded.hosts
    data = loaded.pyinfra.get_host(spec.name).data.dict()
    answers = run_fact_on_hosts([SshTarget.from_data(spec.name, data)], NvmlProbe)
    facts = answers[spec.name]
    assert isinstance(facts, HostFacts) and facts.ok, facts
    return spec.name, data, facts


def test_an_inventory_without_gpu_entries_deploys_from_the_probe(probed_lab: LabFleet) -> None:
    path = inventory(probed_lab, "probed", None)
    assert "'gpu'" in probed_lab.opts.inventory.read_text() and load_inventory(str(path)).hosts[0].gpu is None  # type: ignore[union-attr]
    # before the first release, the host's python3 has no nvidia-ml-py: the probe answers with its own
    assert host_run(probed_lab, "python3 -c 'import pynvml'")[0] != 0
    (target,) = [SshTarget.from_data(n, d) for n, d in hosts_data(path)]
    first = run_fact_on_hosts([target], NvmlProbe)[target.name]
    assert isinstance(first, HostFacts) and first.ok and first.python == "/usr/bin/python3", first
    assert first.pynvml == carried_pynvml().origin and [g.name for g in first.gpus] == ["NVIDIA GeForce RTX 4090"] * 2
    rc, result = deploy(path)
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed" and host["note"] is None, host
    assert "vLLM units and env files" in host["operations"] and "start fleet-vllm-0.service" in host["operations"]
    assert [e["healthy"] for e in host["endpoints"]] == [True, True], host
    name, data, facts = probe(path)
    assert [g.name for g in facts.gpus] == ["NVIDIA GeForce RTX 4090"] * 2
    # deployed: the probe runs on the release's python, whose nvidia-ml-py is reported; the carried one answers
    assert str(facts.python).startswith("/opt/fleet/vllm/") and facts.packages["nvidia-ml-py"], facts
    assert facts.pynvml == carried_pynvml().origin
    # serving: NVML shows the memory our units hold (the stand-in registers it), which the plan ignores
    held = {p.unit for g in facts.gpus for p in g.processes or () if p.used_memory}
    assert held == {"fleet-vllm-0.service", "fleet-vllm-1.service"}, held
    assert all(g.memory is not None and g.memory.used > 0 for g in facts.gpus)
    plan = host_plan(name, data, facts)
    assert plan.gpus_source == "probe" and len(plan.instances) == 2
    for n, instance in enumerate(plan.instances):
        rc, cmdline, err = host_run(
            probed_lab, f"tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value fleet-vllm-{n}.service)/cmdline"
        )
        assert rc == 0, err
        running = cmdline.strip("\n").split("\n")
        assert running[running.index("serve") + 1 :] == instance.argv, (running, instance.argv)
        assert "--gpu-memory-utilization" in instance.argv
    # the rollout sees the instances the deploy rendered (it probes a host without a gpu entry)
    rollout = load_fleet(str(path))
    assert [(s.unit, s.port, s.gpus) for s in rollout.instances.values()] == [
        (f"fleet-{i.unit_name}.service", i.port, i.gpus) for i in plan.instances
    ]
    # serving, the host's NVML shows our units' memory; the plan and the files stay the same
    rc, again = deploy(path)
    assert rc == 0 and isinstance(again, dict), again
    (host,) = again["hosts"]  # type: ignore[misc]
    assert host["status"] == "unchanged" and host["operations"] == [] and not host["restarted"], host


def test_a_gpu_entry_the_probe_contradicts_is_refused_and_nothing_is_written(probed_lab: LabFleet) -> None:
    before_files = host_run(probed_lab, WRITTEN)[1]
    before_pids = host_run(probed_lab, PIDS)[1]
    assert "fleet-vllm-0.service" in before_files and before_pids.split() != ["0", "0"], before_files
    rc, result = deploy(inventory(probed_lab, "wrong", WRONG_GPU))
    assert rc == 1 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "refused" and host["operations"] == [] and not host["restarted"], host
    error = str(host["error"])
    name = probed_lab.state.hosts[0].name
    assert error.startswith(f"host {name}: the inventory's gpu entry does not match the host's GPUs: "), error
    for part in (
        "count: the inventory says 4, the probe found 2",
        "model: the inventory says l40s-48gb (NVIDIA L40S), the probe found NVIDIA GeForce RTX 4090 on GPU 0,1",
        "memory: the inventory says 45.0 GiB per GPU, the probe found 24.0 GiB on GPU 0,1",
        "Fix the host's gpu entry, or remove it to plan from the probe",
        "(nothing was written to the host)",
    ):
        assert part in error, (part, error)
    assert host_run(probed_lab, WRITTEN)[1] == before_files
    assert host_run(probed_lab, PIDS)[1] == before_pids


# ---- a bare host (no driver) without a gpu entry: it waits, and --reboot completes it -------------


@pytest.fixture(scope="module")
def bare_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("deploy-probe-bare")
    octet = free_octet(os.getpid() + 53, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pq{os.getpid()}", octet, 1, ("a10-1",)), bare=True)
    try:
        lab = LabFleet(opts, bring_up(opts))
        rc, _out, err = host_run(lab, seed_model_cache())
        assert rc == 0, err
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def test_a_bare_host_without_gpu_entry_waits_for_its_driver_then_reboot_completes_it(bare_lab: LabFleet) -> None:
    path = inventory(bare_lab, "bare", None)
    rc, result = deploy(path)
    assert rc == 0 and isinstance(result, dict), result  # waiting is not a failure
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "waiting" and host["reboot_required"], host
    assert "its units wait for NVML to answer (NVML probe: " in str(host["note"]), host
    assert "vLLM units and env files" not in host["operations"] and host["endpoints"] == [], host
    assert any("NVIDIA driver" in op for op in host["operations"]), host["operations"]
    assert host_run(bare_lab, "ls /etc/systemd/system/fleet-vllm-0.service")[0] != 0
    rc, result = deploy(path, "--reboot")
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed" and host["note"] is None and host["reboot_required"] is None, host
    assert any(op.startswith("reboot") for op in host["operations"]), host["operations"]
    assert "vLLM units and env files" in host["operations"], host["operations"]
    assert host["endpoints"] and all(e["healthy"] for e in host["endpoints"]), host
    name, data, facts = probe(path)
    assert facts.driver_version and [g.name for g in facts.gpus] == ["NVIDIA A10"]
    (instance,) = host_plan(name, data, facts).instances
    _rc, cmdline, _err = host_run(
        bare_lab, "tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value fleet-vllm-0.service)/cmdline"
    )
    running = cmdline.strip("\n").split("\n")
    assert running[running.index("serve") + 1 :] == instance.argv, (running, instance.argv)
