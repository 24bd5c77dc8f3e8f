"""The fleet plan (``fleet.plan.outcomes.build_fleet_plan``): one value for the fleet from the
inventory and the probes a command gathered; ``fleet plan --json`` is its serialization and the
rollouts take their instances from it. Probe answers are recorded ones (real drivers, lab hosts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.plan.gpu_source import GpuMismatch, GpusNotKnownYet
from fleet.plan.outcomes import build_fleet_plan, load_for_planning, outcome_data, plan_file
from fleet.render import part
from fleet.rollout.fleet_inventory import load_fleet

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "probe"
WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}


def facts(name: str) -> HostFacts:
    return NvmlProbe().process(json.loads((FIXTURES / f"{name}.json").read_text())["output"])


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    base = {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": WORKLOAD}
    rows = [
        (name, {**base, "ssh_hostname": f"127.0.250.{i + 3}", **data}) for i, (name, data) in enumerate(hosts.items())
    ]
    path = tmp_path / "fleet.py"
    path.write_text(f"gpus = {rows!r}\n")
    return path


def test_the_offline_fleet_plan_is_what_fleet_plan_prints_and_lists_every_instance_with_its_placement() -> None:
    loaded = load_for_planning(REPO / "inventory" / "prod.py")
    fleet = build_fleet_plan(loaded)
    assert [outcome_data(o) for o in fleet.hosts] == [
        outcome_data(o) for o in plan_file(REPO / "inventory" / "prod.py")
    ]
    assert fleet.not_probed == {} and fleet.refusals() == []
    instances = fleet.instances()
    assert len(instances) == sum(len(o.plan.instances) for o in fleet.hosts if o.plan is not None) > 6
    for i in instances:
        spec = fleet.host(i.host).spec
        assert i.placements == (i.placements[0],) and i.placements[0].host == i.host
        assert i.placements[0].gpus == i.spec.gpus and i.placements[0].node_rank == 0
        assert i.unit == f"fleet-{i.name}.service" and i.url == f"http://{spec.ssh_hostname}:{i.port}"
        assert i.served_name == (spec.served_model_name or spec.model)
        assert fleet.host(i.host).gpus is not None and fleet.host(i.host).gpus.chosen.origin == "inventory"  # type: ignore[union-attr]


def test_a_probe_that_contradicts_the_declaration_is_shown_by_plan_and_refused_by_deploy(tmp_path: Path) -> None:
    path = inventory(tmp_path, {"h1": {"gpu": {"sku": "h100-sxm-80gb", "count": 2}}, "h2": {}})
    loaded = load_for_planning(path)
    probes = {"h1": facts("h200-vm"), "h2": facts("rtx4090-2")}

    shown = build_fleet_plan(loaded, probes)
    h1 = shown.host("h1")
    assert h1.plan is not None and h1.plan.gpus_source == "probe" and len(h1.plan.instances) == 1
    assert h1.gpus is not None and any("the probe found 1" in d for d in h1.gpus.differences)
    assert shown.host("h2").plan is not None

    deploying = build_fleet_plan(loaded, probes, deploy=True)
    assert deploying.host("h1").plan is None and isinstance(deploying.host("h1").refusal, GpuMismatch)
    assert [i.host for i in deploying.instances()] == ["h2", "h2"]
    # the same refusal, word for word, as the deploy's per-host plan (fleet.render.part.host_plan)
    with pytest.raises(GpuMismatch) as exc:
        part.host_plan(part.spec_of("h1", loaded.pyinfra.get_host("h1").data.dict()), probes["h1"])  # type: ignore[no-untyped-call]
    assert deploying.refusals() == [str(exc.value)]


def test_a_host_whose_driver_does_not_answer_yet_waits_in_a_deploy(tmp_path: Path) -> None:
    loaded = load_for_planning(inventory(tmp_path, {"h1": {}}))
    deploying = build_fleet_plan(loaded, {"h1": facts("driver-not-loaded")}, deploy=True)
    assert isinstance(deploying.host("h1").refusal, GpusNotKnownYet) and deploying.instances() == []
    planned = build_fleet_plan(loaded, {"h1": facts("driver-not-loaded")})
    assert planned.host("h1").problem is not None
    assert "no GPU facts" in planned.host("h1").problem.summary  # type: ignore[union-attr]
    assert planned.not_probed["h1"].startswith("probe answered driver-not-loaded")


def test_the_rollouts_instances_come_from_the_fleet_plan(tmp_path: Path) -> None:
    h1 = {"gpu": {"sku": "l40s-48gb", "count": 4}, "served_model_name": "chat"}
    h2 = {"gpu": {"sku": "h100-sxm-80gb", "count": 8}, "bind_address": "127.0.250.9"}
    path = inventory(tmp_path, {"h1": h1, "h2": h2})
    fleet = load_fleet(str(path))  # every host declares its GPUs: nothing is probed
    planned = build_fleet_plan(load_for_planning(path), deploy=True).instances()
    assert [(str(r), s.unit, s.url, s.port, s.gpus, s.model) for r, s in fleet.instances.items()] == [
        (f"{i.host}/{i.name}", i.unit, i.url, i.port, i.placements[0].gpus, i.served_name) for i in planned
    ]
    assert {s.model for r, s in fleet.instances.items() if r.host == "h1"} == {"chat"}
    assert {s.url.split(":")[1] for r, s in fleet.instances.items() if r.host == "h2"} == {"//127.0.250.9"}
