"""A restart, rollout or rollback that finds a host SSH cannot reach in its first read round refuses
at once, naming it (issue 25: a frozen host decided within 30 s), instead of waiting on every later
connection to it."""

from __future__ import annotations

import pytest

from fleet.facts.runner import HostUnreachable
from fleet.rollout.fleet_inventory import unreachable_refusal

HANDSHAKE = "unreachable: took the TCP connection but the SSH handshake did not finish within 10s"


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ({}, None),
        ({"a": HostUnreachable("a", "nvidia-smi: command not found")}, None),  # asked, the command failed
        ({"a": HostUnreachable("a", HANDSHAKE, ssh_failed=True)}, f"host a: SSH failed: {HANDSHAKE}"),
        (
            {
                "a": HostUnreachable("a", HANDSHAKE, ssh_failed=True),
                "b": HostUnreachable("b", "refused", ssh_failed=True),
            },
            f"host a: SSH failed: {HANDSHAKE}; host b: SSH failed: refused",
        ),
    ],
)
def test_unreachable_refusal(answers: dict[str, HostUnreachable], expected: str | None) -> None:
    assert unreachable_refusal(answers) == expected
