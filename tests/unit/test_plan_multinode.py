"""Instances spanning hosts (``fleet.plan.multinode``): vLLM 0.33's layer split, the fewest nodes
that fit, each node's KV cache, every node's argv, and what ``fleet plan`` and the deploy make of it.
(The same arithmetic against vLLM's own code: ``tests/oracle/test_vs_vllm.py``.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError
from fleet.gpus import HostGpus
from fleet.inventory.spec import HostSpec, Workload
from fleet.model.arch import load_model
from fleet.plan.multinode import choose, nodes_needed, pp_indices, pp_partition, pp_problem, same_gpus
from fleet.plan.outcomes import build_fleet_plan, load_for_planning, outcome_data
from fleet.plan.planner import resolve_precision
from fleet.plan.vllm_surface import parse_serve_argv

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "models"
WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}
ONE_H100 = {"sku": "h100-sxm-80gb", "count": 1}
EIGHT_H100 = {"sku": "h100-sxm-80gb", "count": 8, "nvlink": "switch"}
L70 = "meta-llama/Llama-3.1-70B-Instruct"
L405 = "meta-llama/Llama-3.1-405B-Instruct"


@pytest.mark.parametrize(
    ("layers", "pp", "parts"),
    [
        (80, 2, (40, 40)),
        (126, 2, (63, 63)),
        (126, 4, (31, 32, 32, 31)),  # remainder 2: the stages before the last, from the second-to-last back
        (32, 3, (11, 11, 10)),
        (61, 4, (15, 15, 16, 15)),
        (10, 4, (2, 3, 3, 2)),
        (7, 3, (2, 3, 2)),
        (3, 3, (1, 1, 1)),
        (27, 2, (14, 13)),
    ],
)
def test_layers_split_as_vllms_get_pp_indices(layers: int, pp: int, parts: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == parts
    bounds = [pp_indices(layers, r, pp) for r in range(pp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert tuple(end - start for start, end in bounds) == parts


def _spec(model: str, weights: str = "auto", **extra: Any) -> HostSpec:
    return HostSpec(
        "h", "inv.py", (), model, Workload(2048, 512, 0.5, 8), weights=weights, multi_node=True,  # type: ignore[arg-type]
        **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "weights", "gpus", "nodes", "tp"),
    [
        (L70, "fp8", ("h100-sxm-80gb", 1), 2, 1),  # 67.7 GiB of weights: one 80 GB GPU cannot hold them
        (L70, "bf16", ("h100-sxm-80gb", 1), 2, 1),  # 131 GiB: two stages of 66 GiB leave 1.2 GiB of KV each
        (L70, "bf16", ("a10-24gb", 4), 9, 1),  # PCIe only: TP stays in an NVLink island of one GPU
        (L405, "bf16", ("h100-sxm-80gb", 8), 2, 8),  # 756 GiB over 2 × 8 × 80 GB
        (L405, "fp8", ("h100-sxm-80gb", 4), 2, 4),
    ],
)
def test_the_fewest_nodes_that_fit(model: str, weights: str, gpus: tuple[str, int], nodes: int, tp: int) -> None:
    host = HostGpus.from_catalogue(gpus[0], gpus[1], None)
    found = nodes_needed(_spec(model, weights), host, load_model(model))
    assert found is not None and (found.nodes, found.tp) == (nodes, tp)
    assert found.fits and all(s.memory.fits for s in found.stages)
    fewer = choose(_spec(model, weights, pipeline_parallel_size=nodes - 1), host, load_model(model), 16)[0]
    assert nodes == 2 or fewer is None or not fewer.fits


def test_kv_per_node_and_the_instance_takes_the_smallest_stages_blocks() -> None:
    arch = load_model(str(MODELS / "llama-3.1-8b"))
    host = HostGpus.from_catalogue("a10-24gb", 1, None)
    spec = _spec(str(MODELS / "llama-3.1-8b"), pipeline_parallel_size=3)
    p, _ = choose(spec, host, arch, 3)
    assert p is not None and p.nodes == 3
    assert [s.layers for s in p.stages] == [(0, 11), (11, 22), (22, 32)]
    blocks = [s.memory.kv_blocks for s in p.stages]
    # the first stage holds the embedding, the last the LM head and 10 layers: three different block counts
    assert len(set(blocks)) == 3 and p.kv_blocks == min(blocks)
    for s in p.stages:
        layout = s.memory.kv_layout
        assert layout is not None and layout.groups[0].layers == s.layers[1] - s.layers[0]
        assert s.memory.kv_blocks == s.memory.kv_budget // layout.bytes_per_block
    assert p.kv_tokens == min(s.memory.kv_tokens for s in p.stages)
    total = sum(s.weights for s in p.stages)
    whole = arch.embedding_parameters * 2  # the LM head and the embedding: both stages load a full matrix
    assert total == pytest.approx(arch.parameters * 2 + (whole - arch.embedding_parameters * 2), rel=0.01)


def test_what_vllm_cannot_split_is_said() -> None:
    arch = load_model(str(MODELS / "llama-3.1-8b"))
    assert pp_problem(arch, 32) is None
    assert "33 pipeline stages but" in (pp_problem(arch, 33) or "")
    gemma = load_model(str(MODELS / "gemma-2-9b"))
    assert "mixes attention kinds" in (pp_problem(gemma, 2) or "")


def test_hosts_with_different_gpus_are_named() -> None:
    a = HostGpus.from_catalogue("h100-sxm-80gb", 1, None)
    b = HostGpus.from_catalogue("h200-sxm-141gb", 1, None)
    assert same_gpus({"n1": a, "n2": a}) is None
    why = same_gpus({"n1": a, "n2": b, "n3": a})
    assert why is not None and "n1:" in why and "n2:" in why and "n3" not in why


def inventory(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.py"
    path.write_text(f"W = {WORKLOAD!r}\n" + text)
    return path


def _group(name: str, hosts: list[str], octet: int, **data: Any) -> str:
    rows = [(h, {"ssh_hostname": f"127.0.250.{octet + i}"}) for i, h in enumerate(hosts)]
    return f"{name} = ({rows!r}, dict(workload=W, **{data!r}))\n"


def test_llama_70b_fp8_on_two_one_gpu_hosts_plans_one_instance_over_both(tmp_path: Path) -> None:
    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=L70, weights="fp8", multi_node=True,
                                      gpu=ONE_H100))  # fmt: skip
    fleet = build_fleet_plan(load_for_planning(path))
    assert fleet.refusals() == []
    (instance,) = fleet.instances()
    assert instance.host == "n1" and [(p.host, p.node_rank, p.gpus) for p in instance.placements] == [
        ("n1", 0, (0,)),
        ("n2", 1, (0,)),
    ]
    assert instance.url == "http://127.0.250.3:8000"
    leader, worker = (fleet.host(h).plan for h in ("n1", "n2"))
    assert leader is not None and worker is not None
    argv = {h: p.instances[0].argv for h, p in (("n1", leader), ("n2", worker))}
    for rank, host in enumerate(("n1", "n2")):
        ns = parse_serve_argv(argv[host], "0.33.0")  # vLLM 0.33's own surface
        assert (ns.nnodes, ns.node_rank, ns.pipeline_parallel_size, ns.tensor_parallel_size) == (2, rank, 2, 1)
        assert (ns.master_addr, ns.master_port, ns.distributed_executor_backend) == ("127.0.250.3", 29501, "mp")
        assert ns.headless is (rank == 1)
    assert [i.node.layers for p in (leader, worker) for i in p.instances if i.node] == [(0, 40), (40, 80)]
    assert leader.total_kv_tokens == leader.instances[0].node.instance_kv_tokens > 100_000  # type: ignore[union-attr]
    assert worker.total_kv_tokens == 0  # counted once, at the leader
    data = [outcome_data(fleet.host(h)) for h in ("n1", "n2")]
    nodes = [d["instances"][0]["node"] for d in data]
    assert [(n["rank"], n["leader"], n["headless"], n["layers"]) for n in nodes] == [
        (0, "n1", False, [0, 40]),
        (1, "n1", True, [40, 80]),
    ]
    assert nodes[0]["instance_kv_tokens"] == nodes[1]["instance_kv_tokens"] == min(n["node_kv_tokens"] for n in nodes)
    assert json.loads(json.dumps(data)) == data


def test_llama_405b_bf16_on_8xh100_hosts_leaves_the_odd_host_over(tmp_path: Path) -> None:
    path = inventory(tmp_path, _group("big", ["b1", "b2", "b3"], 5, model=L405, multi_node=True, gpu=EIGHT_H100))
    fleet = build_fleet_plan(load_for_planning(path))
    (instance,) = fleet.instances()
    assert [p.host for p in instance.placements] == ["b1", "b2"] and instance.spec.tensor_parallel_size == 8
    b3 = fleet.host("b3").plan
    assert b3 is not None and b3.instances == () and "serves nothing" in b3.warnings[0]


def test_a_model_that_fits_one_host_stays_on_one_host_in_a_multi_node_group(tmp_path: Path) -> None:
    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=L70, weights="fp8", multi_node=True,
                                      gpu={"sku": "h100-sxm-80gb", "count": 2, "nvlink": "switch"}))  # fmt: skip
    fleet = build_fleet_plan(load_for_planning(path))
    assert [(i.host, len(i.placements)) for i in fleet.instances()] == [("n1", 1), ("n2", 1)]


def test_without_multi_node_the_refusal_names_it_with_the_nodes_needed(tmp_path: Path) -> None:
    path = inventory(tmp_path, _group("big", ["b1"], 5, model=L405, gpu=EIGHT_H100))
    outcome = build_fleet_plan(load_for_planning(path)).host("b1")
    assert outcome.problem is not None
    way = outcome.problem.ways_out[-1]
    assert way.startswith("multi_node: true on a group of 2 such hosts: 2 hosts (PP 2 × TP 8), layers 63/63, ")
    assert "KV tokens" in way


def test_a_group_too_small_is_refused_with_the_hosts_it_would_need(tmp_path: Path) -> None:
    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=L70, weights="bf16", multi_node=True,
                                      gpu={"sku": "a10-24gb", "count": 1}))  # fmt: skip
    fleet = build_fleet_plan(load_for_planning(path))
    for host in ("n1", "n2"):
        problem = fleet.host(host).problem
        assert problem is not None and problem.host == host
        assert "does not fit even across the multi-node group" in problem.summary
        assert "multi-node group of 2 host(s) (n1, n2)" in problem.details[0]
        assert any(w.startswith("add hosts to the group: 9 hosts (PP 9 × TP 1)") for w in problem.ways_out)


def test_a_hybrid_model_is_not_planned_across_hosts(tmp_path: Path) -> None:
    model = str(MODELS / "gemma-2-9b")  # sliding and full layers; 17 GiB of weights on 16 GiB GPUs
    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=model, multi_node=True,
                                      gpu={"memory_gib": 16.0, "count": 1}))  # fmt: skip
    fleet = build_fleet_plan(load_for_planning(path))
    for host in ("n1", "n2"):
        problem = fleet.host(host).problem
        assert problem is not None and "mixes attention kinds (full, sliding)" in problem.summary


def test_deploy_takes_a_multi_node_plan_and_rollouts_take_it_as_one_instance_of_two_nodes(tmp_path: Path) -> None:
    from fleet.deploy.runner import check_hosts
    from fleet.facts.runner import HostUnreachable
    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.fleet_inventory import fleet_of

    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=L70, weights="fp8", multi_node=True,
                                      gpu=ONE_H100, pip_index_url="http://127.0.0.1:9/simple/"))  # fmt: skip
    plans = check_hosts(load_for_planning(path))
    nodes = {h: [i.node for i in plans[h].instances] for h in ("n1", "n2")}
    assert [(n.rank, n.hosts) for n in nodes["n1"] if n] == [(0, ("n1", "n2"))]
    assert [(n.rank, n.headless) for n in nodes["n2"] if n] == [(1, True)]

    def read(specs: object, ssh: object) -> tuple[dict[str, object], dict[str, object]]:
        hosts = ("n1", "n2", "n3")
        return {h: HostUnreachable(h, "not asked") for h in hosts}, {h: HostUnreachable(h, "not asked") for h in hosts}

    fleet = fleet_of(load_for_planning(path), read=read)  # type: ignore[arg-type]
    pair = (InstanceRef("n1", "vllm-0"), InstanceRef("n2", "vllm-0"))
    lead, work = (fleet.instances[r] for r in pair)
    assert (lead.nodes, work.nodes) == (pair, pair)
    assert (lead.headless, work.headless) == (False, True)
    assert lead.url.endswith(":8000") and work.url == ""  # the headless node is asked nothing over HTTP
    assert lead.unit == work.unit == "fleet-vllm-0.service"
    targets = fleet.targets(dict.fromkeys(fleet.hosts, "r2"), restart=False)
    assert {t.ref: t.nodes for t in targets if t.nodes} == dict.fromkeys(pair, pair)
    # a limit that leaves out one node of the instance is refused before anything (the plan of the
    # hosts left cannot hold the model)
    with pytest.raises(FleetError, match=r"host n1: .* does not fit even across the multi-node group"):
        fleet_of(load_for_planning(path, ["n1"]), read=read)  # type: ignore[arg-type]


def test_resolve_precision_is_the_single_host_one() -> None:
    arch = load_model(L70)
    assert resolve_precision(_spec(L70, "fp8"), arch).name == "fp8"
