"""The files that make a copy of the base into one particular lab host.

Written into the host's overlay root before it boots (and refreshed by every ``up``): identity
(hostname, /etc/hosts, machine-id), sshd listening on the host's own loopback address only with
key auth only and the lab-made host key, the login key, and the simulated GPUs: the NVML shim as
``libnvidia-ml.so.1``, its profile, the text of ``/proc/driver/nvidia/version`` (bind-mounted over
``/proc/driver`` by nspawn), a tmpfiles.d entry for the shim's live-state dir, and the host's PCI
devices (``fleetlab.pcitree``, bound over ``/sys/bus/pci/devices`` by nspawn).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetlab.base import LOGIN_USER
from fleetlab.errors import LabError
from fleetlab.state import HostRecord

if TYPE_CHECKING:
    from fleetlab.profiles import LabProfile

#: Inside the host: the directory nspawn binds read-only over /proc/driver.
PROC_DRIVER_SOURCE = "/usr/lib/fleet-lab/proc-driver"
NVML_PROFILE_PATH = "/etc/fleet-lab/nvml-profile"
#: A bare host's GPUs as the driver finds them at boot (the lab's stand-in for its PCI devices).
HARDWARE_PROFILE = "/usr/lib/fleet-lab/hardware/nvml-profile"
NVML_STATE_DIR = "/run/fleet-lab/nvml"
SHIM_PATH = f"/usr/lib/{platform.machine()}-linux-gnu/libnvidia-ml.so.1"
SSHD_DROP_IN = "/etc/ssh/sshd_config.d/10-fleet-lab.conf"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"


@dataclass(frozen=True)
class HostFile:
    """One file to place in a host: path inside the host, content, mode, and owner."""

    path: str
    content: str | bytes
    mode: int = 0o644
    owner: str = "root"
    link_to: str | None = None  #: a symlink to this path (content and mode unused)


def sshd_config(address: str, port: int) -> str:
    """sshd settings: this host's address only, keys only, the lab-made ed25519 host key."""
    return (
        "# Written by fleet lab: listen on this lab host's own loopback address only.\n"
        f"ListenAddress {address}:{port}\n"
        f"HostKey {HOST_KEY}\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin no\n"
        "UseDNS no\n"
    )


def etc_hosts(me: HostRecord, lab_hosts: list[HostRecord]) -> str:
    """/etc/hosts naming every host of the lab at its address."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.address}\t{h.name}" for h in lab_hosts]
    if me not in lab_hosts:
        lines.append(f"{me.address}\t{me.name}")
    return "\n".join(lines) + "\n"


def identity_files(
    lab: str, me: HostRecord, lab_hosts: list[HostRecord], port: int, host_key: Path, control_pub: str
) -> list[HostFile]:
    """Hostname, hosts, sshd, host key, login key and the lab's description of the host."""
    info = {"lab": lab, "name": me.name, "address": me.address, "profile": me.profile, "ssh_port": port}
    return [
        HostFile("/etc/hostname", me.name + "\n"),
        HostFile("/etc/hosts", etc_hosts(me, lab_hosts)),
        HostFile(SSHD_DROP_IN, sshd_config(me.address, port)),
        HostFile(HOST_KEY, host_key.read_text(), 0o600),
        HostFile(HOST_KEY + ".pub", Path(f"{host_key}.pub").read_text()),
        HostFile(f"/home/{LOGIN_USER}/.ssh/authorized_keys", control_pub + "\n", 0o600, LOGIN_USER),
        HostFile("/etc/fleet-lab/host.json", json.dumps(info, indent=2) + "\n"),
    ]


def pci_files(profile: LabProfile, tree_dir: str | None = None) -> list[HostFile]:
    """The profile's PCI hierarchy as sysfs shows it (``fleetlab.pcitree``): per function its
    directory's attributes, and the ``devices`` symlink to it (absolute: ``tree_dir``, by default
    where the host has it)."""
    from fleetlab.pcitree import DEVICES_DIR, TREE_DIR, host_tree

    try:
        tree = host_tree(profile)
    except ValueError as exc:
        raise LabError(str(exc)) from exc
    out = []
    for f in tree:
        where = f"{TREE_DIR}/{f.path}"
        out += [
            HostFile(f"{where}/config", f.config),
            HostFile(f"{where}/vendor", f"{f.vendor:#06x}\n", 0o444),
            HostFile(f"{where}/device", f"{f.device:#06x}\n", 0o444),
            HostFile(f"{where}/class", f"{f.klass:#08x}\n", 0o444),
            HostFile(f"{DEVICES_DIR}/{f.bdf}", "", link_to=f"{tree_dir or TREE_DIR}/{f.path}"),
        ]
    return out


