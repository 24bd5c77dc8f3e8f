"""fleet's planner against the lab's vLLM stand-in: two independent implementations of vLLM's
memory arithmetic must agree on every plan we would deploy.

The planner (``fleet/plan/planner.py``) and the stand-in (``lab/vllm-standin``) are written apart
from the same facts (vLLM 0.33.0's ``vllm/v1/worker/gpu_worker.py`` and
``vllm/v1/core/kv_cache_utils.py``); neither imports the other. For each case the
planner's argv is started as a real ``vllm serve`` of the stand-in on the simulated GPUs of the
same lab profile: a plan must start (no memory refusal), and the KV tokens vLLM reports must be
close to the plan's. A plan the planner refuses must be refused by the stand-in too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from fleet.errors import PlanError
from fleet.model.arch import load_model
from fleet.plan.planner import plan_host
from fleetlab.profiles import load_profile
from tests.lab.test_vllm_standin_local import lab, run  # noqa: F401  (fixtures: installed stand-in, runner)
from tests.unit.conftest import spec

KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")

CASES = [
    # (model, lab profile, inventory overrides)
    ("meta-llama/Llama-3.1-8B-Instruct", "h100-sxm-8", {}),
    ("meta-llama/Llama-3.1-8B-Instruct", "a10-1", {}),
    ("mistralai/Mistral-7B-Instruct-v0.3", "a10-1", {"kv_cache_dtype": "fp8"}),
    ("meta-llama/Llama-3.1-70B-Instruct", "h100-sxm-8", {}),
    (
        "Qwen/Qwen2.5-72B-Instruct",
        "h100-sxm-8",
        {
            "workload": {
                "p95_input_tokens": 8000,
                "p95_output_tokens": 1000,
                "prefix_reuse": 0.2,
                "target_concurrency": 200,
            }
        },
    ),
]


@pytest.mark.parametrize("model, profile, overrides", CASES)
def test_planned_instance_starts_and_kv_tokens_agree(
    model: str,
    profile: str,
    overrides: dict[str, Any],
    run: Callable[..., Any],  # noqa: F811
) -> None:
    host = spec(model=model, **overrides)
    plan = plan_host(host, load_profile(profile).host_gpus(), load_model(model))
    instance = plan.instances[-1]  # the last group: GPUs other than 0 exercise CUDA_VISIBLE_DEVICES
    server = run(*instance.argv, profile=profile, env=dict(instance.env))
    server.wait_ready(timeout=60)
    found = KV_LINE.findall(server.log())
    assert found, server.log()
    reported = int(found[-1].replace(",", ""))
    planned = instance.memory.kv_tokens
    # Both sides estimate the activation peak and CUDA graphs; they must agree within 10 %,
    # and the plan must not promise more than vLLM will give by more than that.
    print(f"\n{model} on {profile}: planned {planned} KV tokens, vLLM stand-in reported {reported}")
    assert planned * 0.90 <= reported <= planned * 1.25, (planned, reported, server.log()[-2000:])


def test_a_plan_the_planner_refuses_is_refused_by_vllm_too(run: Callable[..., Any]) -> None:  # noqa: F811
    model = "meta-llama/Llama-3.1-70B-Instruct"
    with pytest.raises(PlanError):
        plan_host(spec(model=model), load_profile("a10-1").host_gpus(), load_model(model))
    server = run(model, "--max-model-len", "2560", "--gpu-memory-utilization", "0.90", profile="a10-1")
    assert server.wait_exit(timeout=60) != 0
    assert "No available memory for the cache blocks" in server.log()
