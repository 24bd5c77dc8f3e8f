"""The serving planner: the seed example, the 70B cases, errors with ways out, and properties."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.errors import PlanError
from fleet.gpus import CATALOGUE, ESTIMATED_RESERVE, GiB, Gpu, HostGpus
from fleet.inventory.spec import HostSpec
from fleet.model.arch import ModelArch, load_model, parse_config
from fleet.plan.planner import (
    BLOCK_SIZE,
    CUDA_CONTEXT_BYTES,
    HostPlan,
    batch_defaults,
    candidate_tps,
    gpu_groups,
    gpu_memory,
    kv_dtype_bytes,
    memory_math,
    plan_host,
    resolve_precision,
    round_up,
    utilization_for,
    weight_bytes,
)
from fleet.plan.vllm_surface import parse_serve_argv
from tests.unit.conftest import spec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"
L70 = "meta-llama/Llama-3.1-70B-Instruct"


def flag(plan: HostPlan, option: str, instance: int = 0) -> str | None:
    for f in plan.instances[instance].flags:
        if f.option == option:
            return f.value
    raise KeyError(option)


def test_seed_example_mistral_on_a_48gb_nvlink_gpu() -> None:
    """The seed article's case: 48 GB GPU with NVLink, Mistral-7B v0.3 bf16, 2048+1024, reuse 0.6, 80 users."""
    s = spec(
        model="mistralai/Mistral-7B-Instruct-v0.3",
        workload={"p95_input_tokens": 2048, "p95_output_tokens": 1024, "prefix_reuse": 0.6, "target_concurrency": 80},
        gpu={"memory_gib": 48, "count": 1, "nvlink": True},
    )
    plan = plan_host(s, s.gpu.host_gpus(), load_model(s.model))  # type: ignore[union-attr]
    (inst,) = plan.instances
    m = inst.memory
    # weights: 7,248,023,552 params × 2 bytes
    assert plan.weight_bytes == 7_248_023_552 * 2
    # vLLM budgets CUDA's total (NVML's less the driver reserve; an unknown 48 GiB GPU gets the
    # conservative 640 MiB estimate), rounded up: request_memory's ceil(total × utilization)
    assert (m.nvml_total, m.reserved, m.reserve_source) == (48 * GiB, ESTIMATED_RESERVE, "estimate")
    assert m.budget == math.ceil(0.90 * (48 * GiB - ESTIMATED_RESERVE))
    assert m.kv_bytes_per_token == 131_072  # 2 × 32 layers × 8 KV heads × 128 × 2 bytes
    assert flag(plan, "--max-model-len") == "3072"  # 2048 + 1024, a multiple of 16
    assert flag(plan, "--tensor-parallel-size") == "1"
    assert flag(plan, "--gpu-memory-utilization") == "0.90"
    # KV: 43.2 GiB budget − 13.5 weights − ~1.2 overhead ≈ 28.5 GiB → ~233k tokens
    assert 27 * GiB < m.kv_budget < 30 * GiB
    # vLLM's GPU KV cache size: blocks / blocks-per-request × max_model_len = blocks × 16 here
    assert m.kv_tokens == m.kv_budget // (131_072 * BLOCK_SIZE) * BLOCK_SIZE
    assert m.max_concurrency == pytest.approx(m.kv_tokens / 3072)
    assert 70 < m.max_concurrency < 80  # full-length sequences
    # with 60% prefix reuse a request holds 0.4 × 2048 + 1024 unique KV tokens: 80 users fit
    assert m.kv_tokens_per_request == round(2048 * 0.4) + 1024
    assert m.workload_concurrency >= 80 and not plan.warnings
    assert "--enable-prefix-caching" not in inst.argv  # on by default since vLLM 0.11


