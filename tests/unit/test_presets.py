"""``serving_preset`` (issue 23, part 3): throughput, latency and long-context batches from the
workload and the KV budget, each with its reason; table tests of the pure arithmetic and the plan."""

from __future__ import annotations

import pytest

from fleet.errors import InventoryError
from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import batch_defaults, plan_host
from fleet.plan.presets import preset_batch
from fleet.plan.vllm_surface import parse_serve_argv
from tests.unit.conftest import spec

H100 = (8192, 1024)
A100 = (2048, 256)


@pytest.mark.parametrize(
    ("preset", "defaults", "max_len", "p95_input", "target", "kv_requests", "tokens", "seqs"),
    [
        # throughput: twice vLLM's tokens; sequences = what the KV cache holds (not vLLM's 2048)
        ("throughput", H100, 2560, 2048, 64, 281, 16384, 281),
        ("throughput", A100, 2560, 2048, 64, 5000, 4096, 512),  # the KV holds more: 2 × vLLM's 256
        # latency: 2048 tokens; the target in flight, or fewer when the KV cache holds fewer
        ("latency", H100, 2560, 2048, 32, 294, 2048, 32),
        ("latency", H100, 2560, 2048, 500, 294, 2048, 294),
        ("latency", A100, 2560, 2048, 500, 1000, 2048, 256),  # never above vLLM's default
        # long context: the p95 input in one step (up to 32768), never below vLLM's default
        ("long_context", H100, 32768, 30000, 8, 26, 30720, 26),
        ("long_context", H100, 131072, 100000, 8, 3, 32768, 3),
        ("long_context", H100, 2560, 2048, 8, 300, 8192, 300),
        # vLLM's own rules: tokens >= sequences, tokens <= sequences × max_model_len
        ("latency", H100, 2560, 2048, 4000, 4000, 2048, 1024),
        ("long_context", H100, 4096, 4000, 1, 1, 4096, 1),
        ("throughput", H100, 1024, 512, 1, 0, 1024, 1),  # nothing fits at the default batch: 1, not 0
    ],
)
def test_preset_batch(
    preset: str,
    defaults: tuple[int, int],
    max_len: int,
    p95_input: int,
    target: int,
    kv_requests: int,
    tokens: int,
    seqs: int,
) -> None:
    batch = preset_batch(preset, defaults, max_len, p95_input, target, kv_requests)
    assert batch.pair == (tokens, seqs)
    assert batch.max_num_batched_tokens >= batch.max_num_seqs
    assert preset.replace("_", "-") in batch.tokens_reason and preset.replace("_", "-") in batch.seqs_reason


def test_unknown_preset_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="one of throughput, latency, long_context"):
        preset_batch("fast", H100, 2560, 2048, 8, 8)


def test_unknown_preset_is_refused_at_the_inventory() -> None:
    with pytest.raises(InventoryError) as err:
        spec(serving_preset="fast")
    (problem,) = err.value.problems
    assert problem.field == "serving_preset" and "'throughput', 'latency' or 'long_context'" in problem.allowed


@pytest.mark.parametrize("preset", ["throughput", "latency", "long_context"])
def test_a_preset_lands_in_the_plan_with_its_memory(preset: str) -> None:
    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 1)
    base = spec()
    arch = load_model(base.model)
    plain = plan_host(base, gpus, arch).instances[0]
    inst = plan_host(spec(serving_preset=preset), gpus, arch).instances[0]
    flags = {f.option: f for f in inst.flags}
    tokens, seqs = int(flags["--max-num-batched-tokens"].value or 0), int(flags["--max-num-seqs"].value or 0)
    assert "preset" in flags["--max-num-seqs"].reason
    assert seqs <= inst.memory.workload_concurrency  # no more sequences than the KV cache holds
    ns = parse_serve_argv(inst.argv)
    assert (ns.max_num_batched_tokens, ns.max_num_seqs) == (tokens, seqs)
    # the activation peak follows the batched tokens, and the KV cache with it
    assert (inst.memory.activation_peak > plain.memory.activation_peak) == (tokens > batch_defaults(gpus)[0])
    assert "--max-num-seqs" not in {f.option for f in plain.flags}
