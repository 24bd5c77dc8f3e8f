"""fleet's model arithmetic against vLLM 0.33.0's own code, on real model configs.

vLLM runs in its own environment (``scripts/oracle-env.sh`` builds ``.oracle-venv``: vLLM
0.33.0 and the torch it pins, run on CPU); fleet's test environment never gets torch or vLLM.
``tests/oracle/vllm_oracle.py`` is executed there once per session with every case, and each
test compares one of fleet's numbers with vLLM's answer: the derived max length (the largest
``--max-model-len`` accepted and the default), TP validity, the KV page per GPU, the KV-cache
groups, the blocks and the ``GPU KV cache size`` tokens for the KV budget fleet computes, and
whether one request of ``max_model_len`` fits; and for block-quantized FP8 checkpoints, at which
TP sizes on which GPU generations vLLM loads them (``fleet.model.fp8_blocks``: refused or not, in
vLLM's words, and the refined block shape). All must be equal; there is no tolerance.

Without the environment the tests skip; with ``FLEET_ORACLE_REQUIRED=1`` (CI) they fail.
Run ``python -m tests.oracle.test_vs_vllm`` to print the comparison table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fleet.gpus import Fabric, HostGpus
from fleet.inventory.spec import HostSpec, Workload
from fleet.model.arch import ModelArch, load_model
from fleet.model.fp8_blocks import fp8_blocks
from fleet.plan.multinode import Pipeline, pipeline, plan_multi_node, pp_partition
from fleet.plan.planner import batch_defaults, gpu_memory, memory_math, resolve_precision

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
ORACLE = Path(__file__).with_name("vllm_oracle.py")


@dataclass(frozen=True)
class Case:
    model: str  #: fixture directory
    tp: int
    kv_cache_dtype: str  #: "auto" or "fp8"
    max_model_len: int
    sku: str = "h100-sxm-80gb"
    utilization: float = 0.90

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}-{self.kv_cache_dtype}-{self.max_model_len}"


CASES = [
    Case("llama-3.1-8b", 1, "auto", 8192),
    Case("llama-3.1-8b", 2, "fp8", 131072),
    Case("qwen2.5-7b", 1, "auto", 32768),
    Case("qwen2.5-7b", 4, "auto", 16384),
    Case("qwen2.5-7b", 7, "auto", 4096),  # 28 heads divide by 7, 4 KV heads do not
    Case("qwen3-30b-a3b", 2, "auto", 32768),
    Case("mixtral-8x7b", 2, "auto", 32768),
    Case("deepseek-v2-lite", 1, "fp8", 65536),
    Case("deepseek-v2-lite", 2, "auto", 16384),
    Case("gemma-2-9b", 1, "auto", 2560),
    Case("gemma-2-9b", 2, "auto", 8192),
    Case("gemma-3-27b", 2, "auto", 2560),
    Case("gemma-3-27b", 4, "auto", 32768),
    Case("gemma-3-27b", 2, "fp8", 131072),
    Case("mistral-7b-v0.1", 1, "auto", 32768),
    Case("mistral-7b-v0.1", 1, "auto", 2048),
    Case("phi-3-128k", 1, "auto", 16384),
    Case("vicuna-7b-16k", 1, "auto", 16384),
    Case("llama-2-7b-dynamic", 1, "auto", 8192),
    Case("llama-4-scout", 8, "auto", 65536),
    Case("llama-4-scout", 3, "auto", 8192),  # 40 heads not divisible by 3
    Case("qwen3-30b-a3b-fp8", 2, "auto", 32768),
    Case("qwen3-4b-fp8", 4, "auto", 16384),
]
TP_SWEEP = [1, 2, 3, 4, 5, 6, 7, 8, 16]
#: Block-quantized FP8 checkpoints, the TP sizes and the GPU generations their verdict is asked for:
#: Hopper (H100, H200), Ada (L40S, RTX 4090), Ampere (A100; A10, RTX A6000).
FP8_MODELS = ["qwen3-30b-a3b-fp8", "qwen3-4b-fp8"]
FP8_TPS = [1, 2, 4, 8, 16]
CAPABILITIES = [(9, 0), (8, 9), (8, 0), (8, 6)]


@dataclass(frozen=True)
class PpCase:
    """An instance over ``pp`` hosts (one pipeline stage each) at TP ``tp`` on each."""

    model: str  #: fixture directory
    kind: str  #: what the model stands for: dense (MHA), GQA, MoE, MLA
    tp: int
    pp: int
    sku: str = "h100-sxm-80gb"
    max_model_len: int = 4096

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}-pp{self.pp}"


PP_CASES = [
    PpCase(model, kind, tp, pp)
    for model, kind, tp in [
        ("vicuna-7b-16k", "dense", 1),
        ("llama-3.1-8b", "GQA", 2),
        ("qwen3-30b-a3b", "MoE", 1),
        ("mixtral-8x7b", "MoE", 2),
        ("deepseek-v2-lite", "MLA", 1),
    ]
    for pp in (2, 3)
]


def pp_spec(case: PpCase, name: str = "n0") -> HostSpec:
    return HostSpec(
        name, "inv.py", ("pool",), str(FIXTURES / case.model), Workload(case.max_model_len - 512, 512, 0.0, 1),
        multi_node=True, pipeline_parallel_size=case.pp, tensor_parallel_size=case.tp,
    )  # fmt: skip


def fleet_pipeline(case: PpCase) -> Pipeline:
    a = arch(case.model)
    spec = pp_spec(case)
    gpus = HostGpus.from_catalogue(case.sku, case.tp, Fabric.SWITCH if case.tp > 1 else None)
    found = pipeline(spec, gpus, a, resolve_precision(spec, a), case.pp, case.tp, False)
    assert found is not None and found.fits, case
    return found


def fleet_argvs(case: PpCase) -> list[list[str]]:
    """Every node's ``vllm serve`` argv, as fleet plans the instance over ``pp`` hosts."""
    members = [pp_spec(case, f"n{r}") for r in range(case.pp)]
    gpus = HostGpus.from_catalogue(case.sku, case.tp, Fabric.SWITCH if case.tp > 1 else None)
    plans = plan_multi_node(members, dict.fromkeys((m.name for m in members), gpus), arch(case.model),
                            {m.name: f"10.0.0.{r + 1}" for r, m in enumerate(members)})  # fmt: skip
    return [plans[m.name].instances[0].argv for m in members]


