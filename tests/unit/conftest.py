"""Shared builders for the pure tests: host specs from plain inventory data."""

from __future__ import annotations

import os
from typing import Any

import pytest

from fleet.inventory.spec import HostSpec, host_spec

CHAT = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 64}


def spec(name: str = "h1", **data: Any) -> HostSpec:
    """A validated HostSpec from inventory-style data (defaults: Llama-3.1-8B, a chat workload)."""
    base: dict[str, Any] = {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": dict(CHAT)}
    base.update(data)
    return host_spec("tests/inventory.py", name, (), base)


@pytest.fixture
def make_spec() -> Any:
    return spec


@pytest.fixture(scope="session", autouse=True)
def _fleet_log_here(tmp_path_factory: pytest.TempPathFactory) -> None:
    """fleet's log file (``fleet.logs``: what paramiko and pyinfra log) under this session's tmp dir,
    for the commands tests run in-process and as subprocesses, never in the home directory."""
    os.environ.setdefault("FLEET_LOG", str(tmp_path_factory.mktemp("fleet-log") / "fleet.log"))