def test_llama70b_on_8x_h100_sxm_uses_tp4_twice() -> None:
    plan = plan_host(spec(model=L70), HostGpus.from_catalogue("h100-sxm-80gb"), load_model(L70))
    assert [i.gpus for i in plan.instances] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [i.port for i in plan.instances] == [8000, 8001]
    m = plan.instances[0].memory
    assert m.weights == pytest.approx(131.4 * GiB / 4, rel=0.01)
    assert m.kv_bytes_per_token == 81_920
    assert plan.workload_concurrency >= 64
    env = dict(plan.instances[1].env)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_llama70b_tp2_would_not_meet_target_so_tp4_is_chosen() -> None:
    """TP 2 fits the weights but leaves ~3 GiB of KV per GPU: too few requests for the target."""
    low = plan_host(
        spec(model=L70, workload={**_wl(), "target_concurrency": 8}),
        HostGpus.from_catalogue("h100-sxm-80gb"),
        load_model(L70),
    )
    assert low.instances[0].tensor_parallel_size == 2 and len(low.instances) == 4


def _wl() -> dict[str, float]:
    return {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 64}


def test_llama70b_on_2x_h100_pcie_without_nvlink_is_refused_with_ways_out() -> None:
    gpus = HostGpus.from_catalogue("h100-pcie-80gb", 2, "none")
    with pytest.raises(PlanError) as err:
        plan_host(spec(model=L70), gpus, load_model(L70))
    problem = err.value.problem
    assert "do not fit" in problem.summary
    text = str(problem)
    assert "131.4" in text and "CUDA total 79.02" in text
    # every way out was planned first and comes with its numbers; 0.95 would not cover 64 GiB
    assert any(w.startswith("allow_pcie_tensor_parallel: true") and "at TP 2" in w for w in problem.ways_out)
    assert not any("0.95" in w for w in problem.ways_out)
    assert all("KV tokens" in w for w in problem.ways_out)
    # the way out works: TP 2 over PCIe when the operator allows it, with a warning
    plan = plan_host(spec(model=L70, allow_pcie_tensor_parallel=True), gpus, load_model(L70))
    assert plan.instances[0].tensor_parallel_size == 2
    assert any("PCIe" in w for w in plan.warnings)


def test_llama70b_on_one_a10_is_refused() -> None:
    with pytest.raises(PlanError) as err:
        plan_host(spec(model=L70), HostGpus.from_catalogue("a10-24gb", 1), load_model(L70))
    text = str(err.value)
    assert "weights do not fit" in text and "more GPUs" in text and "22.5 GiB" in text


def test_context_that_leaves_no_room_for_one_sequence_is_an_error() -> None:
    s = spec(workload={**_wl(), "p95_input_tokens": 100_000, "p95_output_tokens": 1000})
    gpus = HostGpus.from_catalogue("a10-24gb", 1)
    with pytest.raises(PlanError) as err:
        plan_host(s, gpus, load_model(s.model))
    problem = err.value.problem
    assert "no room for one sequence" in problem.summary
    (shorter,) = [w for w in problem.ways_out if w.startswith("shorter context")]
    fit = int(shorter.rsplit(" ", 1)[1].replace(",", ""))
    # the offered length is vLLM's: it plans, one block more does not
    short = {**_wl(), "p95_input_tokens": fit - 512, "p95_output_tokens": 512}
    assert flag(plan_host(spec(workload=short), gpus, load_model(s.model)), "--max-model-len") == str(fit)
    with pytest.raises(PlanError):
        plan_host(spec(workload={**short, "p95_input_tokens": fit - 512 + BLOCK_SIZE}), gpus, load_model(s.model))
    # fp8 KV alone is not enough (offered only combined with fp8 weights, which fits)
    assert not any(w.startswith("kv_cache_dtype: fp8:") for w in problem.ways_out)
    assert any(w.startswith("weights: fp8 and kv_cache_dtype: fp8: 1 instance(s)") for w in problem.ways_out)


def test_pcie_only_gpus_get_one_instance_each() -> None:
    plan = plan_host(spec(), HostGpus.from_catalogue("l40s-48gb"), load_model("meta-llama/Llama-3.1-8B-Instruct"))
    assert [i.gpus for i in plan.instances] == [(0,), (1,), (2,), (3,)]
    assert {i.tensor_parallel_size for i in plan.instances} == {1}


