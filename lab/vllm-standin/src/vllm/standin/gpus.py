"""The GPUs this process may use, seen through NVML (``nvidia-ml-py``).

In the lab the NVML library is fleet's shim, so "GPU memory" is whatever the shim reports:
the profile's totals minus what live processes hold (their ``<pid>.mem`` files). vLLM sees
devices through CUDA; here ``CUDA_VISIBLE_DEVICES`` is mapped to NVML indices assuming
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA index order = NVML index order), which is what fleet's
units set. Like CUDA, entries may be indices or (prefixes of) UUIDs, and the list stops at the
first entry that names no device.

Memory is what CUDA's ``cudaMemGetInfo`` would answer (vLLM's ``MemorySnapshot.measure`` in
``vllm/utils/mem_utils.py`` reads it through ``torch.accelerator.get_memory_info``): CUDA's total
is the board's memory minus the driver's reserve, which NVML reports as v2 ``reserved``
(``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)``: reserved + used + free = total);
CUDA's free is NVML v2 ``free``. Where the v2 query is not answered the reserve counts as 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vllm.standin.log import StartupError


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: its CUDA index (position in the visible list) and NVML facts."""

    cuda_index: int
    nvml_index: int
    uuid: str
    name: str
    total: int  #: CUDA's total: NVML total − the driver's reserve
    free: int  #: CUDA's free (NVML v2 free)
    compute_capability: tuple[int, int]


def _nvml() -> Any:
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _select(visible: str | None, uuids: list[str]) -> list[int]:
    """NVML indices selected by a ``CUDA_VISIBLE_DEVICES`` value (``None``: all)."""
    if visible is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if not 0 <= index < len(uuids):
                break
        else:
            matches = [i for i, u in enumerate(uuids) if u.startswith(entry) or u == "GPU-" + entry]
            if len(matches) != 1:
                break
            index = matches[0]
        if index in chosen:
            break
        chosen.append(index)
    return chosen


def nvml_init() -> Any:
    """``pynvml`` after ``nvmlInit``; a vLLM-like error when there is no usable NVML."""
    try:
        pynvml = _nvml()
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        raise StartupError("RuntimeError", f"Failed to infer device type (NVML: {exc})") from None
    return pynvml


def cuda_memory(pynvml: Any, handle: Any) -> tuple[int, int]:
    """``(free, total)`` as ``cudaMemGetInfo`` answers: NVML v2, total less the reserve."""
    try:
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        reserved = int(getattr(mem, "reserved", 0))
    except Exception:  # a library without the v2 query: no reserve known
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        reserved = 0
    return int(mem.free), int(mem.total) - reserved


def gpu_info(pynvml: Any, nvml_index: int, cuda_index: int) -> Gpu:
    """Facts about one device, memory as CUDA would report it right now."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
    free, total = cuda_memory(pynvml, handle)
    try:
        cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    except Exception:
        cc = (9, 0)
    return Gpu(
        cuda_index=cuda_index,
        nvml_index=nvml_index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        total=total,
        free=free,
        compute_capability=(int(cc[0]), int(cc[1])),
    )


#: The CUDA vLLM 0.33's wheels are built for (``torch==2.14.0``, CUDA 13.0), as NVML's integer.
BUILT_FOR_CUDA = 13000
#: The first line of the lab's stand-in ``cuda-compat`` ``libcuda.so.1`` (``fleetlab.apt_repo``).
COMPAT_MARKER = "fleet-lab-stand-in libcuda.so.1 CUDA"


def compat_cuda(ld_library_path: str | None) -> int | None:
    """The CUDA of the first ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` when it is a (stand-in)
    forward-compatibility library: the dynamic loader takes that one before the driver's, and
    ``cuDriverGetVersion`` then answers its CUDA (NVIDIA "CUDA Compatibility", "Forward
    Compatibility"). None: the driver's own ``libcuda.so.1`` is used."""
    for d in (ld_library_path or "").split(":"):
        lib = os.path.join(d, "libcuda.so.1") if d else ""
        if not lib or not os.path.exists(lib):
            continue
        try:
            with open(lib, "rb") as f:
                head = f.read(200).decode("ascii", "replace")
        except OSError:
            return None
        if not head.startswith(COMPAT_MARKER):
            return None
        major, _, minor = head[len(COMPAT_MARKER) :].split()[0].partition(".")
        return int(major) * 1000 + int(minor or 0) * 10
    return None


def check_cuda_driver(pynvml: Any) -> None:
    """Refuse as torch does (``torch/cuda/__init__.py``, ``_check_driver`` / ``_lazy_init``) when
    the CUDA the process gets (the driver's, or a compat library's) is older than the build's."""
    try:
        driver = int(pynvml.nvmlSystemGetCudaDriverVersion())
    except Exception:
        return
    found = compat_cuda(os.environ.get("LD_LIBRARY_PATH")) or driver
    if found < BUILT_FOR_CUDA:
        raise StartupError(
            "RuntimeError",
            f"The NVIDIA driver on your system is too old (found version {found}). Please update your GPU "
            "driver, or install a PyTorch version that has been compiled with your version of the CUDA driver.",
        )


def visible_gpus() -> list[Gpu]:
    """The GPUs CUDA would show this process, in CUDA order."""
    pynvml = nvml_init()
    check_cuda_driver(pynvml)
    count = pynvml.nvmlDeviceGetCount()
    uuids = [_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
    chosen = _select(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids)
    gpus = [gpu_info(pynvml, nvml_index, cuda_index) for cuda_index, nvml_index in enumerate(chosen)]
    if not gpus:
        raise StartupError("RuntimeError", "Failed to infer device type")
    return gpus
