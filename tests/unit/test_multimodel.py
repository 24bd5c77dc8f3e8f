"""Several models on one host (``models``, issue 23 part 5): the inventory's grammar and refusals,
each entry planned on its GPU range by the one-model planner, instances numbered across the host.

Plans come from the models bundled with fleet (``fleet/data/models``) on catalogue GPUs, or from
recorded NVML probes (``tests/fixtures/probe``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.gpus import HostGpus
from fleet.inventory.spec import host_spec
from fleet.model.arch import load_model
from fleet.plan.models import entry_gpus, plan_models, subset
from fleet.plan.outcomes import build_fleet_plan, load_for_planning, outcome_data
from fleet.plan.planner import HostPlan, plan_host

REPO = Path(__file__).resolve().parents[2]
L70 = "meta-llama/Llama-3.1-70B-Instruct"
L8 = "meta-llama/Llama-3.1-8B-Instruct"
M7 = "mistralai/Mistral-7B-Instruct-v0.3"
CHAT = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 64}


def data(gpu: dict[str, Any] | None, models: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": dict(CHAT), "models": models, **more}
    if gpu is not None:
        out["gpu"] = gpu
    return out


def plan_of(raw: dict[str, Any]) -> HostPlan:
    spec = host_spec("inv.py", "h1", (), raw)
    assert spec.gpu is not None
    archs = [(load_model(m.model, m.model_config), None) for m in spec.model_specs]
    return plan_models(spec, spec.gpu.host_gpus(), archs)


@dataclass(frozen=True)
class Want:
    """One entry's part of the plan."""

    model: str
    served: str
    gpus: tuple[int, ...]
    instances: tuple[int, ...]  #: instance numbers (unit vllm-N, port 8000 + N), from the entry's first GPU
    tp: int
    tp_reason: str  #: in each instance's --tensor-parallel-size flag's reason


@dataclass(frozen=True)
class Case:
    name: str
    gpu: dict[str, Any]
    models: list[dict[str, Any]]
    want: tuple[Want, ...]
    warnings: tuple[str, ...] = ()  #: each in one of the host plan's warnings
    idle: tuple[int, ...] = ()


