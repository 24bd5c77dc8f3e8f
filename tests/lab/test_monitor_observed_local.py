"""Plans from observed traffic against the real stand-in: a generated load with a known length
distribution goes through two instances of one host; `fleet monitor observe` reads their
histograms over HTTP and must find the p95 input and output lengths inside the bucket it states
(vLLM's 1-2-5 buckets), within that bucket's resolution, with the right sample size.

The stand-in's tokenizer counts words and punctuation plus one BOS token, and a request with
``max_tokens`` n and no stop finishes with n tokens, so every request's lengths are known here.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.lab.test_vllm_standin_local import (  # noqa: F401  (fixtures are used by name)
    LLAMA_8B,
    Server,
    http,
    lab,
    run,
)

REPO = Path(__file__).resolve().parents[2]


def p95(values: list[int]) -> int:
    return sorted(values)[math.ceil(0.95 * len(values)) - 1]


def test_observed_p95_matches_the_generated_load(run: Callable[..., Server], tmp_path: Path) -> None:  # noqa: F811
    env = {"FLEET_LAB_TOKEN_SECONDS": "0.0005", "FLEET_LAB_PREFILL_SECONDS_PER_TOKEN": "0"}
    servers = [
        run(LLAMA_8B, "--served-model-name", LLAMA_8B, "--max-model-len", "4096",
            env={**env, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(2)
    ]  # fmt: skip
    for server in servers:
        server.wait_ready()
    metrics = http(servers[0].url + "/metrics")[1].decode()
    if "vllm:request_prompt_tokens_bucket" not in metrics:
        pytest.skip("this stand-in build does not export vllm:request_prompt_tokens (the prometheus_client "
                    "stand-in does); nothing to observe")  # fmt: skip

    rng = random.Random(14)
    # A skewed load: most prompts short, a tail of long ones; outputs 1..400.
    prompt_words = [rng.randint(10, 300) if rng.random() < 0.8 else rng.randint(300, 1500) for _ in range(240)]
    outputs = [rng.randint(1, 400) for _ in range(240)]

    def send(i: int) -> int:
        server = servers[i % 2]
        body = {"prompt": " ".join(["tok"] * prompt_words[i]), "max_tokens": outputs[i]}
        status, answer, _ = http(server.url + "/v1/completions", body, timeout=60)
        assert status == 200, answer
        usage = json.loads(answer)["usage"]
        assert usage["completion_tokens"] == outputs[i]
        return int(usage["prompt_tokens"])

    with ThreadPoolExecutor(8) as pool:
        prompt_tokens = list(pool.map(send, range(len(outputs))))
    assert prompt_tokens == [w + 1 for w in prompt_words]  # the stand-in's tokenizer, as documented

    # One host per instance (the run fixture picks free ports; a host's instance n would need port + n).
    inv = tmp_path / "inv.py"
    wl = {"p95_input_tokens": 3000, "p95_output_tokens": 1000, "prefix_reuse": 0.5, "target_concurrency": 4}
    hosts = [(f"box-{i}", {"ssh_hostname": "127.0.0.1", "port": s.port, "model": LLAMA_8B, "workload": wl,
                           "gpu": {"sku": "h100-sxm-80gb", "count": 1}}) for i, s in enumerate(servers)]  # fmt: skip
    inv.write_text(f"serving = {hosts!r}\n")
    result = subprocess.run([sys.executable, "-m", "fleet.cli", "monitor", "observe", str(inv), "--json",
                             "--seconds", "1"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    reports = {h["host"]: h for h in json.loads(result.stdout)["hosts"]}
    assert sum(r["observed"]["requests"] for r in reports.values()) == len(outputs)
    for i in range(2):
        report = reports[f"box-{i}"]
        o = report["observed"]
        mine = range(i, len(outputs), 2)
        assert o["requests"] == len(mine)
        for key, values in (("p95_input_tokens", [prompt_tokens[k] for k in mine]),
                            ("p95_output_tokens", [outputs[k] for k in mine])):  # fmt: skip
            q = o[key]
            low, high = q["bucket"]
            truth = p95(values)
            assert low <= truth <= high, (key, q, truth)  # the stated bucket holds the true p95
            assert abs(q["tokens"] - truth) <= high - low, (key, q, truth)  # within its resolution
            assert report["suggested"][key] == math.ceil(q["tokens"])
        assert report["change"]["p95_input_tokens"]["declared"] == 3000
        assert any("--max-model-len" in line for line in report["plan_diff"]), report["plan_diff"]
