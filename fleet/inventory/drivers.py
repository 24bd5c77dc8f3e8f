"""Which NVIDIA driver a vLLM release needs: the facts the inventory's ``nvidia_driver_version``
is checked against and defaulted from (``fleet.operations.layout`` installs it)."""

from __future__ import annotations

import re

from fleet.errors import FleetError

#: The oldest driver branch whose CUDA user-space compatibility covers vLLM 0.33's CUDA 13.0.
MIN_DRIVER_BRANCH = {"0.33": 580}
#: The driver each vLLM series is deployed with unless the inventory pins one (580 branch: CUDA 13.x
#: user space).
DEFAULT_DRIVER = {"0.33": "580.95.05"}

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