H100x8 = {"sku": "h100-sxm-80gb", "count": 8, "nvlink": "switch"}
CASES = [
    Case(
        "the issue's example: a 70B on four GPUs, two 8B on two each",
        H100x8,
        [
            {"model": L70, "gpus": 4, "tensor_parallel_size": 4},
            {"model": L8, "gpus": 2, "served_model_name": "chat-small"},
            {"model": M7, "gpus": 2},
        ],
        (
            Want(L70, L70, (0, 1, 2, 3), (0,), 4, "in one NVLink island"),
            Want(L8, "chat-small", (4, 5), (4, 5), 1, "in one NVLink island"),
            Want(M7, M7, (6, 7), (6, 7), 1, "in one NVLink island"),
        ),
    ),
    Case(
        "a 70B in fp8 and an 8B pinned at TP 2: each entry's own keys",
        H100x8,
        [{"model": L70, "gpus": 4, "weights": "fp8"}, {"model": L8, "gpus": 4, "tensor_parallel_size": 2}],
        (
            Want(L70, L70, (0, 1, 2, 3), (0, 1), 2, "meets the workload's target concurrency"),
            Want(L8, L8, (4, 5, 6, 7), (4, 5), 2, "in one NVLink island"),
        ),
    ),
    Case(
        "PCIe-only L40S: one instance per GPU in each entry",
        {"sku": "l40s-48gb", "count": 4},
        [{"model": L8, "gpus": 3}, {"model": M7, "gpus": 1}],
        (
            Want(L8, L8, (0, 1, 2), (0, 1, 2), 1, "in one NVLink island"),
            Want(M7, M7, (3,), (3,), 1, "in one NVLink island"),
        ),
    ),
    Case(
        "GPUs given to no entry stay idle, and the plan says so",
        H100x8,
        [{"model": L8, "gpus": 2}, {"model": M7, "gpus": 2}],
        (
            Want(L8, L8, (0, 1), (0, 1), 1, "in one NVLink island"),
            Want(M7, M7, (2, 3), (2, 3), 1, "in one NVLink island"),
        ),
        warnings=("GPUs 4, 5, 6, 7 are given to no entry of models: they stay idle",),
        idle=(4, 5, 6, 7),
    ),
    Case(
        "a range across NVLink pairs is said, and TP stays in the pair",
        {"sku": "h100-pcie-80gb", "count": 4, "nvlink": "pairs"},
        [
            {"model": L8, "gpus": 1},
            {"model": M7, "gpus": 2, "tensor_parallel_size": 1},
            {"model": L8, "gpus": 1, "served_model_name": "8b-b"},
        ],
        (
            Want(L8, L8, (0,), (0,), 1, "in one NVLink island"),
            Want(M7, M7, (1, 2), (1, 2), 1, "in one NVLink island"),
            Want(L8, "8b-b", (3,), (3,), 1, "in one NVLink island"),
        ),
        warnings=(f"models[1] {M7}: its GPUs 1-2 span NVLink islands (its part of each: 1; 2)",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_entry_is_planned_on_its_gpus_and_numbered_across_the_host(case: Case) -> None:
    plan = plan_of(data(case.gpu, case.models))
    assert [m.entry for m in plan.models] == list(range(len(case.want)))
    for m, want in zip(plan.models, case.want, strict=True):
        assert (m.model, m.served_name, m.gpus) == (want.model, want.served, want.gpus)
        assert tuple(i.index for i in m.plan.instances) == want.instances
        for inst in m.plan.instances:
            flags = {f.option: f for f in inst.flags}
            assert inst.model == want.model and set(inst.gpus) <= set(want.gpus)
            assert inst.port == 8000 + inst.index and inst.unit_name == f"vllm-{inst.index}"
            assert flags["--port"].value == str(inst.port)
            assert flags["--port"].reason == f"base port 8000 + instance {inst.index}"
            assert flags["--served-model-name"].value == want.served
            assert flags["--tensor-parallel-size"].value == str(want.tp)
            assert want.tp_reason in flags["--tensor-parallel-size"].reason
            assert f"GPU(s) {list(inst.gpus)} in one NVLink island" in flags["--tensor-parallel-size"].reason
            assert dict(inst.env)["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, inst.gpus))
    every = [i.index for i in plan.instances]
    assert every == sorted(set(every)), "instances numbered across the host, entries in order, none twice"
    for m in plan.models:  # from the entry's first GPU's place: the others' changes do not renumber it
        assert m.plan.instances[0].index == m.gpus[0]
    assert len({i.port for i in plan.instances}) == len(every)
    used = [g for i in plan.instances for g in i.gpus]
    assert len(used) == len(set(used)), "no GPU serves two instances"
    for text in case.warnings:
        assert any(text in w for w in plan.warnings), plan.warnings
    assert plan.idle_gpus == case.idle


def test_an_entrys_arithmetic_is_a_one_model_host_of_its_gpus() -> None:
    """The 70B entry on GPUs 0-3 of an 8-GPU host plans exactly as a 4-GPU host serving it alone."""
    plan = plan_of(data(H100x8, [{"model": L70, "gpus": 4, "weights": "fp8"}, {"model": L8, "gpus": 4}]))
    alone = host_spec("inv.py", "h1", (), {"model": L70, "workload": CHAT, "weights": "fp8",
                                           "gpu": {**H100x8, "count": 4}})  # fmt: skip
    assert alone.gpu is not None
    one = plan_host(alone, alone.gpu.host_gpus(), load_model(L70))
    entry = plan.models[0].plan
    assert [i.memory for i in entry.instances] == [i.memory for i in one.instances]
    assert [i.flags for i in entry.instances] == [i.flags for i in one.instances]
    assert entry.notes == one.notes and entry.weight_bytes == one.weight_bytes
    # the 8B entry: GPUs 4-7, numbered after the 70B's instances, the same arithmetic as GPUs 0-3 alone
    small = host_spec("inv.py", "h1", (), {"model": L8, "workload": CHAT, "gpu": {**H100x8, "count": 4}})
    assert small.gpu is not None
    four = plan_host(small, small.gpu.host_gpus(), load_model(L8))
    assert [i.memory for i in plan.models[1].plan.instances] == [i.memory for i in four.instances]


def test_ranges_are_contiguous_in_order_and_a_quarantined_gpu_keeps_its_place() -> None:
    spec = host_spec("inv.py", "h1", (), data(H100x8, [{"model": L8, "gpus": 3}, {"model": M7, "gpus": 5}]))
    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 8)
    assert [r for _, r in entry_gpus(spec, gpus)] == [(0, 1, 2), (3, 4, 5, 6, 7)]
    held = subset(gpus, [0, 1, 2, 4, 5, 6, 7])  # GPU 3 quarantined (``usable_gpus``)
    assert [r for _, r in entry_gpus(spec, held)] == [(0, 1, 2), (3, 4, 5, 6, 7)]
    plan = plan_models(spec, held, [(load_model(L8), None), (load_model(M7), None)])
    assert [list(i.gpus) for i in plan.models[1].plan.instances] == [[4], [5], [6], [7]]


# -- the inventory ----------------------------------------------------------------------------------

TWO = [{"model": L70, "gpus": 4}, {"model": L8, "gpus": 4}]
BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("both keys", {**data(H100x8, TWO), "model": L8}, "model", "either model (one model) or models"),
    (
        "counts over the host",
        data(H100x8, [{"model": L70, "gpus": 6}, {"model": L8, "gpus": 4}]),
        "models",
        "the entries' gpus add up to 10, more than the host's 8 (gpu.count)",
    ),
    ("an entry without model", data(H100x8, [{"gpus": 4}, TWO[1]]), "models[0].model", "required: a Hugging Face"),
    (
        "an unknown key in an entry",
        data(H100x8, [TWO[0], {**TWO[1], "wieghts": "fp8"}]),
        "models[1].wieghts",
        "did you mean 'weights'?",
    ),
    (
        "a host-wide key in an entry",
        data(H100x8, [{**TWO[0], "port": 9000}, TWO[1]]),
        "models[0].port",
        "a key of the whole host, not of one model: set it beside models",
    ),
    (
        "a bad value of an entry's own key, named under its entry",
        data(H100x8, [TWO[0], {**TWO[1], "weights": "fp7"}]),
        "models[1].weights",
        "'auto', 'bf16', 'fp16', 'fp8', 'int8' or 'int4'",
    ),
    ("gpus as text", data(H100x8, [TWO[0], {**TWO[1], "gpus": "4"}]), "models[1].gpus", "a whole number from 1"),
    ("gpus missing", data(H100x8, [TWO[0], {"model": L8}]), "models[1].gpus", "required: a whole number"),
    ("no entries", data(H100x8, []), "models", "1 to 64 entries"),
    ("an entry that is no dict", data(H100x8, [TWO[0], L8]), "models[1]", "must be a dict"),
    (
        "the same served name twice",
        data(H100x8, [{"model": L8, "gpus": 4}, {"model": L8, "gpus": 4}]),
        "models[1].served_model_name",
        "entry models[0] is served under that name too",
    ),
    (
        "with multi_node",
        data(H100x8, TWO, multi_node=True),
        "multi_node",
        "instances spanning hosts serve one model",
    ),
    (
        "with LoRA adapters",
        data(H100x8, TWO, max_lora_rank=16),
        "max_lora_rank",
        "only read with lora_adapters, which a host with models cannot have yet",
    ),
    (
        "with a Hub mirror as the model source",
        data(H100x8, TWO, model_source={"kind": "hub", "endpoint": "http://127.0.0.1:9/"}),
        "model_source.kind",
        "a Hub mirror is read for one model per host yet",
    ),
    (
        "no workload anywhere",
        {"gpu": H100x8, "models": TWO},
        "models[0].workload",
        "required: {p95_input_tokens",
    ),
    (
        "one balancer frontend for two backends",
        data(H100x8, TWO, balancer={"kind": "haproxy", "on": "local", "bind": "127.0.0.1:8080"}),
        "models[1].balancer.bind",
        "give each model's balancer its own bind",
    ),
]


@pytest.mark.parametrize(("raw", "fld", "text"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_models_input_is_refused_naming_host_field_and_value(raw: dict[str, Any], fld: str, text: str) -> None:
    with pytest.raises(InventoryError) as exc:
        host_spec("inv.py", "h1", (), raw)
    found = {p.field: p for p in exc.value.problems}
    assert fld in found, [str(p) for p in exc.value.problems]
    assert text in found[fld].allowed and found[fld].host == "h1" and found[fld].inventory == "inv.py"
    assert len({(p.field, p.allowed) for p in exc.value.problems}) == len(exc.value.problems), "each problem once"


def test_an_entrys_own_workload_and_keys_override_the_hosts() -> None:
    spec = host_spec(
        "inv.py",
        "h1",
        (),
        data(H100x8, [{"model": L70, "gpus": 4, "workload": {**CHAT, "target_concurrency": 8}}, TWO[1]], port=9000),
    )
    a, b = spec.model_specs
    assert a.workload.target_concurrency == 8 and b.workload.target_concurrency == 64
    assert a.port == b.port == 9000 and spec.model == L70 and [m.gpus for m in spec.models] == [4, 4]


def inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    rows = [(name, {"ssh_hostname": f"127.0.250.{i + 3}", **d}) for i, (name, d) in enumerate(hosts.items())]
    path = tmp_path / "fleet.py"
    path.write_text(f"gpus = {rows!r}\n")
    return path


def test_a_missing_model_config_of_any_entry_is_found_when_the_inventory_is_loaded(tmp_path: Path) -> None:
    path = inventory(tmp_path, {"h1": data(H100x8, [TWO[0], {"model": "no-such-org/no-such-model", "gpus": 2}])})
    with pytest.raises(InventoryError) as exc:
        load_for_planning(path)
    assert [(p.field, p.value) for p in exc.value.problems] == [("models[1].model", "no-such-org/no-such-model")]


def facts(name: str) -> HostFacts:
    raw = json.loads((REPO / "tests" / "fixtures" / "probe" / f"{name}.json").read_text())
    return NvmlProbe().process(raw["output"])


def test_a_probed_host_with_fewer_gpus_than_the_entries_want_is_refused_at_plan_time(tmp_path: Path) -> None:
    path = inventory(tmp_path, {"h1": data(None, [{"model": L8, "gpus": 1}, {"model": M7, "gpus": 2}])})
    fleet = build_fleet_plan(load_for_planning(path), {"h1": facts("rtx4090-2")}, deploy=True)
    outcome = fleet.host("h1")
    assert outcome.plan is None and outcome.problem is not None
    assert "models: the entries' gpus add up to 3, but the host has 2 GPU(s) (probe)" in outcome.problem.summary
    assert fleet.instances() == []


def test_the_fleet_plan_lists_each_instance_with_its_model_and_served_name(tmp_path: Path) -> None:
    models = [{"model": L8, "gpus": 1, "served_model_name": "eight"}, {"model": M7, "gpus": 1}]
    path = inventory(tmp_path, {"h1": data(None, models), "h2": {"model": L8, "workload": CHAT}})
    fleet = build_fleet_plan(load_for_planning(path), {"h1": facts("rtx4090-2"), "h2": facts("rtx4090-2")})
    got = [(i.host, i.name, i.port, i.served_name, i.spec.model, i.placements[0].gpus) for i in fleet.instances()]
    assert got == [
        ("h1", "vllm-0", 8000, "eight", L8, (0,)),
        ("h1", "vllm-1", 8001, M7, M7, (1,)),
        ("h2", "vllm-0", 8000, L8, L8, (0,)),
        ("h2", "vllm-1", 8001, L8, L8, (1,)),
    ]
    shown = outcome_data(fleet.host("h1"))
    assert [(m["entry"], m["model"], m["served_name"], m["gpus"], m["instances"]) for m in shown["models"]] == [
        (0, L8, "eight", [0], [0]),
        (1, M7, M7, [1], [1]),
    ]
    assert [(i["model"], i["served_name"]) for i in shown["instances"]] == [(L8, "eight"), (M7, M7)]
    assert "models" not in outcome_data(fleet.host("h2")), "a one-model host's --json is unchanged"


# -- render, revisions, balancer ----------------------------------------------------------------------

L40S = {"sku": "l40s-48gb", "count": 4}
QWEN = str(REPO / "tests" / "fixtures" / "models" / "qwen2.5-7b")
INDEX = "http://127.0.0.1:3141/simple"


def part_of(models: list[dict[str, Any]], weights: tuple[tuple[str, str], ...] = ()) -> Any:
    from fleet.render.part import host_part
    from fleet.render.units import HostPaths

    spec = host_spec("inv.py", "h1", (), data(L40S, models, pip_index_url=INDEX))
    archs = [(load_model(m.model, m.model_config), None) for m in spec.model_specs]
    assert spec.gpu is not None
    return host_part(spec, plan_models(spec, spec.gpu.host_gpus(), archs), HostPaths(), weights=weights)


BEFORE = [{"model": L8, "gpus": 2, "served_model_name": "eight"}, {"model": M7, "gpus": 2}]


def ids(part: Any) -> dict[str, str]:
    return {r.instance: r.id for r in part.revisions}


def test_each_instance_is_rendered_with_its_own_model_and_served_name() -> None:
    part = part_of(BEFORE, weights=((L8, "aaa111"), (M7, "bbb222")))
    units = {f.path.rsplit("/", 1)[1]: f.content for f in part.files if f.path.endswith(".service")}
    envs = {f.path.rsplit("/", 1)[1]: f.content for f in part.files if f.path.endswith(".env")}
    assert sorted(units) == [f"fleet-vllm-{n}.service" for n in range(4)]
    for n, (model, served) in enumerate([(L8, "eight"), (L8, "eight"), (M7, M7), (M7, M7)]):
        unit = units[f"fleet-vllm-{n}.service"]
        assert f"ExecStart=/opt/fleet/vllm/bin/vllm serve {model}" in unit
        assert f"--served-model-name {served}" in unit and f"--port {8000 + n}" in unit
        assert f"Description=vLLM {model} (instance {n}, GPUs {n})" in unit
        snapshot = "aaa111" if model == L8 else "bbb222"
        other = "bbb222" if model == L8 else "aaa111"
        assert snapshot in envs[f"vllm-{n}.env"] and other not in envs[f"vllm-{n}.env"]
    assert [(r.instance, r.served_model) for r in part.revisions] == [
        ("vllm-0", "eight"), ("vllm-1", "eight"), ("vllm-2", M7), ("vllm-3", M7),
    ]  # fmt: skip
    assert part.served == f"eight, {M7}"
    again = part_of(BEFORE, weights=((L8, "aaa111"), (M7, "bbb222")))
    assert [(f.path, f.content) for f in again.files] == [(f.path, f.content) for f in part.files]


CHANGES = [
    (
        "the first entry's model",
        [{"model": "Qwen/Qwen2.5-7B-Instruct", "gpus": 2, "model_config": QWEN}, BEFORE[1]],
        {"vllm-0", "vllm-1"},
    ),
    (
        "the second entry's model",
        [BEFORE[0], {"model": "Qwen/Qwen2.5-7B-Instruct", "gpus": 2, "model_config": QWEN}],
        {"vllm-2", "vllm-3"},
    ),
    ("the second entry's served name", [BEFORE[0], {**BEFORE[1], "served_model_name": "seven"}], {"vllm-2", "vllm-3"}),
    ("the first entry's KV cache dtype", [{**BEFORE[0], "kv_cache_dtype": "fp8"}, BEFORE[1]], {"vllm-0", "vllm-1"}),
    (
        "the first entry's tensor parallel size (one instance fewer, the other entry not renumbered)",
        [{**BEFORE[0], "tensor_parallel_size": 2, "allow_pcie_tensor_parallel": True}, BEFORE[1]],
        {"vllm-0", "vllm-1"},
    ),
]


@pytest.mark.parametrize(("models", "changed"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_change_to_one_entry_is_a_new_revision_of_its_instances_only(
    models: list[dict[str, Any]], changed: set[str]
) -> None:
    """Configuration revisions are per instance (``fleet.render.revision``): the rollout restarts
    the instances whose revision changed, so only the changed entry's."""
    before, after = ids(part_of(BEFORE)), ids(part_of(models))
    differ = {i for i in before.keys() | after.keys() if before.get(i) != after.get(i)}
    assert differ == changed


def test_a_new_snapshot_of_one_model_is_a_new_revision_of_its_instances_only() -> None:
    before = ids(part_of(BEFORE, weights=((L8, "aaa111"), (M7, "bbb222"))))
    after = ids(part_of(BEFORE, weights=((L8, "aaa111"), (M7, "ccc333"))))
    assert {i for i in before if before[i] != after[i]} == {"vllm-2", "vllm-3"}


def test_lb_export_has_a_backend_per_model_with_its_instances(tmp_path: Path) -> None:
    from fleet.lb.config import fleet_configs, render_config

    models = [
        {**BEFORE[0], "balancer": {"kind": "haproxy", "on": "local", "bind": "127.0.0.1:8080"}},
        {**BEFORE[1], "balancer": {"kind": "haproxy", "on": "local", "bind": "127.0.0.1:8081"}},
    ]
    path = inventory(tmp_path, {"h1": data(L40S, models)})
    loaded = load_for_planning(path)
    fleet = build_fleet_plan(loaded)
    (config,) = fleet_configs(loaded, {o.spec.name: o.plan for o in fleet.hosts})
    got = [(b.name, b.bind, [s.name for s in b.servers]) for b in config.backends]
    assert got == [
        ("eight", "127.0.0.1:8080", ["h1:vllm-0", "h1:vllm-1"]),
        ("mistralai_Mistral-7B-Instruct-v0.3", "127.0.0.1:8081", ["h1:vllm-2", "h1:vllm-3"]),
    ]
    text = render_config(config, str(path))
    assert "backend eight" in text and "backend mistralai_Mistral-7B-Instruct-v0.3" in text


def test_rollout_model_on_a_host_with_models_says_what_to_do_instead(tmp_path: Path) -> None:
    path = inventory(tmp_path, {"h1": data(L40S, BEFORE)})
    with pytest.raises(InventoryError) as exc:
        load_for_planning(path, overrides={"model": M7, "model_config": None})
    (problem,) = exc.value.problems
    assert problem.field == "model" and problem.value == M7 and problem.inventory == "(command line)"
    assert "change the model of the entry you mean in the inventory (models[N].model)" in problem.allowed


def test_fleet_plan_shows_each_model_with_its_gpus_instances_and_reasons(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    models = [{"model": L70, "gpus": 4, "weights": "fp8"}, {"model": L8, "gpus": 4, "served_model_name": "small"}]
    path = inventory(tmp_path, {"mixed": data(H100x8, models)})
    env = {**os.environ, "COLUMNS": "120"}
    table = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "plan", "--offline", str(path)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert f"models[0] {L70}" in out and "GPUs 0-3" in out and "weights fp8" in out
    assert f"models[1] {L8}" in out and "served as small" in out and "GPUs 4-7" in out
    assert "instance 4: GPUs [4]" in out and "port 8004" in out and "base port 8000 + instance 4" in out
    assert "online FP8" in out  # the 70B's own weights reason, under its entry
    bad = inventory(tmp_path, {"mixed": data(H100x8, [{"model": L70, "gpus": 6}, {"model": L8, "gpus": 4}])})
    refused = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "plan", "--offline", str(bad)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the entries' gpus add up to 10, more than the host's 8" in refused.stdout + refused.stderr


def test_a_secret_in_an_entry_is_refused_under_its_entry_and_never_echoed() -> None:
    token = "sk-proj-" + "A1b2C3d4" * 6
    entries = [{**TWO[0], "api_key": token}, {**TWO[1], "served_model_name": token}, {**TWO[1], token: 1}]
    with pytest.raises(InventoryError) as exc:
        host_spec("inv.py", "h1", (), data(H100x8, entries))
    fields = [p.field for p in exc.value.problems]
    assert {"models[0].api_key", "models[1].served_model_name", "models[2].<a field name>"} <= set(fields)
    assert token not in str(exc.value) and all(p.secret for p in exc.value.problems if p.field.startswith("models["))


# -- what the other commands take from a host with models ------------------------------------------


def test_an_entrys_extra_flag_is_checked_against_vllm_and_named_under_its_entry(tmp_path: Path) -> None:
    """An entry's key replaces the host's whole (``vllm_extra_args`` too); the others inherit it."""
    models = [
        {**TWO[0], "vllm_extra_args": {"--enforce-eagre": True}},
        {"model": L8, "gpus": 2},
        {"model": M7, "gpus": 2},
    ]
    path = inventory(tmp_path, {"h1": data(H100x8, models, vllm_extra_args={"--swap-space": 4})})
    with pytest.raises(InventoryError) as exc:
        load_for_planning(path)
    fields = sorted(p.field for p in exc.value.problems)
    assert fields == ["models[0].vllm_extra_args.--enforce-eagre", "vllm_extra_args.--swap-space"], fields
    problems = {p.field: p for p in exc.value.problems}
    assert "did you mean '--enforce-eager'" in problems["models[0].vllm_extra_args.--enforce-eagre"].allowed


def test_stage_prune_status_and_balancer_seats_see_every_model(tmp_path: Path) -> None:
    from fleet.lb.traffic import balancer_of
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.weights.prune import planned_models
    from fleet.weights.stage import jobs_for

    source = tmp_path / "models"
    for model in (L8, M7):
        (source / model).mkdir(parents=True)
        (source / model / "config.json").write_text((REPO / "fleet/data/models" / model / "config.json").read_text())
    b = {"kind": "haproxy", "on": "local"}
    models = [
        {"model": L8, "gpus": 2, "served_model_name": "eight", "balancer": {**b, "bind": "127.0.0.1:8080"}},
        {"model": M7, "gpus": 2, "balancer": {**b, "bind": "127.0.0.1:8081"}},
    ]
    raw = data(L40S, models, model_source={"kind": "dir", "path": str(source)})
    loaded = load_for_planning(inventory(tmp_path, {"h1": raw}))
    spec = loaded.host("h1")
    assert [(j.model, j.source) for j in jobs_for(loaded)] == [(L8, str(source)), (M7, str(source))]
    assert planned_models(spec) == (L8, M7)
    fleet = build_fleet_plan(loaded)
    targets = targets_from_outcomes(fleet.hosts, loaded)
    assert [(t.index, t.model) for t in targets] == [(0, "eight"), (1, "eight"), (2, M7), (3, M7)]
    seat = balancer_of(spec, "eight")
    assert seat is not None and (seat.backend, seat.bind) == ("eight", "127.0.0.1:8080")
    seat = balancer_of(spec, M7)
    assert seat is not None and seat.bind == "127.0.0.1:8081"
    assert balancer_of(spec, "no-such-model") is None
