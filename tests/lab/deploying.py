"""Running the deploy files in ``deploys/`` with the plain ``pyinfra`` CLI against a lab host."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import paramiko

from fleetlab import ssh

from .conftest import LabFleet

REPO_ROOT = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).parent / "pyinfra"


@dataclass
class PyinfraRun:
    returncode: int
    output: str

    @property
    def changed(self) -> bool:
        return "] Success" in self.output

    @property
    def unchanged(self) -> bool:
        return self.returncode == 0 and "] Success" not in self.output and "] No changes" in self.output


def pyinfra(lab: LabFleet, deploy: str, *data: str, timeout: float = 300) -> PyinfraRun:
    """``pyinfra -y <lab inventory> deploys/<deploy> [--data k=v ...]`` from the repository root."""
    argv = [str(PYINFRA), "-y", str(lab.opts.inventory), f"deploys/{deploy}"]
    for item in data:
        argv += ["--data", item]
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    return PyinfraRun(proc.returncode, proc.stdout + proc.stderr)


def host_run(lab: LabFleet, command: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``command`` on the lab's first host over SSH (strict host keys)."""
    h = lab.state.hosts[0]
    client: paramiko.SSHClient = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def restart(lab: LabFleet) -> float:
    from fleetlab.lab import restart_host

    return restart_host(lab.opts.name, lab.state.hosts[0].name, lab.opts.state_root)
