"""fleet's NVML probe: run on a GPU host with the host's own Python (3.6 or newer) and pynvml.

Self-contained on purpose (standard library + ``pynvml`` from nvidia-ml-py, nothing from fleet):
``fleet.facts.nvml.NvmlProbe`` sends this file's text to the host together with the pynvml
module of fleet's own environment (unmodified, carried in the same command, so nothing needs to
be installed on the host) and runs it in one SSH round trip. It prints one JSON object on the
last line of stdout and always exits 0: a host without NVML, without a driver, with a
library/kernel-module mismatch or without GPUs gives a ``status``, never a traceback.

Written for Python 3.6 (Ubuntu 18.04's python3) and newer: no ``from __future__ import
annotations`` (3.7), annotations from ``typing``, %-formatting. Run on its own
(``python3 -m fleet.facts.nvml_probe``) it imports the pynvml of that Python's environment.

Every NVML call that fails is recorded under ``errors`` by its pynvml error class without the
``NVMLError_`` prefix (``NotSupported``, ``FunctionNotFound``, ...), so an older driver that
lacks a function shows as ``FunctionNotFound`` rather than crashing the probe. NVML semantics
followed here are those of ``nvml.h`` and ``pynvml.py`` (nvidia-ml-py 13.x):

* ``nvmlInit`` failures: ``NVML_ERROR_LIBRARY_NOT_FOUND``, ``DRIVER_NOT_LOADED``,
  ``LIB_RM_VERSION_MISMATCH`` (library and kernel module of different versions),
  ``GPU_NOT_FOUND`` / ``NO_PERMISSION``;
* NVLink links are counted with ``nvmlDeviceGetNvLinkState`` until the first error (past the last
  link a driver answers ``NOT_SUPPORTED`` or ``INVALID_ARGUMENT``), not with
  ``nvmlDeviceGetNvLinkCapability`` (B200/B300 answer it for every index below the bound);
* ``NVML_P2P_CAPS_INDEX_READ`` is the tuple ``(0,)`` in pynvml (a trailing comma), so the READ
  index is passed as the literal 0;
* ``nvmlDeviceGetMemoryInfo(h, nvmlMemory_v2)`` separates the driver's ``reserved`` memory from
  ``used`` (v1 ``used`` includes it).
"""

import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

SCHEMA = 1
#: nvml.h: NVML_P2P_CAPS_INDEX_READ = 0, NVML_P2P_CAPS_INDEX_NVLINK = 2
P2P_READ = 0
P2P_NVLINK = 2
#: nvml.h: NVML_NVLINK_MAX_LINKS is 18 in pynvml 12.x and 36 in 13.x; an upper bound only
LINK_BOUND = 36
INIT_STATUS = {
    "LibraryNotFound": "no-nvml-library",
    "DriverNotLoaded": "driver-not-loaded",
    "LibRmVersionMismatch": "lib-rm-version-mismatch",
    "GpuNotFound": "no-gpus",
    "NoPermission": "no-permission",
}


def pynvml_origin(module: Any) -> Optional[str]:
    """Where the pynvml that answers comes from: the copy fleet carries with the probe (its import
    spec's origin, ``fleet:nvidia-ml-py==<version>/pynvml.py``) or a file of this Python's environment."""
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return str(origin)[:300] if origin else None


def error_class(exc: BaseException) -> str:
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name[len("NVMLError_") :]
    if name == "NVMLError":
        return "NVMLError(%s)" % getattr(exc, "value", "?")
    return "exception:" + name


