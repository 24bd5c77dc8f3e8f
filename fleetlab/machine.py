"""One lab host's lifecycle: overlay root, boot under systemd-nspawn, wait for sshd, stop.

The host shares the control machine's network namespace (no ``--private-network``) and its
sshd listens only on the host's own 127.0.x.y address. nspawn runs detached (its own session,
output to ``console.log``); its pid and start time are kept in ``nspawn.json`` so a later
``fleet lab status``/``down`` in another process can tell it apart from a reused pid. Stopping
sends SIGTERM (nspawn asks the host's systemd for a clean shutdown), then SIGKILL to nspawn and
everything in the host's cgroup if it does not stop in time, then unmounts the overlay.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fleetlab import cgroups
from fleetlab.errors import LabError
from fleetlab.hostfiles import PROC_DRIVER_SOURCE
from fleetlab.mounts import is_mounted, mount_overlay, unmount_all_under
from fleetlab.pcitree import DEVICES_DIR as PCI_DEVICES_DIR
from fleetlab.pcitree import SYSFS_DEVICES as PCI_SYSFS_DEVICES

BOOT_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
PROPAGATE_DIR = Path("/run/systemd/nspawn/propagate")

#: Moves the shell into the host's cgroups, then becomes systemd-nspawn (see cgroups.py).
_ENTER_CGROUPS = 'for g in $FLEET_LAB_CGROUPS; do echo $$ > "$g/cgroup.procs" || exit 97; done; exec "$@"'


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid``, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[19])


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process that was ``pid`` at ``start_time`` still runs (zombies count as dead)."""
    _reap(pid)
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[1] == start_time


@dataclass(frozen=True)
class Runtime:
    """What ``nspawn.json`` records about a running host."""

    pid: int
    start_time: int
    cgroups: tuple[str, ...]


def ssh_answers(address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something at address:port sends an SSH banner."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class Machine:
    """One host: its directory under the lab state dir and its nspawn process."""

    def __init__(self, name: str, address: str, ssh_port: int, host_dir: Path) -> None:
        self.name = name
        self.address = address
        self.ssh_port = ssh_port
        self.dir = host_dir

    # ---- paths -------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def host_key(self) -> Path:
        return self.dir / "ssh_host_ed25519_key"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def runtime_file(self) -> Path:
        return self.dir / "nspawn.json"

    # ---- state -------------------------------------------------------------------------------
    def runtime(self) -> Runtime | None:
        """The recorded nspawn process, if any."""
        try:
            raw = json.loads(self.runtime_file.read_text())
            return Runtime(int(raw["pid"]), int(raw["start_time"]), tuple(raw.get("cgroups", [])))
        except (OSError, ValueError, KeyError):
            return None

    def is_running(self) -> bool:
        """Whether this host's nspawn is alive."""
        rt = self.runtime()
        return rt is not None and process_alive(rt.pid, rt.start_time)

    def pid(self) -> int | None:
        """nspawn's pid while it runs."""
        rt = self.runtime()
        return rt.pid if rt is not None and process_alive(rt.pid, rt.start_time) else None

    # ---- start -------------------------------------------------------------------------------
    def mount_root(self, base: Path) -> None:
        """Mount the overlay root (base read-only below, this host's changes above) if not mounted."""
        if not is_mounted(self.root):
            mount_overlay(base, self.dir / "upper", self.dir / "work", self.root)

    def _command(self) -> tuple[list[str], list[Path]]:
        """The nspawn command line, and the cgroups it must start in (none under systemd)."""
        nspawn = [
            "systemd-nspawn",
            f"--directory={self.root}",
            f"--machine={self.name}",
            "--boot",
            "--register=no",
            "--console=passive",
            "--link-journal=no",
            # A bind under /proc is made after nspawn enters the host, so the source is a path inside it.
            f"--bind-ro={PROC_DRIVER_SOURCE}:/proc/driver",
        ]
        pci = self.root / PCI_DEVICES_DIR.lstrip("/")
        if pci.is_dir():  # the host's own PCI devices (fleetlab.pcitree), not this machine's
            nspawn.append(f"--bind-ro={pci}:{PCI_SYSFS_DEVICES}")
        if cgroups.systemd_is_pid1():
            return nspawn, []  # nspawn asks systemd for a scope of its own
        groups = cgroups.host_cgroups(self.name)
        return ["/bin/sh", "-c", _ENTER_CGROUPS, "fleet-lab-boot", *nspawn, "--keep-unit"], groups

    def kill_leftovers(self) -> None:
        """End processes of this host that outlived its nspawn (killed outright: sshd still holds
        the address). Only when nspawn is not running."""
        if not self.is_running():
            rt = self.runtime()
            cgroups.kill_all([Path(g) for g in rt.cgroups] if rt else cgroups.host_cgroups(self.name))

    def start(self) -> Runtime:
        """Boot the host detached; return once nspawn runs (not yet once sshd answers)."""
        if self.is_running():
            raise LabError(f"{self.name} is already running")
        cmd, groups = self._command()
        self.kill_leftovers()
        cgroups.remove(groups)
        cgroups.create(groups)
        env = {**os.environ, "FLEET_LAB_CGROUPS": " ".join(map(str, groups))}
        with open(self.console_log, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, cwd=self.dir,
            )  # fmt: skip
        stat = _proc_stat(proc.pid)
        if stat is None:
            raise LabError(f"systemd-nspawn for {self.name} exited at once; see {self.console_log}")
        rt = Runtime(proc.pid, stat[1], tuple(map(str, groups)))
        self.runtime_file.write_text(json.dumps({**rt.__dict__, "cgroups": list(rt.cgroups)}) + "\n")
        return rt

    def wait_for_ssh(self, timeout: float = BOOT_TIMEOUT_S) -> float:
        """Wait until sshd in the host answers; return seconds waited; raise with the console's tail."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if ssh_answers(self.address, self.ssh_port, timeout=1.0):
                return time.monotonic() - started
            if not self.is_running():
                raise LabError(f"{self.name} stopped while booting; console:\n{self.console_tail()}")
            time.sleep(0.25)
        raise LabError(
            f"sshd on {self.name} ({self.address}:{self.ssh_port}) did not answer within {timeout:.0f} s; "
            f"console ({self.console_log}):\n{self.console_tail()}"
        )

    def console_tail(self, lines: int = 20) -> str:
        """The last lines nspawn and the host's systemd printed."""
        try:
            return "\n".join(self.console_log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no console log)"

    # ---- stop --------------------------------------------------------------------------------
    def _wait_dead(self, rt: Runtime, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not process_alive(rt.pid, rt.start_time):
                return True
            time.sleep(0.1)
        return not process_alive(rt.pid, rt.start_time)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Shut the host down (clean, then forced), unmount its root and remove its cgroups."""
        rt = self.runtime()
        groups = [Path(g) for g in rt.cgroups] if rt else cgroups.host_cgroups(self.name)
        if rt is not None and process_alive(rt.pid, rt.start_time):
            os.kill(rt.pid, signal.SIGTERM)
            if not self._wait_dead(rt, timeout):
                os.kill(rt.pid, signal.SIGKILL)
                self._wait_dead(rt, 5.0)
        cgroups.kill_all(groups)  # anything the host left behind, e.g. after a SIGKILL
        unmount_all_under(self.dir)
        cgroups.remove(groups)
        propagate = PROPAGATE_DIR / self.name
        if propagate.is_dir() and not is_mounted(propagate):  # nspawn leaves it when /run is not tmpfs
            shutil.rmtree(propagate, ignore_errors=True)
        self.runtime_file.unlink(missing_ok=True)