def fp8_key(model: str, tp: int, capability: tuple[int, int]) -> str:
    return f"{model}-fp8-tp{tp}-sm{capability[0]}{capability[1]}"


def oracle_python() -> Path | None:
    explicit = os.environ.get("FLEET_ORACLE_PYTHON")
    if explicit:
        return Path(explicit)
    local = ROOT / ".oracle-venv" / "bin" / "python"
    return local if local.exists() else None


@cache
def arch(model: str) -> ModelArch:
    return load_model(str(FIXTURES / model))


def fleet_numbers(case: Case) -> dict[str, Any]:
    """What fleet's planner says for this case (per GPU)."""
    a = arch(case.model)
    gpus = HostGpus.from_catalogue(case.sku, max(case.tp, 1))
    kv_bytes = 1 if case.kv_cache_dtype == "fp8" else a.dtype_bytes
    weights = int(a.parameters * a.dtype_bytes) // case.tp
    m = memory_math(a, weights * case.tp, case.tp, gpu_memory(gpus, 0), case.utilization, case.max_model_len,
                    kv_bytes, batch_defaults(gpus), case.max_model_len)  # fmt: skip
    assert m.kv_layout is not None
    return {
        "kv_budget": m.kv_budget,
        "max_num_batched_tokens": batch_defaults(gpus)[0],
        "page_bytes": a.page_bytes(case.tp, kv_bytes),
        "bytes_per_block": m.kv_layout.bytes_per_block,
        "num_groups": len(m.kv_layout.groups),
        "num_blocks": m.kv_blocks,
        "kv_tokens": m.kv_tokens,
        "fits": m.one_request_fits,
        "kv_bytes_per_token": m.kv_bytes_per_token,
    }


