"""``speculative`` against vLLM 0.33.0 itself (``.oracle-venv``): its parser takes the plan's argv,
and its ``SpeculativeConfig`` (``vllm/config/speculative.py``) takes the ``--speculative-config``
JSON fleet renders, with the n-gram defaults and checks fleet documents.

Only the n-gram method is constructed: ``draft_model``/``eagle``/``mtp`` build a ``ModelConfig`` of
the draft (and need the target's), which reads the checkpoint's files and the platform's device
config; that is not done on CPU here. Skips without the oracle environment, fails under
``FLEET_ORACLE_REQUIRED=1``, like ``test_vs_vllm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import plan_host
from tests.oracle.test_vs_vllm import oracle_python
from tests.unit.conftest import spec

CHECK = """
import contextlib, io, json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from vllm.config.speculative import SpeculativeConfig
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    cfg = ns.speculative_config
    cfg = json.loads(cfg) if isinstance(cfg, str) else cfg
    try:
        c = SpeculativeConfig(**cfg)
    except Exception as exc:
        out.append({"error": str(exc)})
    else:
        out.append({"method": c.method, "num_speculative_tokens": c.num_speculative_tokens,
                    "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max})
json.dump(out, sys.stdout)
"""

CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"method": "ngram", "num_speculative_tokens": 4}, {"prompt_lookup_min": 5, "prompt_lookup_max": 5}),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, {"prompt_lookup_min": 3}),
    ({"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, {}),
]


def test_vllm_takes_the_argv_and_the_speculative_config() -> None:
    python = oracle_python()
    if python is None:
        if os.environ.get("FLEET_ORACLE_REQUIRED"):
            pytest.fail("FLEET_ORACLE_REQUIRED is set but no oracle environment: run scripts/oracle-env.sh")
        pytest.skip("no vLLM oracle environment (.oracle-venv); scripts/oracle-env.sh builds it")
    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 1)
    argvs = []
    for sp, _ in CASES:
        s = spec(speculative=sp)
        argvs.append(plan_host(s, gpus, load_model(s.model)).instances[0].argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "VLLM"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [str(python), "-c", CHECK], input=json.dumps(argvs), capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for (sp, defaults), got in zip(CASES, json.loads(done.stdout), strict=True):
        assert "error" not in got, got
        assert got["method"] == sp["method"] and got["num_speculative_tokens"] == sp["num_speculative_tokens"]
        for k in ("prompt_lookup_min", "prompt_lookup_max"):
            assert got[k] == (sp | defaults).get(k), (k, got)
