"""``fleet.deploy.reboot`` through a host's ``reboot_command``: the command runs on this machine
(no shell), then the deploy waits for the host's SSH (a real SSH server on loopback, host key
checked); a command that fails names the host, the command, its exit status and its last words.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.deploy.reboot import RebootError, reboot

from .test_rollout_ssh_conn import SshServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SshServer]:
    s = SshServer(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_the_command_runs_here_without_a_shell_and_then_ssh_is_awaited(server: SshServer, tmp_path: Path) -> None:
    mark = tmp_path / "cycled; echo not a shell"
    command = [sys.executable, "-c", "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text('off-on')", str(mark)]
    seconds = reboot(server.target(), command, timeout=30)
    assert mark.read_text() == "off-on" and seconds >= 0
    assert server.commands == []  # no `systemctl reboot` was sent over SSH


def test_a_failing_command_names_the_host_the_command_and_what_it_said(server: SshServer) -> None:
    command = [sys.executable, "-c", "import sys; print('BMC refused: power cycle', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(RebootError) as err:
        reboot(server.target(), command, timeout=30)
    text = str(err.value)
    assert text.startswith("host gpu01: reboot_command ") and "exited 3: BMC refused: power cycle" in text


def test_a_command_that_is_not_there(server: SshServer, tmp_path: Path) -> None:
    with pytest.raises(RebootError, match=r"host gpu01: reboot_command .*/nope/power-cycle does not exist on this"):
        reboot(server.target(), [str(tmp_path / "nope" / "power-cycle"), "gpu01"], timeout=30)


def test_a_host_that_does_not_come_back_is_named(tmp_path: Path) -> None:
    from fleet.facts.runner import SshTarget

    gone = SshTarget("gpu02", "127.0.250.9", 22, "fleet", None, str(tmp_path / "known_hosts"))  # nothing listens
    with pytest.raises(RebootError, match="host gpu02: no SSH within 2 s of its reboot_command"):
        reboot(gone, ["/bin/true"], timeout=2)