@cache
def oracle_answers() -> dict[str, dict[str, Any]]:
    python = oracle_python()
    if python is None:
        if os.environ.get("FLEET_ORACLE_REQUIRED"):
            pytest.fail("FLEET_ORACLE_REQUIRED is set but no oracle environment: run scripts/oracle-env.sh")
        pytest.skip("no vLLM oracle environment (.oracle-venv); scripts/oracle-env.sh builds it")
    requests: list[dict[str, Any]] = []
    keys: list[str] = []
    for case in CASES:
        a = arch(case.model)
        ok = a.tp_problem(case.tp) is None
        numbers = fleet_numbers(case) if ok else {"kv_budget": 1, "max_num_batched_tokens": 8192}
        requests.append(
            {
                "model_dir": str(FIXTURES / case.model),
                "tp": case.tp,
                "kv_cache_dtype": case.kv_cache_dtype,
                "max_model_len": case.max_model_len,
                "available_memory": numbers["kv_budget"],
                "max_num_batched_tokens": numbers["max_num_batched_tokens"],
                "fleet_limit": a.max_model_len,
            }
        )
        keys.append(case.id)
    for model in sorted({c.model for c in CASES}):
        for tp in TP_SWEEP:
            requests.append(
                {
                    "model_dir": str(FIXTURES / model),
                    "tp": tp,
                    "kv_cache_dtype": "auto",
                    "max_model_len": 1024,
                    "available_memory": 1 << 34,
                    "max_num_batched_tokens": 8192,
                    "fleet_limit": arch(model).max_model_len,
                    "tp_only": True,
                }
            )
            keys.append(f"{model}-sweep-tp{tp}")
    for model in FP8_MODELS:
        for tp in FP8_TPS:
            for capability in CAPABILITIES:
                requests.append({"model_dir": str(FIXTURES / model), "tp": tp, "fp8_blocks": list(capability)})
                keys.append(fp8_key(model, tp, capability))
    for pp_case in PP_CASES:
        p = fleet_pipeline(pp_case)
        requests.append(
            {
                "model_dir": str(FIXTURES / pp_case.model),
                "tp": pp_case.tp,
                "pp": pp_case.pp,
                "kv_cache_dtype": "auto",
                "max_model_len": pp_case.max_model_len,
                "available_memory": [s.memory.kv_budget for s in p.stages],
                "max_num_batched_tokens": p.stages[0].memory.in_flight_tokens // 2,
            }
        )
        keys.append(pp_case.id)
    requests.append({"argvs": [argv for c in PP_CASES for argv in fleet_argvs(c)]})
    keys.append("argvs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "VLLM"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [str(python), str(ORACLE)], input=json.dumps(requests), capture_output=True, text=True, env=env,
        timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"the vLLM oracle failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    answers = json.loads(done.stdout)
    return dict(zip(keys, answers, strict=True))


def answer(key: str) -> dict[str, Any]:
    got = oracle_answers()[key]
    assert "oracle_error" not in got, got.get("trace")
    return got


@pytest.mark.parametrize("model", sorted({c.model for c in CASES}))
def test_derived_max_len_is_vllms(model: str) -> None:
    got = answer(f"{model}-sweep-tp1")
    a = arch(model)
    assert got["accepts_fleet_limit"], f"vLLM refuses fleet's limit {a.max_model_len}"
    assert not got["accepts_fleet_limit_plus_one"], f"vLLM accepts more than fleet's limit {a.max_model_len}"
    assert a.default_max_model_len == got["default_max_model_len"]


@pytest.mark.parametrize("model", sorted({c.model for c in CASES}))
@pytest.mark.parametrize("tp", TP_SWEEP)
def test_tp_validity_is_vllms(model: str, tp: int) -> None:
    got = answer(f"{model}-sweep-tp{tp}")
    assert (arch(model).tp_problem(tp) is None) == got["tp_ok"], got.get("tp_error")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kv_cache_is_vllms(case: Case) -> None:
    got = answer(case.id)
    if arch(case.model).tp_problem(case.tp) is not None:
        assert not got["tp_ok"]
        return
    mine = fleet_numbers(case)
    for key in ("page_bytes", "num_groups", "bytes_per_block", "fits"):
        assert mine[key] == got[key], (key, mine[key], got[key])
    if got["fits"]:
        assert (mine["num_blocks"], mine["kv_tokens"]) == (got["num_blocks"], got["kv_tokens"])


@pytest.mark.parametrize("model", FP8_MODELS)
@pytest.mark.parametrize("tp", FP8_TPS)
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_fp8_block_verdict_is_vllms(model: str, tp: int, capability: tuple[int, int]) -> None:
    got = answer(fp8_key(model, tp, capability))
    a = arch(model)
    assert a.tp_problem(tp) is None  # vLLM's model-level checks pass: this is the FP8 rule alone
    assert a.quantization is not None and list(a.quantization.weight_block_size or ()) == got["block"]
    mine = fp8_blocks(a, tp, capability)
    if got["refused"] is None:
        assert mine.problem is None, (mine.problem, got)
    else:
        assert mine.problem is not None and got["refused"].rstrip(".") in mine.problem, (mine.problem, got)
    assert mine.refined == (tuple(got["refined"]) if got["refined"] else None)


@pytest.mark.parametrize("case", PP_CASES, ids=[c.id for c in PP_CASES])
def test_pipeline_stages_and_kv_are_vllms(case: PpCase) -> None:
    """Per node: its layers (``get_pp_indices``) and its own KV blocks; the instance: every node's
    blocks (the smallest stage's) and the ``GPU KV cache size`` tokens."""
    got = answer(case.id)
    p = fleet_pipeline(case)
    assert [list(s.layers) for s in p.stages] == got["bounds"]
    assert [s.memory.kv_blocks for s in p.stages] == got["own_blocks"]
    assert [p.kv_blocks] * case.pp == got["num_blocks"]
    assert p.kv_tokens == got["kv_tokens"]


def test_pipeline_cases_cover_the_kinds_uneven_splits_and_unequal_stages() -> None:
    assert {c.kind for c in PP_CASES} == {"dense", "GQA", "MoE", "MLA"} and {c.pp for c in PP_CASES} == {2, 3}
    assert any(len(set(pp_partition(arch(c.model).num_layers, c.pp))) > 1 for c in PP_CASES)
    assert any(len({s.memory.kv_blocks for s in fleet_pipeline(c).stages}) > 1 for c in PP_CASES)


def test_vllms_parser_accepts_every_nodes_argv() -> None:
    parsed = answer("argvs")["parsed"]
    expected = [(c, rank) for c in PP_CASES for rank in range(c.pp)]
    assert len(parsed) == len(expected)
    for got, (case, rank) in zip(parsed, expected, strict=True):
        assert got["ok"], (case.id, rank, got)
        assert (got["nnodes"], got["node_rank"], got["pipeline_parallel_size"], got["tensor_parallel_size"]) == (
            case.pp, rank, case.pp, case.tp,
        )  # fmt: skip
        assert (got["master_addr"], got["master_port"], got["headless"]) == ("10.0.0.1", 29501, rank > 0)
        assert got["distributed_executor_backend"] == "mp"


def test_fp8_sweep_covers_each_kind_of_verdict() -> None:
    """The sweep is not vacuous: it holds accepted, refined, refused-by-shape and refused-by-GPU cases."""
    verdicts = {fp8_key(m, t, c): fp8_blocks(arch(m), t, c) for m in FP8_MODELS for t in FP8_TPS for c in CAPABILITIES}
    assert any(v.problem is None and v.refined is None for v in verdicts.values())
    assert any(v.problem is None and v.refined is not None for v in verdicts.values())
    assert any(v.problem is not None and v.refined is None for v in verdicts.values())
    assert any(v.problem is not None and v.refined is not None for v in verdicts.values())


def table() -> str:
    rows = [
        "| model | TP | KV | max-model-len | limit fleet/vLLM | B/token/layer fleet/vLLM | KV tokens fleet | vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        got = oracle_answers()[case.id]
        a = arch(case.model)
        if not got.get("tp_ok"):
            ok = a.tp_problem(case.tp) is not None
            rows.append(f"| {case.model} | {case.tp} | {case.kv_cache_dtype} | {case.max_model_len} | "
                        f"{a.max_model_len} / {'✓' if got.get('accepts_fleet_limit') else '✗'} | TP refused by both: "
                        f"{ok} | – | – |")  # fmt: skip
            continue
        mine = fleet_numbers(case)
        limit = "✓" if got["accepts_fleet_limit"] and not got["accepts_fleet_limit_plus_one"] else "✗"
        vllm_tokens = f"{got['kv_tokens']:,}" if got["fits"] else "does not fit"
        fleet_tokens = f"{mine['kv_tokens']:,}" if mine["fits"] else "does not fit"
        rows.append(
            f"| {case.model} | {case.tp} | {case.kv_cache_dtype} | {case.max_model_len} | "
            f"{a.max_model_len} / {limit} | "
            f"{mine['page_bytes'] // 16:,} / {got['page_bytes'] // 16:,} | {fleet_tokens} | {vllm_tokens} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
