"""``vllm_extra_args`` against vLLM 0.33.0's own parser (``make_arg_parser``, run in ``.oracle-venv``).

fleet checks extra flags with its dump of that parser (``fleet.plan.vllm_surface``); here the real
one parses the final argv of plans with extra flags (fleet's flags and the operator's), and the
flags fleet calls removed are refused by vLLM while the ones it calls deprecated are accepted, so
fleet's lists say what vLLM does. Skips without the oracle environment, fails under
``FLEET_ORACLE_REQUIRED=1`` (CI), like ``test_vs_vllm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from typing import Any

import pytest

from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.extra_args import DEPRECATED, REMOVED
from fleet.plan.planner import plan_host
from tests.oracle.test_vs_vllm import oracle_python
from tests.unit.conftest import spec

PARSE = """
import contextlib, io, json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # no GPU here: vLLM's config defaults need a platform
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    except SystemExit as exc:
        out.append({"error": (err.getvalue().strip().splitlines() or [str(exc.code)])[-1]})
    else:
        out.append({"ok": {k: (v if isinstance(v, (str, int, float, bool, type(None))) else repr(v))
                           for k, v in vars(ns).items()}})
json.dump(out, sys.stdout)
"""

EXTRA: list[dict[str, Any]] = [
    {"--enforce-eager": True, "--max-num-queued-reqs": 512, "--scheduling-policy": "priority"},
    {"--enable-chunked-prefill": False, "--compilation-config": {"mode": 3}, "--seed": -1},
    {"--middleware": ["a.b", "c.d"], "--cudagraph-capture-sizes": [1, 2, 4, 8], "--disable-log-stats": True},
    {
        "--chat-template": '/etc/x y;$HOME %n "q".jinja',
        "--max-num-scheduled-tokens": "8k",
        "--performance-mode": "interactivity",
        "--allowed-origins": '["*"]',
    },
]


#: A value each deprecated flag takes (the switches take none).
DEPRECATED_VALUE = {
    "--log-config-file": ["/etc/vllm-logging.json"],
    "--mamba-cache-mode": ["none"],
    "--ir-op-priority": ["{}"],
}


def argvs() -> list[list[str]]:
    out = []
    for extra in EXTRA:
        s = spec(vllm_extra_args=extra)
        plan = plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(s.model))
        out.append(plan.instances[0].argv)
    out += [["m", flag, "1"] for flag in REMOVED]
    out += [["m", flag, *DEPRECATED_VALUE.get(flag, [])] for flag in DEPRECATED]
    return out


@cache
def parsed() -> list[dict[str, Any]]:
    python = oracle_python()
    if python is None:
        if os.environ.get("FLEET_ORACLE_REQUIRED"):
            pytest.fail("FLEET_ORACLE_REQUIRED is set but no oracle environment: run scripts/oracle-env.sh")
        pytest.skip("no vLLM oracle environment (.oracle-venv); scripts/oracle-env.sh builds it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "VLLM"))}
    env |= {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [str(python), "-c", PARSE], input=json.dumps(argvs()), capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    answers: list[dict[str, Any]] = json.loads(done.stdout)
    return answers


@pytest.mark.parametrize("n", range(len(EXTRA)))
def test_vllms_parser_accepts_plans_with_extra_flags(n: int) -> None:
    got = parsed()[n]
    assert "ok" in got, got
    ns = got["ok"]
    extra = EXTRA[n]
    if "--enforce-eager" in extra:
        assert ns["enforce_eager"] is True and ns["scheduling_policy"] == "priority"
    if "--enable-chunked-prefill" in extra:
        assert ns["enable_chunked_prefill"] is False and ns["seed"] == -1
    if "--middleware" in extra:
        assert ns["middleware"] == repr(["a.b", "c.d"]) and ns["disable_log_stats"] is True
    if "--chat-template" in extra:
        assert ns["chat_template"] == extra["--chat-template"] and ns["max_num_scheduled_tokens"] == 8000


def test_flags_fleet_calls_removed_are_refused_by_vllm() -> None:
    answers = parsed()[len(EXTRA) : len(EXTRA) + len(REMOVED)]
    for flag, got in zip(REMOVED, answers, strict=True):
        assert "unrecognized arguments" in got.get("error", ""), (flag, got)


def test_flags_fleet_calls_deprecated_are_still_accepted_by_vllm() -> None:
    answers = parsed()[len(EXTRA) + len(REMOVED) :]
    for flag, got in zip(DEPRECATED, answers, strict=True):
        assert "ok" in got, (flag, got)
