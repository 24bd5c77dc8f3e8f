"""Waiting for a condition in tests: poll, with a deadline, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], timeout: float = 10, step: float = 0.05) -> bool:
    """True as soon as ``predicate()`` is; after ``timeout`` seconds, its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
