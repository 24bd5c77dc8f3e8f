"""Which NVIDIA driver and CUDA a vLLM release needs: the facts the inventory's
``nvidia_driver_version`` is checked against and defaulted from (``fleet.operations.layout``
installs it), the audit's ``cuda-driver-too-old`` rule and the plan's cuda-compat decision
(``fleet.plan.cuda``) read.

* vLLM 0.20 and later ship CUDA 13.0 builds (``vllm/envs.py``: ``VLLM_MAIN_CUDA_VERSION``
  defaults to ``"13.0"``; the 0.33.0 wheel pins ``torch==2.14.0``, whose wheels depend on CUDA
  13.0.x and link ``libcudart.so.13``); 0.14-0.18: CUDA 12.9; 0.11: 12.8.
* NVIDIA's "CUDA Compatibility" guide, "Minor Version Compatibility", table 1: CUDA 13.x needs
  driver 580 or newer, CUDA 12.x 525 to 579. A CUDA version here is NVML's integer
  (``nvmlSystemGetCudaDriverVersion``: 1000 x major + 10 x minor, ``13000`` for 13.0).
"""

from __future__ import annotations

import re

from fleet.errors import FleetError

#: The oldest driver branch whose CUDA user-space compatibility covers vLLM 0.33's CUDA 13.0.
MIN_DRIVER_BRANCH = {"0.33": 580}
#: The driver each vLLM series is deployed with unless the inventory pins one (580 branch: CUDA 13.x
#: user space).
DEFAULT_DRIVER = {"0.33": "580.95.05"}

#: (vLLM series from, its CUDA), newest first.
VLLM_CUDA: tuple[tuple[tuple[int, int], int], ...] = (
    ((0, 20), 13000),
    ((0, 14), 12090),
    ((0, 11), 12080),
)
#: The oldest driver branch of each CUDA major (NVIDIA's minor-version compatibility table).
CUDA_MAJOR_DRIVER = {13: 580, 12: 525, 11: 450}
#: The inventory's ``nvidia_driver_version`` that leaves the host's driver as it is (fleet then
#: installs no driver, pins nothing, and needs no reboot; cuda-compat may bridge a too-old one).
KEEP = "keep"

_VERSION = re.compile(r"^\d{3}\.\d{1,3}(\.\d{1,3})?$")


class LayoutError(FleetError):
    """A host or an inventory value the NVIDIA layout cannot serve."""


def branch_of(version: str) -> str:
    """``580`` of ``580.95.05``."""
    return version.split(".", 1)[0]


def check_driver_version(version: str, vllm_version: str) -> str:
    """The driver version, checked for form and against what the vLLM release needs."""
    if not _VERSION.match(version):
        raise LayoutError(f"nvidia_driver_version {version!r} is not a driver version like 580.95.05")
    series = ".".join(vllm_version.split(".")[:2])
    minimum = MIN_DRIVER_BRANCH.get(series)
    if minimum is not None and int(branch_of(version)) < minimum:
        raise LayoutError(
            f"nvidia_driver_version {version}: vLLM {vllm_version} (CUDA 13) needs driver branch {minimum} or newer"
        )
    return version


def vllm_cuda_requirement(version: str) -> int | None:
    """The CUDA (NVML's integer, ``13000``) vLLM ``version``'s wheels are built for; None: not known."""
    m = re.match(r"^(\d+)\.(\d+)", version)
    if not m:
        return None
    key = (int(m.group(1)), int(m.group(2)))
    for since, cuda in VLLM_CUDA:
        if key >= since:
            return cuda
    return None


def cuda_label(v: int) -> str:
    """``13.0`` of NVML's ``13000`` (``NVML_CUDA_DRIVER_VERSION_MAJOR/MINOR`` in ``nvml.h``)."""
    return f"{v // 1000}.{(v % 1000) // 10}"


def driver_for_cuda(v: int) -> int | None:
    """The oldest driver branch whose minor-version compatibility covers CUDA ``v``."""
    return CUDA_MAJOR_DRIVER.get(v // 1000)
