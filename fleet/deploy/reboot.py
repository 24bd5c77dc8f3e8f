"""Reboot a host whose driver change needs it, and wait until it answers SSH again.

A real host: ``sudo systemctl reboot`` over SSH, then wait for sshd to go away and come back;
the host key is checked strictly on every reconnect (``fleet.facts.runner.connect``), so a
host that comes back with another key is refused, not trusted. A lab host (host data
``fleet_lab``, written by ``fleet lab up``) is power-cycled the lab's way,
``fleet.lab.lab.restart_host``, which is what clears its stand-in driver's "reboot required".
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleet.errors import FleetError
from fleet.facts.runner import SshTarget, connect, run_command
from fleet.facts.sshlink import HostKeyError, SshError
from fleet.render.escape import ssh_command

REBOOT_TIMEOUT_S = 900.0


class RebootError(FleetError):
    pass


def _lab(data: Mapping[str, Any]) -> tuple[str, Path] | None:
    lab = data.get("fleet_lab")
    if not isinstance(lab, Mapping):
        return None
    name, root = lab.get("name"), lab.get("state_root")
    if not isinstance(name, str) or not isinstance(root, str):
        raise RebootError(f"fleet_lab={dict(lab)!r}: needs name and state_root (rewrite it with `fleet lab up`)")
    return name, Path(root)


def _ssh_answers(target: SshTarget) -> bool:
    try:
        client = connect(target, timeout=5.0)
    except HostKeyError as exc:
        raise RebootError(f"host {target.name}: came back with another host key: {exc.reason}") from None
    except SshError:
        return False
    client.close()
    return True


def reboot(target: SshTarget, data: Mapping[str, Any], timeout: float = REBOOT_TIMEOUT_S) -> float:
    """Reboot one host and wait for SSH; returns the seconds it took, raises ``RebootError``."""
    t0 = time.monotonic()
    lab = _lab(data)
    if lab is not None:
        from fleet.lab.lab import restart_host

        restart_host(lab[0], target.name, lab[1])
        return time.monotonic() - t0
    with contextlib.suppress(SshError):  # the connection may drop
        run_command(target, ssh_command(["sudo", "-n", "systemctl", "reboot"]), timeout=30.0)
    deadline = t0 + timeout
    while _ssh_answers(target):  # still up: wait for it to go down
        if time.monotonic() > deadline:
            raise RebootError(f"host {target.name}: still up {timeout:.0f} s after `systemctl reboot`")
        time.sleep(2.0)
    while not _ssh_answers(target):
        if time.monotonic() > deadline:
            raise RebootError(f"host {target.name}: no SSH within {timeout:.0f} s of the reboot; check its console")
        time.sleep(3.0)
    return time.monotonic() - t0