def test_bridged_pairs_limit_tp_to_the_island() -> None:
    gpus = HostGpus.from_catalogue("h100-pcie-80gb", 8, "pairs")
    plan = plan_host(spec(model=L70, weights="fp8", kv_cache_dtype="fp8"), gpus, load_model(L70))
    for inst in plan.instances:
        assert inst.tensor_parallel_size <= 2
        assert frozenset(inst.gpus) <= gpus.island_of(inst.gpus[0])
    assert flag(plan, "--quantization") == "fp8" and flag(plan, "--kv-cache-dtype") == "fp8"


def test_inventory_gpus_joined_in_pairs_keep_tp_inside_a_pair() -> None:
    """``{memory_gib, count, nvlink: pairs}`` is two islands of two, not one island of four."""
    s = spec(model=L70, weights="fp8", gpu={"memory_gib": 80, "count": 4, "nvlink": "pairs"})
    assert s.gpu is not None
    gpus = s.gpu.host_gpus()
    assert gpus.islands == (frozenset({0, 1}), frozenset({2, 3}))
    plan = plan_host(s, gpus, load_model(L70))
    assert [i.gpus for i in plan.instances] == [(0, 1), (2, 3)]


def test_pinned_tp_that_cannot_divide_heads_is_refused() -> None:
    arch = parse_config(
        {"num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 3072, "num_hidden_layers": 4}, "x"
    )
    with pytest.raises(PlanError) as err:
        plan_host(spec(tensor_parallel_size=3), HostGpus.from_catalogue("h100-sxm-80gb"), arch)
    text = str(err.value)
    assert "tensor_parallel_size=3" in text
    offered = [w.split(":")[1].strip() for w in err.value.problem.ways_out if w.startswith("tensor_parallel_size")]
    assert offered == ["1", "2", "4", "8"]  # each re-planned, with its numbers


def test_pinned_tp_larger_than_island_is_refused() -> None:
    with pytest.raises(PlanError, match="largest NVLink island"):
        plan_host(spec(tensor_parallel_size=4), HostGpus.from_catalogue("h100-pcie-80gb", 8, "pairs"), load_model(L70))


def test_memory_in_use_lowers_utilization_and_says_why() -> None:
    base = HostGpus.from_catalogue("l40s-48gb", 1)
    busy = dataclasses.replace(base, gpus=(dataclasses.replace(base.gpus[0], memory_used=10 * GiB),))
    plan = plan_host(spec(), busy, load_model("meta-llama/Llama-3.1-8B-Instruct"))
    util = float(flag(plan, "--gpu-memory-utilization") or 0)
    total = base.gpus[0].memory_total
    assert util * total <= total - 10 * GiB  # vLLM's start check: free ≥ util × total
    reason = next(f.reason for f in plan.instances[0].flags if f.option == "--gpu-memory-utilization")
    assert "10.0 GiB in use" in reason


def test_workload_longer_than_the_model_is_capped_with_a_warning() -> None:
    s = spec(model="mistralai/Mistral-7B-Instruct-v0.3", workload={**_wl(), "p95_input_tokens": 40000})
    plan = plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(s.model))
    assert flag(plan, "--max-model-len") == "32768"
    assert any("exceeds the model's maximum" in w for w in plan.warnings)


def test_int4_needs_a_prequantized_checkpoint() -> None:
    with pytest.raises(PlanError) as err:
        plan_host(
            spec(weights="int4"), HostGpus.from_catalogue("a10-24gb", 1), load_model("meta-llama/Llama-3.1-8B-Instruct")
        )
    assert "pre-quantized" in str(err.value)


def test_prequantized_awq_checkpoint_is_served_without_quantization_flag() -> None:
    cfg = {
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
    }
    plan = plan_host(spec(), HostGpus.from_catalogue("h100-sxm-80gb", 1), parse_config(cfg, "awq-70b"))
    assert plan.weights_precision == "int4"
    assert 35 * GiB < plan.weight_bytes < 40 * GiB  # 4-bit body + 16-bit embeddings
    assert "--quantization" not in plan.instances[0].argv


def test_api_key_never_in_argv_and_shutdown_timeout_present() -> None:
    plan = plan_host(
        spec(api_key_ref="env:KEY"),
        HostGpus.from_catalogue("a10-24gb", 1),
        load_model("meta-llama/Llama-3.1-8B-Instruct"),
    )
    argv = plan.instances[0].argv
    assert "--api-key" not in argv and flag(plan, "--shutdown-timeout") == "30"


