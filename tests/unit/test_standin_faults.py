"""The lab vLLM stand-in's fault file (``lab/vllm-standin/src/vllm/standin/faults.py``): parsing and
the stall windows, as pure functions (the stand-in is not installed in fleet's own venv, so the
module is loaded from its file; it needs only the standard library)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

FAULTS_PY = Path(__file__).resolve().parents[2] / "lab" / "vllm-standin" / "src" / "vllm" / "standin" / "faults.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("standin_faults_under_test", FAULTS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


faults = _load()


def read(tmp_path: Path, data: object) -> Any:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(data))
    return faults.read_faults(path)


@pytest.mark.parametrize(
    ("data", "elapsed", "stalled"),
    [
        ({}, 10.0, False),  # no stall configured
        ({"stall_after_seconds": 2, "stall_seconds": 3}, 1.9, False),  # not yet
        ({"stall_after_seconds": 2, "stall_seconds": 3}, 2.0, True),  # starts on time
        ({"stall_after_seconds": 2, "stall_seconds": 3}, 4.9, True),
        ({"stall_after_seconds": 2, "stall_seconds": 3}, 5.0, False),  # over, and once only
        ({"stall_after_seconds": 2, "stall_seconds": 3}, 500.0, False),
        ({"stall_after_seconds": 2, "stall_seconds": 3, "stall_every_seconds": 10}, 12.5, True),  # comes back
        ({"stall_after_seconds": 2, "stall_seconds": 3, "stall_every_seconds": 10}, 15.5, False),
        ({"stall_after_seconds": 0, "stall_seconds": 1, "stall_every_seconds": 4}, 8.2, True),
        ({"stall_after_seconds": 2, "stall_seconds": 0}, 2.0, False),  # a zero-length stall is none
    ],
)
def test_stall_windows(tmp_path: Path, data: dict[str, float], elapsed: float, stalled: bool) -> None:
    f = read(tmp_path, data)
    assert f.problems == ()
    assert f.stalled(elapsed) is stalled


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"stall_after_seconds": -1, "stall_seconds": 1}, "stall_after_seconds: -1 is not a number of seconds >= 0"),
        ({"stall_after_seconds": 1, "stall_seconds": "2"}, "stall_seconds: '2' is not a number of seconds >= 0"),
        ({"stall_after_seconds": 1, "stall_seconds": True}, "stall_seconds: True is not a number of seconds >= 0"),
        (
            {"stall_after_seconds": 1, "stall_seconds": 5, "stall_every_seconds": 5},
            "stall_every_seconds (5) must be more than stall_seconds (5)",
        ),
    ],
)
def test_a_bad_stall_is_reported_and_ignored(tmp_path: Path, data: dict[str, object], problem: str) -> None:
    f = read(tmp_path, data)
    assert f.problems == (f"{tmp_path / 'faults.json'}: {problem}",)
    assert not f.stalled(3.0)  # ignored: no fault at all


def test_the_other_faults_still_read(tmp_path: Path) -> None:
    f = read(tmp_path, {"fail_load": "m", "hang_after_load": True, "crash_after_seconds": 3, "load_seconds": 2})
    assert (f.fail_load, f.hang_after_load, f.crash_after_seconds, f.load_seconds) == (("m",), True, 3.0, 2.0)
    assert f.fails_load("m/") and not f.stalled(100.0)
