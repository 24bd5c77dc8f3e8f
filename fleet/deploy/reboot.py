"""Reboot a host whose driver change needs it, and wait until it answers SSH again.

A host with a ``reboot_command`` in its inventory data (a program on this machine that
power-cycles it, e.g. through its BMC; ``fleet lab up`` writes ``fleet lab restart`` for lab
hosts, which is what clears the lab driver's "reboot required") is rebooted by running that
command here, without a shell; it returns once the host was power-cycled, and fleet waits for
SSH. Any other host: ``sudo systemctl reboot`` over SSH, then wait for sshd to go away and come
back. Either way the host key is checked strictly on every reconnect (``fleet.facts.runner.connect``),
so a host that comes back with another key is refused, not trusted.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Sequence

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.runner import SshTarget, connect, run_command
from fleet.facts.sshlink import HostKeyError, SshError
from fleet.secrets import redact

REBOOT_TIMEOUT_S = 900.0


class RebootError(FleetError):
    pass


def _ssh_answers(target: SshTarget) -> bool:
    try:
        client = connect(target, timeout=5.0)
    except HostKeyError as exc:
        raise RebootError(f"host {target.name}: came back with another host key: {exc.reason}") from None
    except SshError:
        return False
    client.close()
    return True


def _power_cycle(name: str, command: Sequence[str], timeout: float) -> None:
    """Run the host's ``reboot_command`` (argv, no shell); ``RebootError`` naming it if it fails."""
    shown = " ".join(command)
    where = f"host {name}: reboot_command {shown!r}"
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise RebootError(
            f"host {name}: reboot_command {shown!r}: {command[0]} does not exist on this machine"
        ) from None
    except PermissionError:
        raise RebootError(f"{where}: {command[0]} is not executable here") from None
    except subprocess.TimeoutExpired:
        raise RebootError(f"{where} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:]) or "no output"
        raise RebootError(redact(f"{where} exited {done.returncode}: {tail}"))


def reboot(target: SshTarget, command: Sequence[str] | None = None, timeout: float = REBOOT_TIMEOUT_S) -> float:
    """Reboot one host (through ``command``, its ``reboot_command``, when it has one) and wait for
    SSH; returns the seconds it took, raises ``RebootError``."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    if command:
        _power_cycle(target.name, command, timeout)
        while not _ssh_answers(target):
            if time.monotonic() > deadline:
                raise RebootError(f"host {target.name}: no SSH within {timeout:.0f} s of its reboot_command")
            time.sleep(1.0)
        return time.monotonic() - t0
    with contextlib.suppress(SshError):  # the connection may drop
        run_command(target, ssh_command(["sudo", "-n", "systemctl", "reboot"]), timeout=30.0)
    while _ssh_answers(target):  # still up: wait for it to go down
        if time.monotonic() > deadline:
            raise RebootError(f"host {target.name}: still up {timeout:.0f} s after `systemctl reboot`")
        time.sleep(2.0)
    while not _ssh_answers(target):
        if time.monotonic() > deadline:
            raise RebootError(f"host {target.name}: no SSH within {timeout:.0f} s of the reboot; check its console")
        time.sleep(3.0)
    return time.monotonic() - t0
