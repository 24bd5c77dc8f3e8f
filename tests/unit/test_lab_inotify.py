"""The lab raises root's inotify instance limit before booting hosts that would exhaust it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetlab.prereqs import ensure_inotify_instances, inotify_instances_needed, running_nspawn_hosts


@pytest.mark.parametrize(
    ("current", "hosts", "after", "said"),
    [
        (128, 1, 136, True),  # the kernel default is too low for even one host plus headroom
        (128, 15, 248, True),
        (1024, 15, 1024, False),  # never lowered
        (248, 15, 248, False),
    ],
)
def test_limit_raised_only_when_lower(tmp_path: Path, current: int, hosts: int, after: int, said: bool) -> None:
    knob = tmp_path / "max_user_instances"
    knob.write_text(f"{current}\n")
    message = ensure_inotify_instances(hosts, knob)
    assert int(knob.read_text()) == after
    assert (message is not None) == said
    if message:
        assert f"from {current} to {inotify_instances_needed(hosts)}" in message


def test_counts_running_nspawn_processes(tmp_path: Path) -> None:
    for pid, comm in ((10, "systemd-nspawn"), (11, "sshd"), (12, "systemd-nspawn")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
    assert running_nspawn_hosts(tmp_path) == 2