def test_unknown_vllm_version_is_refused() -> None:
    with pytest.raises(PlanError, match=r"0\.33\.0"):
        plan_host(
            spec(vllm_version="0.10.0"),
            HostGpus.from_catalogue("a10-24gb", 1),
            load_model("meta-llama/Llama-3.1-8B-Instruct"),
        )


# -- properties ------------------------------------------------------------------------------------

MODELS = [
    load_model(m)
    for m in (
        "meta-llama/Llama-3.1-8B-Instruct",
        L70,
        "mistralai/Mistral-7B-Instruct-v0.3",
        "Qwen/Qwen2.5-72B-Instruct",
        str(FIXTURES / "mixtral-8x7b"),
        str(FIXTURES / "deepseek-v2-lite"),
        str(FIXTURES / "odd-heads"),
    )
]


@settings(max_examples=150, deadline=None)
@given(
    arch=st.sampled_from(MODELS),
    sku=st.sampled_from(sorted(CATALOGUE)),
    count=st.sampled_from([1, 2, 4, 8]),
    fabric=st.sampled_from(["switch", "pairs", "none"]),
    used_gib=st.lists(st.floats(0, 30), min_size=8, max_size=8),
    p95_in=st.integers(1, 40000),
    p95_out=st.integers(1, 8000),
    reuse=st.floats(0, 1),
    target=st.integers(1, 500),
    weights=st.sampled_from(["auto", "fp8", "bf16"]),
    kv=st.sampled_from(["auto", "fp8"]),
)
def test_any_plan_fits_memory_divides_heads_and_parses(
    arch, sku, count, fabric, used_gib, p95_in, p95_out, reuse, target, weights, kv
) -> None:  # type: ignore[no-untyped-def]
    gpus = HostGpus.from_catalogue(sku, count, fabric)
    gpus = dataclasses.replace(
        gpus,
        gpus=tuple(
            Gpu(g.index, g.name, g.memory_total, int(min(used_gib[g.index] * GiB, g.memory_total * 0.5)))
            for g in gpus.gpus
        ),
    )
    wl = {"p95_input_tokens": p95_in, "p95_output_tokens": p95_out, "prefix_reuse": reuse, "target_concurrency": target}
    s = spec(model=arch.name, workload=wl, weights=weights, kv_cache_dtype=kv)
    try:
        plan = plan_host(s, gpus, arch)
    except PlanError as err:
        assert err.problem.summary and err.problem.host == "h1" and err.problem.ways_out
        _assert_refusal_is_justified(s, gpus, arch)
        return
    used_gpus: set[int] = set()
    for inst in plan.instances:
        m = inst.memory
        tp = inst.tensor_parallel_size
        assert arch.num_attention_heads % tp == 0 and arch.tp_problem(tp) is None
        assert len(inst.gpus) == tp and not used_gpus & set(inst.gpus)
        used_gpus |= set(inst.gpus)
        assert frozenset(inst.gpus) <= gpus.island_of(inst.gpus[0])
        for i in inst.gpus:  # vLLM's start check and the memory sum, on every GPU of the instance
            g = gpu_memory(gpus, i)
            assert m.budget <= g.cuda_total - g.used - CUDA_CONTEXT_BYTES  # free after vLLM's context
            assert m.weights + m.non_torch + m.activation_peak + m.cuda_graphs + m.kv_budget <= m.budget
            assert m.gpu_total <= g.cuda_total < g.nvml_total
        assert 0 < m.utilization < 1
        assert m.kv_tokens >= m.max_model_len  # at least one full sequence fits
        assert m.max_model_len % BLOCK_SIZE == 0 or m.max_model_len == arch.max_model_len
        ns = parse_serve_argv(inst.argv, "0.33.0")
        assert ns.tensor_parallel_size == tp and ns.max_model_len == m.max_model_len


