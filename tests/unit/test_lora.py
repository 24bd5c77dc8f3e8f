"""``lora_adapters``: validated in the one schema, planned with vLLM 0.33's LoRA slot arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError, PlanError
from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.extra_args import parse_extra_args
from fleet.plan.lora import lora_bytes
from fleet.plan.planner import plan_host
from fleet.plan.vllm_surface import parse_serve_argv
from tests.unit.conftest import spec

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def adapter(root: Path, name: str, r: int = 16, base: str | None = LLAMA, **more: Any) -> str:
    """A PEFT adapter directory (``adapter_config.json`` and a weights file) under ``root``."""
    d = root / name
    d.mkdir(parents=True)
    config: dict[str, Any] = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "bias": "none",
                              "target_modules": ["q_proj", "v_proj"], **more}  # fmt: skip
    if base is not None:
        config["base_model_name_or_path"] = base
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return str(d)


def src(path: str) -> dict[str, str]:
    return {"kind": "dir", "path": path}


def problems(**data: Any) -> list[tuple[str, object, str]]:
    with pytest.raises(InventoryError) as info:
        spec(**data)
    return [(p.field, p.value, p.allowed) for p in info.value.problems]


def h100(count: int = 1) -> HostGpus:
    return HostGpus.from_catalogue("h100-sxm-80gb", count)


# -- the arithmetic, against the buffers vLLM 0.33 allocated (tests/oracle/test_lora_vs_vllm.py) ---------


@pytest.mark.parametrize(
    ("tp", "layer", "embeddings"),
    [
        # Llama-3.1-8B, rank 16, 2 slots: q/k/v 1,179,648 + o 524,288 + gate/up 2,359,296 + down 1,179,648
        # at TP 1; 983,040 + 393,216 + 1,441,792 + 720,896 at TP 2 (vLLM's create_lora_weights, on CPU)
        (1, 5242880, 16941056),
        (2, 3538944, 16941056),
    ],
)
def test_llama_slots_are_the_buffers_vllm_allocates(tp: int, layer: int, embeddings: int) -> None:
    assert lora_bytes(load_model(LLAMA), tp, 16, 2) == (layer, embeddings)


def test_slots_grow_with_rank_and_slots_and_shrink_the_kv_cache(tmp_path: Path) -> None:
    small = spec(lora_adapters={"sql": src(adapter(tmp_path, "sql", r=8))})
    big = spec(lora_adapters={"sql": src(adapter(tmp_path, "big", r=8))}, max_lora_rank=256, max_loras=8)
    none = plan_host(spec(), h100(), load_model(LLAMA)).instances[0].memory
    a = plan_host(small, h100(), load_model(LLAMA)).instances[0].memory
    b = plan_host(big, h100(), load_model(LLAMA)).instances[0].memory
    assert a.lora is not None and b.lora is not None
    assert b.lora.bytes_per_gpu == a.lora.bytes_per_gpu * (256 // 8) * 8
    assert a.weights - none.weights == a.lora.bytes_per_gpu
    assert none.kv_tokens > a.kv_tokens > b.kv_tokens
    assert b.lora.bytes_per_gpu > 11 * 2**30  # 8 slots of rank 256 on an 8B model: ~11.5 GiB per GPU


def test_qwen2_has_no_embedding_slots() -> None:
    layer, emb = lora_bytes(load_model("Qwen/Qwen2.5-72B-Instruct"), 8, 16, 1)
    assert layer > 0 and emb == 0


# -- the plan's flags ------------------------------------------------------------------------------


def test_plan_flags_and_reasons(tmp_path: Path) -> None:
    s = spec(lora_adapters={"sql": src(adapter(tmp_path, "sql", r=16)), "chat": src(adapter(tmp_path, "c", r=32))})
    plan = plan_host(s, h100(), load_model(LLAMA))
    inst = plan.instances[0]
    argv = inst.argv
    i = argv.index("--lora-modules")
    assert argv[i + 1 : i + 3] == ["sql=fleet-lora/sql", "chat=fleet-lora/chat"]
    flags = {f.option: f for f in inst.flags}
    assert flags["--max-lora-rank"].value == "32" and "smallest rank vLLM takes" in flags["--max-lora-rank"].reason
    assert flags["--max-loras"].value == "2" and flags["--max-cpu-loras"].value == "2"
    assert "GiB per GPU" in flags["--enable-lora"].reason
    assert any(n.startswith("LoRA adapters (sql, chat)") for n in plan.notes)
    ns = parse_serve_argv(argv, "0.33.0")
    assert ns.max_lora_rank == 32 and ns.enable_lora is True


def test_set_values_are_kept_and_said(tmp_path: Path) -> None:
    s = spec(lora_adapters={"sql": src(adapter(tmp_path, "sql"))}, max_lora_rank=64, max_loras=1, max_cpu_loras=4)
    flags = {f.option: f for f in plan_host(s, h100(), load_model(LLAMA)).instances[0].flags}
    assert (flags["--max-lora-rank"].value, flags["--max-loras"].value, flags["--max-cpu-loras"].value) == (
        "64", "1", "4",
    )  # fmt: skip
    assert flags["--max-lora-rank"].reason.startswith("inventory max_lora_rank")


# -- bad input, before any host ---------------------------------------------------------------------


def test_rank_above_max_lora_rank_is_refused(tmp_path: Path) -> None:
    (found,) = problems(lora_adapters={"sql": src(adapter(tmp_path, "sql", r=64))}, max_lora_rank=16)
    assert found[0] == "lora_adapters.sql.path"
    assert "rank 64" in found[2] and "raise max_lora_rank to 64" in found[2]


def test_rank_pattern_counts(tmp_path: Path) -> None:
    path = adapter(tmp_path, "sql", r=8, rank_pattern={"q_proj": 32})
    (found,) = problems(lora_adapters={"sql": src(path)}, max_lora_rank=16)
    assert "rank 32" in found[2]


def test_adapter_for_another_model_is_refused(tmp_path: Path) -> None:
    (found,) = problems(lora_adapters={"sql": src(adapter(tmp_path, "sql", base="Qwen/Qwen2.5-7B-Instruct"))})
    assert "an adapter for Qwen/Qwen2.5-7B-Instruct" in found[2]


@pytest.mark.parametrize("base", [LLAMA, "/srv/models/meta-llama/Llama-3.1-8B-Instruct",
                                  "/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/abc", None])  # fmt: skip
def test_adapter_for_this_model_by_id_or_path_passes(tmp_path: Path, base: str | None) -> None:
    s = spec(lora_adapters={"sql": src(adapter(tmp_path, "sql", base=base))})
    assert s.lora is not None and s.lora.adapters[0].rank == 16


@pytest.mark.parametrize(
    ("data", "field", "expected"),
    [
        ({"max_lora_rank": 24}, "max_lora_rank", "must be 1, 8, 16, 32, 64, 128, 256, 320 or 512"),
        ({"max_loras": 0}, "max_loras", ""),
        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras", "must be >= max_loras (2)"),
    ],
)
def test_bad_settings(tmp_path: Path, data: dict[str, Any], field: str, expected: str) -> None:
    found = problems(lora_adapters={"sql": src(adapter(tmp_path, "sql"))}, **data)
    assert any(f == field and expected in why for f, _, why in found), found


def test_unknown_and_bad_names_and_sources(tmp_path: Path) -> None:
    found = problems(lora_adapters={"bad name": src(adapter(tmp_path, "a")), "x": {"kind": "dir", "path": "/nowhere"},
                                    "z": {"kind": "s3", "path": "/x"}})  # fmt: skip
    text = "\n".join(f"{f}: {why}" for f, _, why in found)
    assert "an adapter name of letters" in text
    assert "lora_adapters.x.path: no such directory on this machine" in text
    assert "lora_adapters.z.kind" in text
    (empty,) = problems(lora_adapters={"y": src(str(tmp_path))})
    assert empty[0] == "lora_adapters.y.path" and empty[2].startswith("holds no adapter_config.json")


def test_settings_without_adapters_are_refused() -> None:
    (found,) = problems(max_lora_rank=16)
    assert found[0] == "max_lora_rank" and "only read with lora_adapters" in found[2]


def test_adapter_named_like_the_model_and_bias_are_refused(tmp_path: Path) -> None:
    found = problems(served_model_name="chat", lora_adapters={"chat": src(adapter(tmp_path, "c", bias="all"))})
    text = " ".join(why for _, _, why in found)
    assert "the served model's own name" in text and "Adapter bias is not supported" in text


def test_moe_models_are_refused_with_the_way_out(tmp_path: Path) -> None:
    s = spec(
        model="/x/Qwen3-30B-A3B",
        model_config="tests/fixtures/models/qwen3-30b-a3b",
        lora_adapters={"sql": src(adapter(tmp_path, "sql", base=None))},
    )
    with pytest.raises(PlanError, match=r"mixture-of-experts(.|\n)*remove lora_adapters"):
        plan_host(s, h100(2), load_model(s.model, s.model_config))


def test_extra_lora_flags_point_to_the_keys() -> None:
    parsed = parse_extra_args((("--max-loras", 4), ("--lora-modules", "a=/x")), "0.33.0")
    assert [p[2] for p in parsed.problems] == [
        "--max-loras is planned by fleet: set max_loras (with lora_adapters) instead",
        "--lora-modules is planned by fleet: set lora_adapters (each adapter staged to the hosts like a model) instead",
    ]


# -- staging: adapters like models ---------------------------------------------------------------


def test_an_adapters_manifest_is_its_own_directory(tmp_path: Path) -> None:
    from fleet.errors import FleetError
    from fleet.weights.manifest import build_manifest

    path = adapter(tmp_path, "sql")
    m = build_manifest(path, "fleet-lora/sql", directory=path, marker="adapter_config.json")
    assert [f.path for f in m.files] == ["adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(FleetError, match=r"adapter source .*: no adapter_config\.json there"):
        build_manifest(str(tmp_path), "fleet-lora/x", directory=str(tmp_path), marker="adapter_config.json")


def test_a_hosts_adapters_are_staged_after_its_model_and_told_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.facts.sshlink import SshTarget
    from fleet.weights import stage as stage_mod
    from fleet.weights.stage import StageJob, StageResult, stage_all

    rounds: list[list[tuple[str, str]]] = []

    def fake(jobs: list[StageJob], **_: Any) -> dict[str, StageResult]:
        rounds.append([(j.target.name, j.model) for j in jobs])
        out = {}
        for j in jobs:
            bad = (j.target.name, j.model) == ("h2", "org/m")
            status, error = ("failed", "disk") if bad else ("staged", None)
            out[j.target.name] = StageResult(j.target.name, j.model, status, "rev", 1, 10, error=error)
        return out

    monkeypatch.setattr(stage_mod, "stage", fake)
    h1, h2 = SshTarget("h1", "127.0.0.1"), SshTarget("h2", "127.0.0.2")
    jobs = [
        StageJob(h1, "org/m", "/src"), StageJob(h1, "fleet-lora/a", "/a", directory="/a"),
        StageJob(h1, "fleet-lora/b", "/b", directory="/b"), StageJob(h2, "org/m", "/src"),
        StageJob(h2, "fleet-lora/a", "/a", directory="/a"),
    ]  # fmt: skip
    out = stage_all(jobs)
    assert rounds == [[("h1", "org/m"), ("h2", "org/m")], [("h1", "fleet-lora/a")], [("h1", "fleet-lora/b")]]
    assert (out["h1"].status, out["h1"].model, out["h1"].sent_bytes) == (
        "staged", "org/m, fleet-lora/a, fleet-lora/b", 30,
    )  # fmt: skip
    assert (out["h2"].status, out["h2"].model, out["h2"].error) == ("failed", "org/m", "disk")  # adapter not tried
