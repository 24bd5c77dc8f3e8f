"""Shared builders for the pure tests: host specs from plain inventory data."""

from __future__ import annotations

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