def _assert_refusal_is_justified(s: HostSpec, gpus: HostGpus, arch: ModelArch) -> None:
    """A refusal must be forced: no TP vLLM accepts, on any GPU group the islands allow, fits.

    Recomputed here from the pieces (TP rules, groups, utilization, vLLM's memory arithmetic),
    so a planner that refused inputs that fit would fail this property.
    """
    try:
        precision = resolve_precision(s, arch)
    except PlanError:
        return  # the weights setting itself cannot be served (no checkpoint to quantize from)
    weights = weight_bytes(arch, precision)
    max_len = min(round_up(s.workload.p95_sequence_tokens, BLOCK_SIZE), arch.max_model_len)
    pcie_only = all(len(i) == 1 for i in gpus.islands) and gpus.count > 1
    pcie_tp = pcie_only and s.allow_pcie_tensor_parallel
    for tp in candidate_tps(arch, gpus, s, pcie_tp):
        for group in gpu_groups(gpus, tp, pcie_tp):
            util, _ = utilization_for(s, gpus, group)
            mem = min((gpu_memory(gpus, i) for i in group), key=lambda g: g.cuda_total)
            m = memory_math(
                arch, weights, tp, mem, util, max_len, kv_dtype_bytes(s, arch), batch_defaults(gpus), max_len
            )
            assert not m.fits, f"refused, yet TP {tp} on GPUs {group} fits: {m}"


@settings(max_examples=60, deadline=None)
@given(
    arch=st.sampled_from([m for m in MODELS if m.parameters < 20e9]),
    sku=st.sampled_from(["h100-sxm-80gb", "h200-sxm-141gb", "a100-sxm-80gb"]),
    count=st.sampled_from([1, 2, 4, 8]),
    p95_in=st.integers(1, 4000),
    p95_out=st.integers(1, 4000),
    kv=st.sampled_from(["auto", "fp8"]),
)
def test_inputs_that_fit_by_a_margin_are_planned(arch, sku, count, p95_in, p95_out, kv) -> None:  # type: ignore[no-untyped-def]
    """Small models (< 20B, ≤ 40 GiB of bf16 weights) on idle 80+ GiB GPUs with ≤ 8K context always plan."""
    wl = {"p95_input_tokens": p95_in, "p95_output_tokens": p95_out, "prefix_reuse": 0.0, "target_concurrency": 1}
    plan = plan_host(spec(model=arch.name, workload=wl, kv_cache_dtype=kv), HostGpus.from_catalogue(sku, count), arch)
    assert plan.instances and plan.total_kv_tokens >= plan.instances[0].memory.max_model_len


def test_hosts_with_identical_planning_inputs_share_one_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.plan import outcomes

    calls: list[str] = []
    real = outcomes.plan_host

    def counting(s: HostSpec, gpus: HostGpus, arch: ModelArch, draft: ModelArch | None = None) -> HostPlan:
        calls.append(s.name)
        return real(s, gpus, arch, draft=draft)

    monkeypatch.setattr(outcomes, "plan_host", counting)
    gpu = {"sku": "l40s-48gb", "count": 4}
    hosts = (
        spec("a", gpu=gpu, ssh_hostname="10.1.0.1"),
        spec("b", gpu=gpu, ssh_hostname="10.1.0.2", ssh_port=2222),  # another machine: its place is no input
        spec("c", gpu=gpu, port=9000),
        spec("d", gpu={**gpu, "count": 2}),
    )
    inv = outcomes.LoadedInventory("tests/inventory.py", None, hosts)  # type: ignore[arg-type]
    result = outcomes.plan_inventory(inv)
    assert calls == ["a", "c", "d"]  # b shares a's plan; c differs in port, d in GPUs
    a, b, c, d = result
    assert a.plan is not None and b.plan is not None and c.plan is not None
    assert (a.plan.host, b.plan.host) == ("a", "b")
    assert dataclasses.replace(b.plan, host="a") == a.plan
    assert c.plan.instances[0].port == 9000 and d.spec.name == "d"