def _load(profile_name: str) -> LabProfile:
    from fleetlab.profiles import load_profile

    try:
        return load_profile(profile_name)
    except ValueError as exc:
        raise LabError(f"lab profile: {exc}") from exc


def gpu_files(profile_name: str) -> list[HostFile]:
    """The simulated GPUs' profile, driver version text, live-state dir (tmpfiles.d) and PCI devices."""
    profile = _load(profile_name)
    return [
        HostFile(NVML_PROFILE_PATH, profile.render()),
        HostFile(PROC_DRIVER_SOURCE + "/nvidia/version", profile.proc_driver_version_text(), 0o444),
        HostFile("/etc/tmpfiles.d/fleet-lab.conf", f"d {NVML_STATE_DIR} 1777 root root -\n"),
        *pci_files(profile),
    ]


def bare_gpu_files(profile_name: str) -> list[HostFile]:
    """A host with GPUs and no driver: only the hardware description the driver will find.

    The stand-in driver package (``fleetlab.apt_repo``) loads it at boot; until then there is no
    ``libnvidia-ml.so.1``, no NVML profile and no ``/proc/driver/nvidia``.
    """
    profile = _load(profile_name)
    return [
        HostFile(HARDWARE_PROFILE, profile.render()),
        HostFile("/etc/tmpfiles.d/fleet-lab.conf", f"d {NVML_STATE_DIR} 1777 root root -\n"),
        *pci_files(profile),
    ]


def power_on(root: Path) -> None:
    """What a power cycle forgets: the loaded kernel module's ``/proc/driver`` (reloaded at boot)."""
    proc_driver = _inside(root, PROC_DRIVER_SOURCE)
    shutil.rmtree(proc_driver, ignore_errors=True)
    proc_driver.mkdir(parents=True, exist_ok=True)


def _owner_ids(root: Path, user: str) -> tuple[int, int]:
    """uid and gid of ``user`` in the host's own /etc/passwd (not the control machine's)."""
    if user == "root":
        return 0, 0
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise LabError(f"user {user!r} is missing from {root}/etc/passwd; rebuild the base (remove the cache dir)")


def _inside(root: Path, path: str) -> Path:
    """``path`` inside ``root``, refusing a path that resolves outside it (a symlink in the host)."""
    target = root / path.lstrip("/")
    parent = target.parent.resolve()
    if parent != root.resolve() and root.resolve() not in parent.parents:
        raise LabError(f"{path} in {root} resolves outside the host root ({parent}); refusing to write it")
    return target


def install_files(root: Path, files: list[HostFile]) -> None:
    """Write ``files`` into the host root (atomically each), with modes and owners."""
    for f in files:
        uid, gid = _owner_ids(root, f.owner)
        target = _inside(root, f.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.owner != "root":
            for d in (target.parent,):
                d.chmod(0o700)
                shutil.chown(d, uid, gid)
        tmp = target.with_name(f".{target.name}.fleet-lab-tmp")
        tmp.unlink(missing_ok=True)
        if f.link_to is not None:
            tmp.symlink_to(f.link_to)
            os.lchown(tmp, uid, gid)
        else:
            if isinstance(f.content, bytes):
                tmp.write_bytes(f.content)
            else:
                tmp.write_text(f.content)
            tmp.chmod(f.mode)
            shutil.chown(tmp, uid, gid)
        tmp.replace(target)


def install_shim(root: Path, shim: Path) -> None:
    """Put the NVML shim where dlopen("libnvidia-ml.so.1") finds it, and refresh the loader cache."""
    target = _inside(root, SHIM_PATH)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(".libnvidia-ml.fleet-lab-tmp")
    shutil.copyfile(shim, tmp)
    tmp.chmod(0o755)
    tmp.replace(target)
    result = subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LabError(f"ldconfig -r {root} failed: {result.stderr.strip()}")


def ensure_machine_id(root: Path) -> None:
    """Give the host its own machine-id once (the base's is empty)."""
    path = root / "etc/machine-id"
    if not path.is_file() or not path.read_text().strip():
        path.write_text(uuid.uuid4().hex + "\n")
