"""CUDA on a host (pure): the toolkit the inventory asks for, and whether cuda-compat bridges a
driver too old for the pinned vLLM's CUDA.

The facts (public sources):

* vLLM's wheels are built for one CUDA (``fleet.inventory.drivers.VLLM_CUDA``: 13.0 for 0.20 and
  later, ``vllm/envs.py`` ``VLLM_MAIN_CUDA_VERSION``); the driver supplies ``libcuda.so.1`` and
  runs CUDA X.Y when its own CUDA (``nvmlSystemGetCudaDriverVersion``) is at least X.Y within the
  major, or from its major's oldest branch on (NVIDIA "CUDA Compatibility", "Minor Version
  Compatibility": CUDA 13.x needs driver >= 580).
* Older drivers run a newer CUDA through **forward compatibility**: the ``cuda-compat-X-Y``
  package from NVIDIA's repository puts a newer ``libcuda.so.1`` (built from the driver that
  matches CUDA X.Y) in ``/usr/local/cuda-X.Y/compat``, which the application must find first on
  ``LD_LIBRARY_PATH``. "Forward Compatibility is applicable only for systems with NVIDIA Data
  Center GPUs" (and select NGC Server Ready RTX SKUs) (same guide, "Forward Compatibility"): on a
  GeForce or RTX board the only way out is a driver upgrade.
* ``cuda-toolkit-X-Y`` (NVIDIA's CUDA installation guide, "Network Repository Installation")
  installs ``nvcc`` and the libraries in ``/usr/local/cuda-X.Y``; vLLM itself needs no toolkit,
  but JIT kernels (FlashInfer) compile with ``nvcc``.

Which driver a host runs after the deploy: the one fleet installs (``nvidia_apt_url`` with a
pinned ``nvidia_driver_version``, always new enough: ``fleet.inventory.drivers``), otherwise the
one its NVML answers (``nvidia_driver_version: keep``, or no ``nvidia_apt_url``: fleet does not
manage the driver). Only the second can need cuda-compat.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.errors import PlanError, PlanProblem
from fleet.gpus import HostGpus
from fleet.inventory.drivers import KEEP, cuda_label, driver_for_cuda, vllm_cuda_requirement
from fleet.inventory.spec import HostSpec

AUTO, NEVER = "auto", "never"


@dataclass(frozen=True)
class CudaPlan:
    """What a host gets of CUDA: packages from NVIDIA's repository and the compat library path."""

    toolkit: str | None = None  #: ``13.0``: ``cuda-toolkit-13-0``
    compat: str | None = None  #: ``13.0``: ``cuda-compat-13-0``, its libs first on LD_LIBRARY_PATH
    reasons: tuple[str, ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        out = []
        if self.toolkit:
            out.append(toolkit_package(self.toolkit))
        if self.compat:
            out.append(compat_package(self.compat))
        return tuple(out)

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        """The vLLM units' environment for it: the compat libraries first on ``LD_LIBRARY_PATH``;
        ``CUDA_HOME`` at the toolkit (where ``torch.utils.cpp_extension._find_cuda_home`` and
        FlashInfer's JIT look for ``nvcc`` first)."""
        out: list[tuple[str, str]] = []
        if self.compat:
            out.append(("LD_LIBRARY_PATH", ld_library_path(compat_lib_dir(self.compat))))
        if self.toolkit:
            out.append(("CUDA_HOME", toolkit_dir(self.toolkit)))
        return tuple(out)


def _dashed(version: str) -> str:
    return version.replace(".", "-")


def toolkit_package(version: str) -> str:
    """``cuda-toolkit-12-9`` of ``12.9``."""
    return f"cuda-toolkit-{_dashed(version)}"


def compat_package(version: str) -> str:
    """``cuda-compat-13-0`` of ``13.0``."""
    return f"cuda-compat-{_dashed(version)}"


def compat_lib_dir(version: str) -> str:
    """Where ``cuda-compat-X-Y`` puts its ``libcuda.so.1``: ``/usr/local/cuda-X.Y/compat``."""
    return f"/usr/local/cuda-{version}/compat"


def toolkit_dir(version: str) -> str:
    """Where ``cuda-toolkit-X-Y`` installs: ``/usr/local/cuda-X.Y`` (``bin/nvcc``)."""
    return f"/usr/local/cuda-{version}"


def ld_library_path(compat_dir: str, existing: str | None = None) -> str:
    """``LD_LIBRARY_PATH`` with the compat libraries first (before any other)."""
    rest = [p for p in (existing or "").split(":") if p and p != compat_dir]
    return ":".join([compat_dir, *rest])


def decide_compat(
    host: str,
    policy: str,
    vllm_version: str,
    driver_installed: str | None,
    has_repository: bool,
    driver_cuda: int | None,
    gpu_name: str,
    forward_compatible: bool | None,
) -> tuple[str | None, str]:
    """(the cuda-compat version to install or None, the reason), or ``PlanError`` with the way out.

    ``driver_installed``: the driver version the deploy installs (None: the host keeps its own);
    ``has_repository``: NVIDIA's repository is configured (``nvidia_apt_url``); ``driver_cuda``:
    the host's CUDA as NVML answers it (None: not known yet); ``forward_compatible``: the GPUs
    are data-centre boards (None: the GPU model is not in fleet's catalogue).
    """
    need = vllm_cuda_requirement(vllm_version)
    if need is None:
        return None, f"cuda-compat: fleet knows no CUDA for vLLM {vllm_version}; not planned"
    want = cuda_label(need)
    branch = driver_for_cuda(need)
    upgrade = f"upgrade the driver to branch {branch} or newer (CUDA {want})" if branch else f"a CUDA {want} driver"
    if driver_installed is not None:
        return None, f"cuda-compat not needed: the deploy installs driver {driver_installed} (CUDA {want} or newer)"
    if driver_cuda is None:
        return None, "cuda-compat: the host's driver does not answer yet; decided once NVML answers"
    have = cuda_label(driver_cuda)
    if driver_cuda >= need:
        return None, f"cuda-compat not needed: the driver runs CUDA {have}, vLLM {vllm_version} needs {want}"
    summary = f"the host's driver runs CUDA {have}, older than vLLM {vllm_version}'s CUDA {want}"
    manage = (
        "let fleet install it: remove nvidia_driver_version: keep"
        if has_repository
        else ("let fleet install it: set nvidia_apt_url and nvidia_apt_keyring")
    )
    if policy == NEVER:
        raise PlanError(
            PlanProblem(host, summary + " and cuda_compat is never", ways_out=[f"{upgrade} ({manage})",
                        "set cuda_compat: auto (data-centre GPUs: cuda-compat instead of a driver upgrade)"])
        )  # fmt: skip
    if not forward_compatible:
        why = (
            f"{gpu_name} is not a data-centre GPU: CUDA forward compatibility (cuda-compat) does not apply to it"
            if forward_compatible is False
            else f"{gpu_name} is not in fleet's GPU catalogue: fleet cannot tell whether cuda-compat applies"
        )
        raise PlanError(PlanProblem(host, summary, details=[why], ways_out=[f"{upgrade} ({manage})"]))
    if not has_repository:
        raise PlanError(
            PlanProblem(host, summary, details=[f"{compat_package(want)} comes from NVIDIA's apt repository"],
                        ways_out=["set nvidia_apt_url and nvidia_apt_keyring with nvidia_driver_version: keep "
                                  f"(cuda-compat, no driver change), or {upgrade}"])
        )  # fmt: skip
    return want, (
        f"{compat_package(want)}: {summary}; forward compatibility (data-centre {gpu_name}) instead of a driver "
        f"upgrade: {compat_lib_dir(want)} first on LD_LIBRARY_PATH"
    )


def plan_cuda(spec: HostSpec, gpus: HostGpus) -> CudaPlan:
    """The host's CUDA plan from its spec and GPU facts; ``PlanError`` where vLLM's CUDA cannot run."""
    reasons: list[str] = []
    if spec.cuda_toolkit:
        reasons.append(f"{toolkit_package(spec.cuda_toolkit)}: inventory cuda_toolkit (nvcc for JIT kernels)")
    managed = spec.nvidia_apt_url is not None and spec.nvidia_driver_version not in (None, KEEP)
    sku = gpus.sku
    names = sorted({g.name for g in gpus.gpus}) or ["the GPU"]
    compat, why = decide_compat(
        spec.name,
        spec.cuda_compat,
        spec.vllm_version,
        spec.nvidia_driver_version if managed else None,
        spec.nvidia_apt_url is not None,
        gpus.cuda_driver_version,
        " and ".join(names),
        sku.forward_compatible if sku is not None else None,
    )
    if compat is not None or spec.nvidia_driver_version == KEEP:  # elsewhere the driver answers for itself
        reasons.append(why)
    return CudaPlan(toolkit=spec.cuda_toolkit, compat=compat, reasons=tuple(reasons))
