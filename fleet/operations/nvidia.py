"""The NVIDIA driver (and fabric manager on NVSwitch hosts) from NVIDIA's apt repository layout.

The repository comes from the inventory (``nvidia_apt_url``: a mirror of NVIDIA's CUDA
repository, or the lab's signed stand-in), with its public key (``nvidia_apt_keyring``: a key
file on the control machine) installed as a keyring that the deb822 source names in
``Signed-By``, so apt checks every index against that key and no other. The driver is pinned to
one version with an apt preferences file (priority 1001) and held with ``apt-mark hold``, so
neither ``apt upgrade`` nor unattended-upgrades moves it. A change of the kernel-module package
marks the host ``/var/run/reboot-required``; nothing here reboots.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.server import Arch, LinuxDistribution
from pyinfra.facts.systemd import SystemdEnabled

from fleet.facts.driver import NvidiaKernelModule
from fleet.facts.packages import DebPackageStates, RebootRequired
from fleet.operations import layout
from fleet.operations.files import Commands, Wanted, atomic_file, file_requests, files_plan, joined, read_together

KEYRING_PATH = f"{layout.KEYRING_DIR}/{layout.REPO_NAME}.gpg"
SOURCES_PATH = f"{layout.SOURCES_DIR}/{layout.REPO_NAME}.sources"
PREFERENCES_PATH = f"{layout.PREFERENCES_DIR}/{layout.REPO_NAME}"
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager.service"
#: pyinfra's CLI shows this logger's warnings; ``fleet deploy`` reads ``RebootRequired`` itself.
logger = logging.getLogger("pyinfra")

#: ``apt-get update`` of our source only: nothing else is fetched (works air-gapped).
APT_UPDATE_OURS = [
    "apt-get", "update", "-o", f"Dir::Etc::SourceList={SOURCES_PATH}", "-o", "Dir::Etc::SourceParts=-",
    "-o", "APT::Get::List-Cleanup=0",
]  # fmt: skip
APT_INSTALL = [
    "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "--no-install-recommends",
    "--allow-downgrades", "--allow-change-held-packages",
    "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
]  # fmt: skip
#: Appends the package to the reboot-required list once ($1: the package).
_REBOOT_NOTE = (
    "touch /var/run/reboot-required && "
    '{ grep -qxF -- "$1" /var/run/reboot-required.pkgs 2>/dev/null || echo "$1" >> /var/run/reboot-required.pkgs; }'
)


def host_distro() -> layout.Distro:
    """This host's distribution, from ``/etc/os-release``."""
    meta = host.get_fact(LinuxDistribution).get("release_meta") or {}
    return layout.distro_of({k: str(v) for k, v in meta.items()})


@operation()
def repository(mirror: str, keyring: str) -> Commands:
    """
    Install the repository's key and a deb822 source for NVIDIA's flat repository of this host.

    + mirror: the mirror root (inventory ``nvidia_apt_url``); the distro path is appended
    + keyring: path on the control machine of the repository's public key (binary keyring)
    """
    url = layout.repo_url(mirror, host_distro(), host.get_fact(Arch))
    wanted = [
        Wanted(KEYRING_PATH, Path(keyring).read_bytes(), 0o644),  # first: the source names it
        Wanted(SOURCES_PATH, layout.deb822_source(url, KEYRING_PATH), 0o644),
    ]
    plan = files_plan(wanted, read_together(file_requests(wanted)))  # both files' facts before either is written
    parts, stdin = plan.commands()
    if parts:
        yield joined(parts, stdin)
    else:
        host.noop("NVIDIA apt repository in place")


@operation()
def driver(version: str, fabric_manager: bool = False) -> Commands:
    """
    Install the NVIDIA driver ``version`` (and its fabric manager), pinned and held.

    + version: the driver version, e.g. ``580.95.05``
    + fabric_manager: also install and enable the fabric manager (NVSwitch hosts)
    """
    distro = host_distro()
    packages = list(layout.driver_packages(distro, version))
    if fabric_manager:
        packages.append(layout.fabric_manager_package(version))
    installed = host.get_fact(DebPackageStates)
    wrong = [p for p in packages if p not in installed or layout.upstream_version(installed[p]["version"]) != version]
    if wrong and not any(p in installed for p in packages) and host.get_fact(NvidiaKernelModule) == version:
        host.noop(f"NVIDIA driver {version} is loaded and was not installed from packages; left alone")
        return
    yield from atomic_file._inner(path=PREFERENCES_PATH, content=layout.apt_preferences(packages, version), mode=0o644)
    if wrong:
        yield shlex.join(APT_UPDATE_OURS)
        yield shlex.join([*APT_INSTALL, *packages])
        module = layout.kernel_module_package(distro, version)
        if module in wrong:
            yield shlex.join(["sh", "-c", _REBOOT_NOTE, "fleet-reboot-note", module])
    unheld = [p for p in packages if p in wrong or not installed[p]["held"]]
    if unheld:
        yield shlex.join(["apt-mark", "hold", *unheld])
    if fabric_manager and not host.get_fact(SystemdEnabled, services=[FABRIC_MANAGER_UNIT]).get(FABRIC_MANAGER_UNIT):
        yield shlex.join(["systemctl", "enable", FABRIC_MANAGER_UNIT])
    if not wrong and not unheld:
        host.noop(f"NVIDIA driver {version} installed and held")


@operation()
def cuda_packages(packages: list[str]) -> Commands:
    """
    Install CUDA packages from NVIDIA's repository: ``cuda-toolkit-X-Y`` (``/usr/local/cuda-X.Y``)
    and ``cuda-compat-X-Y`` (``/usr/local/cuda-X.Y/compat``). Their names carry the CUDA version,
    so an installed package is the one asked for; nothing is done then. Nothing here needs a reboot
    (the compat library is found through the vLLM units' ``LD_LIBRARY_PATH``).

    + packages: package names, e.g. ``["cuda-compat-13-0"]``
    """
    installed = host.get_fact(DebPackageStates)
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    yield shlex.join(APT_UPDATE_OURS)
    yield shlex.join([*APT_INSTALL, *missing])


@operation()
def reboot_required() -> Commands:
    """
    Report (never act on) a pending reboot: ``/var/run/reboot-required`` and the packages that
    asked for it, as a warning naming the host. Changes nothing.
    """
    packages = host.get_fact(RebootRequired)
    if packages is None:
        host.noop("no reboot required")
        return
    names = ", ".join(packages) or "unnamed packages"
    logger.warning(
        "%s: reboot required (%s); fleet reboots a host only when asked (fleet deploy --reboot)", host.name, names
    )
    host.noop(f"reboot required by {names}")
    yield from ()