def test_budget_uses_cuda_total_measured_reserve_and_probed_reserve() -> None:
    """Issue 9's numbers: on an H100, NVML's total over-promised 3,456 KV tokens for Llama-3.1-8B."""
    arch = load_model("meta-llama/Llama-3.1-8B-Instruct")
    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 1)
    m = plan_host(spec(), gpus, arch).instances[0].memory
    assert (m.nvml_total - m.gpu_total, m.reserve_source) == (480 * 2**20, "measured")
    assert m.budget == math.ceil(0.90 * (81559 - 480) * 2**20)
    nvml_budget = math.ceil(0.90 * m.nvml_total)
    assert (nvml_budget - m.budget) // (131_072 * BLOCK_SIZE) * BLOCK_SIZE == 3_456
    probed = dataclasses.replace(gpus, gpus=(dataclasses.replace(gpus.gpus[0], memory_reserved=700 * 2**20),))
    p = plan_host(spec(), probed, arch).instances[0].memory
    assert (p.reserved, p.reserve_source, p.budget) == (700 * 2**20, "probe", math.ceil(0.9 * (81559 - 700) * 2**20))


def test_utilization_counts_vllms_own_cuda_context() -> None:
    arch = load_model("meta-llama/Llama-3.1-8B-Instruct")
    base = HostGpus.from_catalogue("h100-sxm-80gb", 1)
    total = base.gpus[0].memory_total
    busy = dataclasses.replace(base, gpus=(dataclasses.replace(base.gpus[0], memory_used=int(0.1 * total)),))
    plan = plan_host(spec(gpu_memory_utilization=0.92), busy, arch)
    m = plan.instances[0].memory
    free_after_context = m.gpu_total - int(0.1 * total) - CUDA_CONTEXT_BYTES
    assert m.budget <= free_after_context < math.ceil(0.92 * m.gpu_total)
    assert "527 MiB" in next(f.reason for f in plan.instances[0].flags if f.option == "--gpu-memory-utilization")


def test_moe_activation_uses_intermediate_size_when_no_expert_width() -> None:
    from fleet.plan.planner import activation_peak

    mixtral = load_model(str(FIXTURES / "mixtral-8x7b"))
    dense_like = dataclasses.replace(mixtral, num_experts=0)
    # two experts per token of width 14336 cost twice the dense MLP's activations, not zero
    assert activation_peak(mixtral, 1, 8192, 0) > activation_peak(dense_like, 1, 8192, 0)


def test_hybrid_plan_shows_groups_and_no_lower_bound_note() -> None:
    arch = load_model(str(FIXTURES / "gemma-2-9b"))
    plan = plan_host(spec(model=arch.name), HostGpus.from_catalogue("h100-sxm-80gb", 1), arch)
    notes = " ".join(plan.notes)
    assert "lower bound" not in notes and "hybrid KV groups" in notes and "padding" not in notes
    assert "estimated, not vLLM's arithmetic" in notes and "KV tokens" in notes


def test_no_nvlink_gpus_are_never_offered_nvlink_and_one_host_limit_is_said() -> None:
    l70 = load_model(L70)
    with pytest.raises(PlanError) as err:
        plan_host(spec(model=L70), HostGpus.from_catalogue("rtx-4090-24gb", 1), l70)
    text = " ".join(err.value.problem.ways_out)
    assert "NVLink" not in text and "NVSwitch" not in text and "allow_pcie_tensor_parallel" in text
    big = parse_config(
        {"model_type": "llama", "num_attention_heads": 128, "num_key_value_heads": 8, "hidden_size": 16384,
         "num_hidden_layers": 126, "intermediate_size": 53248, "vocab_size": 128256}, "405b-like"
    )  # fmt: skip
    with pytest.raises(PlanError) as err:
        plan_host(spec(model="405b-like"), HostGpus.from_catalogue("a10-24gb", 1), big)
    assert any(w.startswith("needs more than one host") for w in err.value.problem.ways_out)


def test_forced_tp1_that_cannot_fit_is_offered_the_tp_that_fits() -> None:
    with pytest.raises(PlanError) as err:
        plan_host(spec(model=L70, tensor_parallel_size=1), HostGpus.from_catalogue("h100-sxm-80gb"), load_model(L70))
    first = err.value.problem.ways_out[0]
    assert first.startswith("tensor_parallel_size: 2: 4 instance(s) at TP 2"), first