def kernel_module() -> Optional[Dict[str, Any]]:
    """The loaded kernel module's version, from /proc/driver/nvidia/version (None: not loaded)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline().strip()
    except OSError:
        return None
    version = None
    for word in first.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            version = word
            break
    return {"version": version, "line": first[:300]}


def cuda_compat() -> List[str]:
    """CUDA versions whose forward-compatibility libraries are installed: ``X.Y`` of each
    ``/usr/local/cuda-X.Y/compat/libcuda.so.1`` (what the ``cuda-compat-X-Y`` package installs,
    NVIDIA "CUDA Compatibility", "Forward Compatibility"), sorted, at most 16."""
    root = "/usr/local"
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for name in names:
        version = name[len("cuda-") :] if name.startswith("cuda-") else ""
        parts = version.split(".")
        well_formed = len(parts) == 2 and all(p.isdigit() and 0 < len(p) < 3 for p in parts)
        if well_formed and os.path.exists(os.path.join(root, name, "compat", "libcuda.so.1")):
            out.append(version)
    return out[:16]


def pci_gpu_count() -> Optional[int]:
    """NVIDIA display/3D controllers on the PCI bus (sysfs), whether or not NVML enumerates them."""
    root = "/sys/bus/pci/devices"
    try:
        names = os.listdir(root)
    except OSError:
        return None
    count = 0
    for name in names:
        try:
            with open(os.path.join(root, name, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(root, name, "class")) as f:
                klass = f.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass[:6] in ("0x0302", "0x0300"):
            count += 1
    return count


def package_versions() -> Dict[str, Optional[str]]:
    """Installed versions of nvidia-ml-py and vLLM for this interpreter, read from the
    ``*.dist-info`` folder names on sys.path (importlib.metadata costs 100+ ms to import)."""
    wanted = {"nvidia_ml_py": "nvidia-ml-py", "vllm": "vllm"}
    out: Dict[str, Optional[str]] = {v: None for v in wanted.values()}
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            if not name.endswith(".dist-info"):
                continue
            dist, _, version = name[: -len(".dist-info")].partition("-")
            key = wanted.get(dist.lower().replace("-", "_").replace(".", "_"))
            if key is not None and out[key] is None:
                out[key] = version
    return out


def process_info(pid: int) -> Dict[str, Any]:
    """Name and systemd unit of a process on this host (what the audit calls ours or not)."""
    info: Dict[str, Any] = {"comm": None, "unit": None}
    try:
        with open("/proc/%d/comm" % pid) as f:
            info["comm"] = f.read().strip()[:64]
    except OSError:
        pass
    try:
        with open("/proc/%d/cgroup" % pid) as f:
            for line in f:
                for part in line.strip().split("/"):
                    if part.endswith(".service") or part.endswith(".scope"):
                        info["unit"] = part[:128]
    except OSError:
        pass
    return info


class Probe:
    def __init__(self, nvml: Any) -> None:
        self.N = nvml
        self.errors: Dict[str, str] = {}

    def call(self, key: str, fn_name: str, *args: Any) -> Any:
        """Call pynvml.<fn_name>(*args); on failure record the error class under ``key``."""
        fn = getattr(self.N, fn_name, None)
        if fn is None:
            self.errors[key] = "FunctionNotFound"
            return None
        try:
            return fn(*args)
        except Exception as exc:  # NVMLError, NVMLLibraryMismatchError, ctypes errors
            self.errors[key] = error_class(exc)
            return None

    def first(self, key: str, names: Tuple[str, ...], *args: Any) -> Any:
        """The first of several spellings of one query that answers (newer name first)."""
        for name in names:
            value = self.call(key, name, *args)
            if value is not None:
                self.errors.pop(key, None)
                return value
            if self.errors.get(key) != "FunctionNotFound":
                return None
        return None

    def gpu(self, i: int, h: Any) -> Dict[str, Any]:
        N = self.N
        p = "gpu%d." % i
        g: Dict[str, Any] = {"index": i}
        g["name"] = self.call(p + "name", "nvmlDeviceGetName", h)
        g["board_part_number"] = self.call(p + "board_part_number", "nvmlDeviceGetBoardPartNumber", h)
        g["uuid"] = self.call(p + "uuid", "nvmlDeviceGetUUID", h)
        g["serial"] = self.call(p + "serial", "nvmlDeviceGetSerial", h)
        g["vbios"] = self.call(p + "vbios", "nvmlDeviceGetVbiosVersion", h)
        g["inforom"] = self.call(p + "inforom", "nvmlDeviceGetInforomImageVersion", h)
        pci = self.call(p + "pci", "nvmlDeviceGetPciInfo", h)
        g["bus_id"] = str(pci.busId).upper() if pci is not None else None
        g["pci_device_id"] = int(pci.pciDeviceId) if pci is not None else None
        g["architecture"] = self.call(p + "architecture", "nvmlDeviceGetArchitecture", h)
        cc = self.call(p + "compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
        g["compute_capability"] = list(cc) if cc is not None else None
        v2 = getattr(N, "nvmlMemory_v2", None)
        mem = self.call(p + "memory", "nvmlDeviceGetMemoryInfo", h, v2) if v2 is not None else None
        if mem is not None:
            g["memory"] = {"total": mem.total, "reserved": mem.reserved, "used": mem.used, "free": mem.free}
        else:
            g["memory"] = None
            mem1 = self.call(p + "memory_v1", "nvmlDeviceGetMemoryInfo", h)
            if mem1 is not None:
                g["memory_v1"] = {"total": mem1.total, "used": mem1.used, "free": mem1.free}
        ecc = self.call(p + "ecc_mode", "nvmlDeviceGetEccMode", h)
        g["ecc_mode"] = list(ecc) if ecc is not None else None
        if ecc is not None and ecc[0] == 1:
            counts: Dict[str, Any] = {}
            for name, etype, ctype in (
                ("corrected_volatile", 0, 0),
                ("uncorrected_volatile", 1, 0),
                ("corrected_aggregate", 0, 1),
                ("uncorrected_aggregate", 1, 1),
            ):
                counts[name] = self.call(p + "ecc." + name, "nvmlDeviceGetTotalEccErrors", h, etype, ctype)
            g["ecc_errors"] = counts
        else:
            g["ecc_errors"] = None
        rows = self.call(p + "remapped_rows", "nvmlDeviceGetRemappedRows", h)
        g["remapped_rows"] = list(rows) if rows is not None else None
        if rows is None:
            retired: Dict[str, Any] = {}
            for name, cause in (("sbe", 0), ("dbe", 1)):
                pages = self.call(p + "retired_pages." + name, "nvmlDeviceGetRetiredPages", h, cause)
                retired[name] = len(pages) if pages is not None else None
            retired["pending"] = self.call(p + "retired_pages.pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
            g["retired_pages"] = retired
        else:
            g["retired_pages"] = None
        g["persistence"] = self.call(p + "persistence", "nvmlDeviceGetPersistenceMode", h)
        mig = self.call(p + "mig_mode", "nvmlDeviceGetMigMode", h)
        g["mig_mode"] = list(mig) if mig is not None else None
        g["power_limit_mw"] = self.call(p + "power_limit", "nvmlDeviceGetPowerManagementLimit", h)
        g["power_usage_mw"] = self.call(p + "power_usage", "nvmlDeviceGetPowerUsage", h)
        temp_gpu = getattr(N, "NVML_TEMPERATURE_GPU", 0)
        g["temperature_c"] = self.first(
            p + "temperature", ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), h, temp_gpu
        )
        clocks: Dict[str, Any] = {}
        for name, ctype in (("graphics", 0), ("sm", 1), ("mem", 2)):
            clocks[name] = self.call(p + "clock." + name, "nvmlDeviceGetClockInfo", h, ctype)
            clocks["max_" + name] = self.call(p + "max_clock." + name, "nvmlDeviceGetMaxClockInfo", h, ctype)
        g["clocks"] = clocks
        g["clock_event_reasons"] = self.first(
            p + "clock_event_reasons",
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            h,
        )
        g["utilization_gpu"] = None
        util = self.call(p + "utilization", "nvmlDeviceGetUtilizationRates", h)
        if util is not None:
            g["utilization_gpu"] = util.gpu
        g["pcie"] = {
            "gen": self.call(p + "pcie.gen", "nvmlDeviceGetCurrPcieLinkGeneration", h),
            "max_gen": self.call(p + "pcie.max_gen", "nvmlDeviceGetMaxPcieLinkGeneration", h),
            "gpu_max_gen": self.call(p + "pcie.gpu_max_gen", "nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
            "width": self.call(p + "pcie.width", "nvmlDeviceGetCurrPcieLinkWidth", h),
            "max_width": self.call(p + "pcie.max_width", "nvmlDeviceGetMaxPcieLinkWidth", h),
            "replay_counter": self.call(p + "pcie.replay_counter", "nvmlDeviceGetPcieReplayCounter", h),
        }
        g["virtualization_mode"] = self.call(p + "virtualization_mode", "nvmlDeviceGetVirtualizationMode", h)
        g["nvlinks"] = self.links(p, h)
        g["fabric"] = self.fabric(p, h)
        procs = self.call(p + "processes", "nvmlDeviceGetComputeRunningProcesses", h)
        if procs is not None:
            g["processes"] = [
                dict({"pid": int(q.pid), "used_memory": _int_or_none(q.usedGpuMemory)}, **process_info(int(q.pid)))
                for q in procs
            ]
        else:
            g["processes"] = None
        return g

    def links(self, p: str, h: Any) -> List[Dict[str, Any]]:
        N = self.N
        out: List[Dict[str, Any]] = []
        bound = max(LINK_BOUND, int(getattr(N, "NVML_NVLINK_MAX_LINKS", 18)))
        for link in range(bound):
            try:
                state = N.nvmlDeviceGetNvLinkState(h, link)
            except Exception as exc:
                # Past the last link (or no NVLink visible at all): the first error ends the walk.
                self.errors[p + "nvlink.%d.state" % link] = error_class(exc)
                break
            entry: Dict[str, Any] = {"link": link, "active": int(state) == 1}
            k = p + "nvlink.%d." % link
            entry["version"] = self.call(k + "version", "nvmlDeviceGetNvLinkVersion", h, link)
            entry["remote_type"] = self.call(k + "remote_type", "nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            remote = self.first(
                k + "remote_pci",
                ("nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo"),
                h,
                link,
            )
            entry["remote_bus_id"] = str(remote.busId).upper() if remote is not None else None
            out.append(entry)
        return out

    def fabric(self, p: str, h: Any) -> Optional[Dict[str, Any]]:
        N = self.N
        ctor = getattr(N, "c_nvmlGpuFabricInfo_v2_t", None)
        fn = getattr(N, "nvmlDeviceGetGpuFabricInfoV", None)
        if ctor is None or fn is None:
            self.errors[p + "fabric"] = "FunctionNotFound"
            return None
        info = ctor()
        try:
            import ctypes

            fn(h, ctypes.byref(info))
        except Exception as exc:
            self.errors[p + "fabric"] = error_class(exc)
            return None
        raw = bytes(bytearray(info.clusterUuid))
        return {
            "state": int(info.state),
            "status": int(info.status),
            "clique_id": int(info.cliqueId),
            "cluster_uuid": raw.hex(),
        }

    def matrices(self, handles: List[Any]) -> Dict[str, Any]:
        n = len(handles)
        ancestor: List[List[Any]] = [[None] * n for _ in range(n)]
        p2p_nvlink: List[List[Any]] = [[None] * n for _ in range(n)]
        p2p_read: List[List[Any]] = [[None] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                key = "pair%d-%d." % (i, j)
                if i < j:
                    level = self.call(
                        key + "common_ancestor", "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j]
                    )
                    ancestor[i][j] = ancestor[j][i] = level
                p2p_nvlink[i][j] = self.call(
                    key + "p2p_nvlink", "nvmlDeviceGetP2PStatus", handles[i], handles[j], P2P_NVLINK
                )
                p2p_read[i][j] = self.call(key + "p2p_read", "nvmlDeviceGetP2PStatus", handles[i], handles[j], P2P_READ)
        return {"common_ancestor": ancestor, "p2p_nvlink": p2p_nvlink, "p2p_read": p2p_read}


def _int_or_none(value: Any) -> Optional[int]:
    try:
        v = int(value)
    except (TypeError, ValueError):
        return None
    # NVML_VALUE_NOT_AVAILABLE (unsigned long long -1): no per-process accounting in this context
    return None if v >= 2**64 - 1 else v


def probe() -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "schema": SCHEMA,
        "status": "ok",
        "error": None,
        "python": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "packages": package_versions(),
        "pynvml": None,
        "kernel_module": kernel_module(),
        "pci_gpus": pci_gpu_count(),
        "cuda_compat": cuda_compat(),
        "driver_version": None,
        "nvml_version": None,
        "cuda_driver_version": None,
        "gpu_count": None,
        "gpus": [],
        "topology": None,
        "errors": {},
    }
    try:
        import pynvml as N
    except ImportError as exc:
        out["status"] = "no-pynvml"
        out["error"] = {"class": "ImportError", "message": str(exc)[:300]}
        return out
    out["pynvml"] = pynvml_origin(N)
    try:
        N.nvmlInit()
    except Exception as exc:
        cls = error_class(exc)
        out["status"] = INIT_STATUS.get(cls, "nvml-error")
        out["error"] = {"class": cls, "message": str(exc)[:300]}
        return out
    probe = Probe(N)
    try:
        out["driver_version"] = probe.call("driver_version", "nvmlSystemGetDriverVersion")
        out["nvml_version"] = probe.call("nvml_version", "nvmlSystemGetNVMLVersion")
        out["cuda_driver_version"] = probe.call("cuda_driver_version", "nvmlSystemGetCudaDriverVersion")
        count = probe.call("gpu_count", "nvmlDeviceGetCount")
        out["gpu_count"] = count
        handles = []
        for i in range(count or 0):
            h = probe.call("gpu%d.handle" % i, "nvmlDeviceGetHandleByIndex", i)
            if h is None:
                continue
            handles.append(h)
            out["gpus"].append(probe.gpu(i, h))
        out["topology"] = probe.matrices(handles)
        if count == 0:
            out["status"] = "no-gpus"
    finally:
        try:
            N.nvmlShutdown()
        except Exception:
            pass
    out["errors"] = probe.errors
    return out


def main() -> None:
    try:
        result = probe()
    except Exception as exc:  # a bug here must still answer in the protocol
        result = {
            "schema": SCHEMA,
            "status": "probe-crashed",
            "error": {"class": type(exc).__name__, "message": str(exc)[:300]},
        }
    sys.stdout.write("\n" + json.dumps(result, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
