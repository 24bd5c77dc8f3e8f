"""The simulated NVML library, driven by the unmodified pynvml in a subprocess.

Each probe runs in a fresh interpreter because pynvml loads ``libnvidia-ml.so.1`` once per
process, through ``LD_LIBRARY_PATH`` read at process start. Expectations are computed from the
profile and the catalogue, plus hard-coded spot checks of public facts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.gpus import CATALOGUE
from fleetlab.nvml import LIBRARY_NAME, build_shim
from fleetlab.profiles import TOPOLOGY_LEVELS, LabProfile, list_profiles, load_profile

NOT_SUPPORTED = {"error": "NVMLError_NotSupported"}
GiB = 1024**3

PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    import pynvml as N

    def call(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except N.NVMLError as exc:
            return {"error": type(exc).__name__}

    def links_of(h):
        links, link = [], 0
        while True:
            try:
                state = N.nvmlDeviceGetNvLinkState(h, link)
            except N.NVMLError as exc:
                return links, type(exc).__name__
            links.append({
                "state": state,
                "version": N.nvmlDeviceGetNvLinkVersion(h, link),
                "remote_type": N.nvmlDeviceGetNvLinkRemoteDeviceType(h, link),
                "remote_bus": N.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId,
                "p2p_cap": N.nvmlDeviceGetNvLinkCapability(h, link, N.NVML_NVLINK_CAP_P2P_SUPPORTED),
            })
            link += 1

    def fields(h):
        ids = [N.NVML_FI_DEV_NVLINK_LINK_COUNT, N.NVML_FI_DEV_NVSWITCH_CONNECTED_LINK_COUNT,
               (N.NVML_FI_DEV_NVLINK_GET_STATE, 0), (N.NVML_FI_DEV_NVLINK_GET_VERSION, 0)]
        return [v.value.uiVal if v.nvmlReturn == 0 else {"ret": v.nvmlReturn}
                for v in N.nvmlDeviceGetFieldValues(h, ids)]

    def fabric(h):
        info = N.c_nvmlGpuFabricInfo_v3_t()
        ret = call(N.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info))
        if isinstance(ret, dict):
            return ret
        return {"state": info.state, "status": info.status, "clique": info.cliqueId,
                "uuid": bytes(info.clusterUuid).hex()}

    def gpu(i, h, hs):
        pci = N.nvmlDeviceGetPciInfo(h)
        m1 = N.nvmlDeviceGetMemoryInfo(h)
        m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        uuid = N.nvmlDeviceGetUUID(h)
        links, links_end = links_of(h)
        ecc = call(N.nvmlDeviceGetEccMode, h)
        return {
            "name": N.nvmlDeviceGetName(h), "uuid": uuid, "serial": call(N.nvmlDeviceGetSerial, h),
            "bus": pci.busId, "bus_legacy": pci.busIdLegacy, "device_id": pci.pciDeviceId,
            "index": N.nvmlDeviceGetIndex(h), "minor": N.nvmlDeviceGetMinorNumber(h),
            "by_uuid": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuid)),
            "by_bus": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(pci.busId)),
            "by_bus_lower": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy.lower())),
            "arch": N.nvmlDeviceGetArchitecture(h),
            "mem_v1": [m1.total, m1.free, m1.used],
            "mem_v2": [m2.total, m2.reserved, m2.free, m2.used],
            "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
            "ecc": ecc,
            "ecc_unc_vol": call(N.nvmlDeviceGetTotalEccErrors, h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                N.NVML_VOLATILE_ECC),
            "ecc_cor_agg": call(N.nvmlDeviceGetTotalEccErrors, h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                N.NVML_AGGREGATE_ECC),
            "remapped": call(lambda: list(N.nvmlDeviceGetRemappedRows(h))),
            "retired": call(N.nvmlDeviceGetRetiredPages_v2, h, 0),
            "mig": call(N.nvmlDeviceGetMigMode, h),
            "persistence": N.nvmlDeviceGetPersistenceMode(h),
            "power": [N.nvmlDeviceGetPowerManagementLimit(h), N.nvmlDeviceGetEnforcedPowerLimit(h)],
            "power_usage": N.nvmlDeviceGetPowerUsage(h),
            "temp": [N.nvmlDeviceGetTemperature(h, 0), N.nvmlDeviceGetTemperatureV(h, 0)],
            "pcie": [N.nvmlDeviceGetCurrPcieLinkGeneration(h), N.nvmlDeviceGetCurrPcieLinkWidth(h),
                     N.nvmlDeviceGetMaxPcieLinkGeneration(h), N.nvmlDeviceGetMaxPcieLinkWidth(h),
                     N.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)],
            "links": links, "links_end": links_end,
            "fields": fields(h),
            "fabric": fabric(h),
            "numa": call(N.nvmlDeviceGetNumaNodeId, h),
            "topo": [N.nvmlDeviceGetTopologyCommonAncestor(h, p) for j, p in enumerate(hs) if j != i],
            "p2p_read": [N.nvmlDeviceGetP2PStatus(h, p, 0) for j, p in enumerate(hs) if j != i],
            "p2p_nvlink": [N.nvmlDeviceGetP2PStatus(h, p, N.NVML_P2P_CAPS_INDEX_NVLINK)
                           for j, p in enumerate(hs) if j != i],
            "procs": [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
            "board": call(N.nvmlDeviceGetBoardPartNumber, h),
            "vbios": call(N.nvmlDeviceGetVbiosVersion, h),
            "bar1": call(lambda: N.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total),
            "clocks": [call(N.nvmlDeviceGetClockInfo, h, N.NVML_CLOCK_SM),
                       call(N.nvmlDeviceGetMaxClockInfo, h, N.NVML_CLOCK_SM),
                       call(N.nvmlDeviceGetMaxClockInfo, h, N.NVML_CLOCK_MEM)],
            "clock_events": N.nvmlDeviceGetCurrentClocksEventReasons(h),
            "virtualization": N.nvmlDeviceGetVirtualizationMode(h),
            "pcie_speed": N.nvmlDeviceGetPcieSpeed(h),
            "pstate": N.nvmlDeviceGetPerformanceState(h),
            "util": [N.nvmlDeviceGetUtilizationRates(h).gpu, N.nvmlDeviceGetUtilizationRates(h).memory],
            "compute_mode": N.nvmlDeviceGetComputeMode(h),
            "power_constraints": N.nvmlDeviceGetPowerManagementLimitConstraints(h),
            "default_ecc": call(N.nvmlDeviceGetDefaultEccMode, h),
            "mem_affinity": list(N.nvmlDeviceGetMemoryAffinity(h, 2, 0)),
            "cores": N.nvmlDeviceGetNumGpuCores(h),
            "mps": N.nvmlDeviceGetMPSComputeRunningProcesses(h),
            "topo_self": call(N.nvmlDeviceGetTopologyCommonAncestor, h, h),
            "cap_past_end": call(N.nvmlDeviceGetNvLinkCapability, h, 36, 0),
        }

    try:
        N.nvmlInit()
    except N.NVMLError as exc:
        print(json.dumps({"init_error": type(exc).__name__}))
        sys.exit(0)
    try:
        hs = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
        print(json.dumps({
            "driver": N.nvmlSystemGetDriverVersion(), "nvml": N.nvmlSystemGetNVMLVersion(),
            "cuda": N.nvmlSystemGetCudaDriverVersion(), "cuda_v2": N.nvmlSystemGetCudaDriverVersion_v2(),
            "gpus": [gpu(i, h, hs) for i, h in enumerate(hs)],
        }))
    finally:
        N.nvmlShutdown()
    """
)


# ---- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The simulated library, built once for this module."""
    return build_shim(tmp_path_factory.mktemp("nvml-shim")).parent


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process to stand for a GPU-memory holder; always stopped afterwards."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def write_profile(tmp_path: Path, profile: LabProfile) -> Path:
    path = tmp_path / f"{profile.name}.profile"
    path.write_text(profile.render())
    return path


def run_python(shim_dir: Path, profile_file: Path, state_dir: Path, script: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter that loads the shim as libnvidia-ml.so.1."""
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(shim_dir),
        "FLEET_NVML_PROFILE": str(profile_file),
        "FLEET_NVML_STATE_DIR": str(state_dir),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def probe(shim_dir: Path, profile_file: Path, state_dir: Path) -> dict[str, Any]:
    return run_python(shim_dir, profile_file, state_dir, PROBE)


def bus(slot_bus: str) -> str:
    return slot_bus


# ---- expectations from the profile --------------------------------------------------------------


def expected_gpu(profile: LabProfile, index: int) -> dict[str, Any]:
    """What pynvml must read for one enumerated GPU, computed from the profile and catalogue."""
    sku = profile.sku
    gpu = profile.enumerated[index]
    peers = [p for p in profile.enumerated if p.slot != gpu.slot]
    used = gpu.baseline_used
    reserved = profile.memory_reserved
    visible_links = sku.nvlink_links and not profile.passthrough
    links = [
        {
            "state": int(link.active),
            "version": sku.nvlink_version,
            "remote_type": link.remote_type,
            "remote_bus": link.remote.nvml,
            "p2p_cap": 1,
        }
        for link in (profile.links(gpu.slot) if visible_links else ())
    ]
    switch_links = sum(1 for link in profile.links(gpu.slot) if link.active and link.remote_type == 2)
    fabric: dict[str, Any] = NOT_SUPPORTED
    if sku.fabric_info and profile.fabric_info is not None:
        f = profile.fabric_info
        fabric = {"state": f.state, "status": f.status, "clique": f.clique_id, "uuid": f.cluster_uuid.hex}
    return {
        "name": sku.nvml_name,
        "uuid": gpu.uuid,
        "serial": gpu.serial if sku.has_serial else NOT_SUPPORTED,
        "bus": gpu.bus_id.nvml,
        "bus_legacy": gpu.bus_id.nvml[4:],
        "device_id": sku.pci_device_id,
        "index": index,
        "minor": gpu.slot,
        "by_uuid": index,
        "by_bus": index,
        "by_bus_lower": index,
        "arch": sku.architecture,
        "mem_v1": [sku.memory_total, sku.memory_total - reserved - used, reserved + used],
        "mem_v2": [sku.memory_total, reserved, sku.memory_total - reserved - used, used],
        "cc": list(sku.compute_capability),
        "ecc": [1, 1] if sku.ecc else NOT_SUPPORTED,
        "ecc_unc_vol": gpu.ecc_errors[2] if sku.ecc else NOT_SUPPORTED,
        "ecc_cor_agg": gpu.ecc_errors[1] if sku.ecc else NOT_SUPPORTED,
        "remapped": list(gpu.remapped_rows) if sku.ecc else NOT_SUPPORTED,
        "retired": NOT_SUPPORTED,  # Ampere+ remap rows instead of retiring pages
        "mig": [0, 0] if sku.mig else NOT_SUPPORTED,
        "persistence": int(profile.persistence),
        "power": [sku.power_limit_mw, sku.power_limit_mw],
        "power_usage": profile.power_usage_w * 1000,
        "temp": [profile.temperature_c, profile.temperature_c],
        "pcie": [gpu.pcie_gen, gpu.pcie_width, sku.pcie_generation, sku.pcie_width, sku.pcie_generation],
        "links": links,
        # a real driver answers NOT_SUPPORTED past the last link (and on every link it does not show)
        "links_end": "NVMLError_NotSupported",
        "fields": [sku.nvlink_links, switch_links, links[0]["state"], sku.nvlink_version]
        if visible_links
        else [{"ret": 3}] * 4,
        "fabric": fabric,
        "numa": NOT_SUPPORTED,
        "topo": [profile.pcie_levels[gpu.slot][p.slot] for p in peers],
        "p2p_read": [profile.p2p_status(gpu.slot, p.slot)[0] for p in peers],
        "p2p_nvlink": [profile.p2p_status(gpu.slot, p.slot)[2] for p in peers],
        "procs": [],
        "board": sku.board_part_numbers[0] if sku.board_part_numbers else NOT_SUPPORTED,
        "vbios": sku.vbios_version or NOT_SUPPORTED,
        "bar1": sku.bar1_total,
        "clocks": [sku.clock_graphics_idle_mhz, sku.clock_graphics_max_mhz, sku.clock_memory_mhz],
        "clock_events": 1,  # NVML_CLOCKS_EVENT_REASON_GPU_IDLE
        "virtualization": 1 if profile.passthrough else 0,
        "pcie_speed": {3: 8000, 4: 16000, 5: 32000}[gpu.pcie_gen],
        "pstate": 0,
        "util": [0, 0],
        "compute_mode": 0,
        "power_constraints": [sku.power_min_mw, sku.power_limit_mw],
        "default_ecc": [1] if sku.ecc else NOT_SUPPORTED,
        "mem_affinity": [1 << profile.numa_nodes[gpu.slot], 0],
        "cores": sku.cuda_cores,
        "mps": [],
        "topo_self": NOT_SUPPORTED,
        # nvmlDeviceGetNvLinkCapability checks the link index first: past the last link
        "cap_past_end": {"error": "NVMLError_InvalidArgument"} if sku.nvlink_links else NOT_SUPPORTED,
    }


def islands_from_probe(gpus: list[dict[str, Any]]) -> set[frozenset[int]]:
    """NVLink islands as a probe derives them from what pynvml read (not from the profile)."""
    by_bus = {g["bus"]: g["index"] for g in gpus}
    switched = {g["index"] for g in gpus if any(lk["state"] and lk["remote_type"] == 2 for lk in g["links"])}
    islands = {g["index"]: {g["index"]} for g in gpus}
    if switched:
        for i in switched:
            islands[i] = set(switched)
    for g in gpus:
        for lk in g["links"]:
            peer = by_bus.get(lk["remote_bus"])
            if lk["state"] and lk["remote_type"] == 0 and peer is not None:
                merged = islands[g["index"]] | islands[peer]
                for member in merged:
                    islands[member] = merged
    return {frozenset(s) for s in islands.values()}


# ---- every profile ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_profiles())
def test_profile_reads_back_through_pynvml(name: str, shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    profile = load_profile(name)
    out = probe(shim_dir, write_profile(tmp_path, profile), state_dir)

    assert out["driver"] == profile.driver_version
    # NVML's version is the CUDA major of the driver's branch, then the driver's (13.580..., 12.570...)
    assert out["nvml"] == f"{profile.cuda_driver_version // 1000}.{profile.driver_version}"
    assert out["cuda"] == out["cuda_v2"] == profile.cuda_driver_version
    assert len(out["gpus"]) == len(profile.enumerated)
    for index, gpu in enumerate(out["gpus"]):
        assert gpu == expected_gpu(profile, index), f"{name} GPU {index}"
    host = profile.host_gpus()
    assert set(host.islands) == islands_from_probe(out["gpus"])
    assert [g.uuid for g in host.gpus] == [g["uuid"] for g in out["gpus"]]
    assert "Kernel Module  " + profile.kernel_module_version in profile.proc_driver_version_text()


# ---- hard-coded spot checks of public facts -----------------------------------------------------


@pytest.fixture
def read(shim_dir: Path, state_dir: Path, tmp_path: Path) -> Any:
    def _read(name: str) -> dict[str, Any]:
        return probe(shim_dir, write_profile(tmp_path, load_profile(name)), state_dir)

    return _read


def test_h100_sxm_is_nv18_over_four_switches(read: Any) -> None:
    out = read("h100-sxm-8")
    assert len(out["gpus"]) == 8
    for gpu in out["gpus"]:
        assert gpu["name"] == "NVIDIA H100 80GB HBM3"
        assert gpu["cc"] == [9, 0]
        assert len(gpu["links"]) == 18 and gpu["links_end"] == "NVMLError_NotSupported"
        assert {lk["version"] for lk in gpu["links"]} == {6}  # NVML_NVLINK_VERSION_4_0
        assert {lk["remote_type"] for lk in gpu["links"]} == {2}  # NVSWITCH
        assert {lk["remote_bus"] for lk in gpu["links"]} == {f"00000000:0{n}:00.0" for n in (5, 6, 7, 8)}
        assert gpu["fields"][:2] == [18, 18]
        assert gpu["fabric"]["state"] == 3
        assert gpu["p2p_nvlink"] == [0] * 7
        assert gpu["numa"] == NOT_SUPPORTED
    assert out["gpus"][0]["bus"] == "00000000:18:00.0"
    assert out["gpus"][0]["topo"] == [40, 40, 40, 50, 50, 50, 50]
    assert out["driver"] == "580.95.05" and out["cuda"] == 13000


def test_a100_is_nv12_with_two_links_per_switch(read: Any) -> None:
    out = read("a100-sxm-8")
    gpu0 = out["gpus"][0]
    assert gpu0["name"] == "NVIDIA A100-SXM4-80GB" and gpu0["bus"] == "00000000:07:00.0"
    assert gpu0["device_id"] == 0x20B210DE
    assert {lk["version"] for lk in gpu0["links"]} == {4}  # NVML_NVLINK_VERSION_3_0
    buses = [lk["remote_bus"] for lk in gpu0["links"]]
    assert sorted(set(buses)) == [f"00000000:{b}:00.0" for b in ("C4", "C5", "C6", "C7", "C8", "C9")]
    assert all(buses.count(b) == 2 for b in buses)
    assert gpu0["topo"] == [20, 50, 50, 50, 50, 50, 50]  # PXB with GPU1, SYS elsewhere
    assert gpu0["fabric"] == NOT_SUPPORTED
    assert gpu0["remapped"] == [0, 0, 0, 0]


def test_h100_pcie_bridged_pairs_match_the_real_matrix(read: Any) -> None:
    out = read("h100-pcie-8-bridged")
    nv = {
        (g["index"], j if j < g["index"] else j + 1)
        for g in out["gpus"]
        for j, status in enumerate(g["p2p_nvlink"])
        if status == 0
    }
    assert nv == {(0, 5), (5, 0), (1, 2), (2, 1), (3, 4), (4, 3), (6, 7), (7, 6)}
    pcie_sym = {v: k for k, v in TOPOLOGY_LEVELS.items()}
    assert [pcie_sym[v] for v in out["gpus"][0]["topo"]] == ["NODE", "NODE", "SYS", "SYS", "SYS", "SYS", "SYS"]
    assert [pcie_sym[v] for v in out["gpus"][3]["topo"]] == ["SYS", "SYS", "SYS", "NODE", "NODE", "NODE", "NODE"]
    assert len(out["gpus"][0]["links"]) == 12
    assert {lk["remote_bus"] for lk in out["gpus"][0]["links"]} == {out["gpus"][5]["bus"]}
    assert out["gpus"][0]["fields"][1] == 0  # no NVSwitch links


def test_rtx4090_has_no_ecc_serial_nvlink_or_p2p(read: Any) -> None:
    out = read("rtx4090-2")
    for gpu in out["gpus"]:
        assert gpu["ecc"] == NOT_SUPPORTED and gpu["ecc_unc_vol"] == NOT_SUPPORTED
        assert gpu["serial"] == NOT_SUPPORTED
        assert gpu["links_end"] == "NVMLError_NotSupported" and gpu["links"] == []
        assert gpu["topo"] == [30]  # PHB
        assert gpu["p2p_read"] == [2]  # NVML_P2P_STATUS_GPU_NOT_SUPPORTED
        assert gpu["mig"] == NOT_SUPPORTED


def test_l40s_topology_is_node_and_sys(read: Any) -> None:
    out = read("l40s-4")
    assert [g["topo"] for g in out["gpus"]] == [[40, 50, 50], [40, 50, 50], [50, 50, 40], [50, 50, 40]]
    assert all(g["links_end"] == "NVMLError_NotSupported" for g in out["gpus"])


def test_faults(read: Any) -> None:
    link_down = read("h100-sxm-8-link-down")["gpus"][3]
    assert link_down["links"][7]["state"] == 0
    assert sum(lk["state"] for lk in link_down["links"]) == 17
    assert link_down["fields"][1] == 17

    missing = read("h100-sxm-8-gpu-missing")
    assert len(missing["gpus"]) == 7
    assert "00000000:AB:00.0" not in [g["bus"] for g in missing["gpus"]]
    assert [g["minor"] for g in missing["gpus"]] == [0, 1, 2, 3, 4, 6, 7]

    degraded = read("h100-sxm-8-pcie-degraded")["gpus"]
    assert degraded[2]["pcie"] == [4, 8, 5, 16, 5]
    assert degraded[1]["pcie"] == [5, 16, 5, 16, 5]

    ecc = read("a100-sxm-8-ecc-errors")["gpus"]
    assert ecc[4]["ecc_unc_vol"] == 2 and ecc[4]["remapped"][1:3] == [1, 1]
    assert ecc[3]["ecc_unc_vol"] == 0

    mismatch = load_profile("h100-sxm-8-driver-mismatch")
    assert read("h100-sxm-8-driver-mismatch")["driver"] == "580.95.05"
    assert "Kernel Module  580.82.07  " in mismatch.proc_driver_version_text()


def test_mismatch_can_fail_init_like_a_real_driver(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    src = load_profile("h100-sxm-8-driver-mismatch").path.read_text()
    path = tmp_path / "strict.toml"
    path.write_text(
        src.replace('kernel_module = "580.82.07"', 'kernel_module = "580.82.07"\nfail_init_on_mismatch = true')
    )
    out = probe(shim_dir, write_profile(tmp_path, load_profile(str(path))), state_dir)
    assert out == {"init_error": "NVMLError_LibRmVersionMismatch"}


def test_passthrough_vm_shows_no_nvlink_and_says_so(read: Any) -> None:
    """One GPU passed through to a VM: NVLink invisible, virtualization mode PASSTHROUGH (1)."""
    for name, part in (
        ("h100-sxm-1-passthrough", "692-2G520-0200-000"),
        ("h200-sxm-1-passthrough", "692-2G520-0282-000"),
    ):
        (gpu,) = read(name)["gpus"]
        assert gpu["bus"] == "00000000:00:06.0" and gpu["board"] == part
        assert gpu["virtualization"] == 1
        assert gpu["links"] == [] and gpu["links_end"] == "NVMLError_NotSupported"
        assert gpu["fields"] == [{"ret": 3}] * 4
        assert gpu["topo_self"] == NOT_SUPPORTED and gpu["cap_past_end"] == {"error": "NVMLError_InvalidArgument"}
    assert load_profile("h100-sxm-1-passthrough").host_gpus().islands == (frozenset({0}),)


def test_handle_by_serial(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    profile = load_profile("a100-sxm-8")
    script = textwrap.dedent(
        f"""
        import json, pynvml as N
        N.nvmlInit()
        out = [N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleBySerial({profile.enumerated[3].serial!r}))]
        try:
            N.nvmlDeviceGetHandleBySerial("0000000000000")
        except N.NVMLError as e:
            out.append(type(e).__name__)
        print(json.dumps(out))
        """
    )
    assert run_python(shim_dir, write_profile(tmp_path, profile), state_dir, script) == [3, "NVMLError_NotFound"]


# ---- errors -------------------------------------------------------------------------------------


def test_missing_profile_is_driver_not_loaded(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    assert probe(shim_dir, tmp_path / "absent", state_dir) == {"init_error": "NVMLError_DriverNotLoaded"}


def test_wrong_struct_versions(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import ctypes, json, pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out = {}
        try:
            N.nvmlDeviceGetMemoryInfo(h, version=0x01000028)
        except N.NVMLError as e:
            out["memory"] = type(e).__name__
        info = N.c_nvmlGpuFabricInfo_v2_t()
        info.version = 0x01000024
        try:
            N.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        except N.NVMLError as e:
            out["fabric"] = type(e).__name__
        try:
            N.nvmlDeviceGetNvLinkState(h, 36)
        except N.NVMLError as e:
            out["link36"] = type(e).__name__
        try:
            N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        except N.NVMLError as e:
            out["uuid"] = type(e).__name__
        v2 = N.c_nvmlGpuFabricInfo_v2_t()
        N.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(v2))
        out["fabric_v2_state"] = v2.state
        print(json.dumps(out))
        """
    )
    profile_file = write_profile(tmp_path, load_profile("h100-sxm-8"))
    assert run_python(shim_dir, profile_file, state_dir, script) == {
        "memory": "NVMLError_ArgumentVersionMismatch",
        "fabric": "NVMLError_ArgumentVersionMismatch",
        "link36": "NVMLError_NotSupported",  # past the last link, as a real driver answers
        "uuid": "NVMLError_NotFound",
        "fabric_v2_state": 3,
    }


# ---- live state ---------------------------------------------------------------------------------


def test_live_process_memory_shows_and_goes_away(
    shim_dir: Path, state_dir: Path, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    profile = load_profile("h100-sxm-8")
    profile_file = write_profile(tmp_path, profile)
    total, reserved = profile.sku.memory_total, profile.sku.memory_reserved
    (state_dir / f"{sleeper.pid}.mem").write_text(f"0 {3 * GiB}\n3 {5 * GiB}\n3 {1 * GiB}\n")

    busy = probe(shim_dir, profile_file, state_dir)["gpus"]
    assert busy[0]["mem_v1"] == [total, total - reserved - 3 * GiB, reserved + 3 * GiB]
    assert busy[0]["mem_v2"] == [total, reserved, total - reserved - 3 * GiB, 3 * GiB]
    assert busy[0]["procs"] == [[sleeper.pid, 3 * GiB]]
    assert busy[3]["procs"] == [[sleeper.pid, 6 * GiB]]
    assert busy[1]["procs"] == [] and busy[1]["mem_v1"][2] == reserved and busy[1]["mem_v2"][3] == 0
    # a GPU in use leaves the idle clock floor and stops reporting "GPU idle" as its clock-event reason
    sku = profile.sku
    assert busy[0]["clocks"][0] == sku.clock_graphics_max_mhz and busy[0]["clock_events"] == 0
    assert busy[1]["clocks"][0] == sku.clock_graphics_idle_mhz and busy[1]["clock_events"] == 1

    sleeper.kill()
    sleeper.wait()
    free = probe(shim_dir, profile_file, state_dir)["gpus"]
    assert free[0]["mem_v1"] == [total, total - reserved, reserved] and free[0]["procs"] == []
    assert free[3]["procs"] == []


def test_baseline_is_held_beside_the_reserve_and_added_to_live(
    shim_dir: Path, state_dir: Path, tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    profile = load_profile("rtx4090-2")  # baseline_used_mib = 1
    base = profile.enumerated[1].baseline_used
    assert base == 1024**2
    (state_dir / f"{sleeper.pid}.mem").write_text(f"1 {GiB}\n")
    gpu1 = probe(shim_dir, write_profile(tmp_path, profile), state_dir)["gpus"][1]
    total = profile.sku.memory_total
    reserved = profile.sku.memory_reserved
    assert gpu1["mem_v2"] == [total, reserved, total - reserved - base - GiB, base + GiB]
    assert gpu1["mem_v1"] == [total, total - reserved - base - GiB, reserved + base + GiB]


def test_dead_and_zombie_pids_are_ignored(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    profile_file = write_profile(tmp_path, load_profile("a10-1"))
    finished = subprocess.Popen(["true"])
    finished.wait()
    (state_dir / f"{finished.pid}.mem").write_text(f"0 {GiB}\n")
    # The zombie's parent is a Python that forks it and never waits: not a child of this process,
    # where a SIGCHLD handler installed by another test (gevent's) could reap it first, and not a
    # shell, which may reap a finished background job before it execs (dash did, now and then).
    never_reaps = "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
    never_reaps += "print(pid, flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", never_reaps], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        zombie_pid = int(holder.stdout.readline())
        deadline = time.monotonic() + 10
        stat = Path(f"/proc/{zombie_pid}/stat")
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "child never became a zombie"
            time.sleep(0.01)
        (state_dir / f"{zombie_pid}.mem").write_text(f"0 {GiB}\n")
        (state_dir / "notapid.mem").write_text(f"0 {GiB}\n")
        gpu = probe(shim_dir, profile_file, state_dir)["gpus"][0]
    finally:
        holder.kill()
        holder.wait()
    assert gpu["mem_v2"][3] == 0 and gpu["procs"] == []


def test_live_state_is_reread_on_every_query(shim_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, os, pynvml as N
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        before = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2).used
        path = os.path.join({str(state_dir)!r}, f"{{os.getpid()}}.mem")
        with open(path, "w") as f:
            f.write("0 4096\\n")
        during = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2).used
        procs = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)]
        os.unlink(path)
        after = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2).used
        print(json.dumps({{"before": before, "during": during, "after": after, "procs": procs,
                           "pid": os.getpid()}}))
        """
    )
    out = run_python(shim_dir, write_profile(tmp_path, load_profile("a10-1")), state_dir, script)
    assert (out["before"], out["during"], out["after"]) == (0, 4096, 0)
    assert out["procs"] == [out["pid"]]


# ---- build and profile validation -----------------------------------------------------------------


def test_build_is_skipped_when_source_is_unchanged(shim_dir: Path) -> None:
    library = shim_dir / LIBRARY_NAME
    before = library.stat().st_mtime_ns
    assert build_shim(shim_dir) == library
    assert library.stat().st_mtime_ns == before


def test_every_profile_uses_a_catalogue_sku() -> None:
    for name in list_profiles():
        assert load_profile(name).sku is CATALOGUE[load_profile(name).sku.key]


@pytest.mark.parametrize(
    ("snippet", "field"),
    [
        ('sku = "h100-sxm-81gb"\n[driver]\nversion = "580.95.05"\ncuda = 13000\n', "'sku'"),
        (
            'sku = "l40s-48gb"\n[driver]\nversion = "580.95.05"\ncuda = 13000\n[nvlink]\nfabric = "switch"\n',
            "'nvlink.fabric'",
        ),
        ('sku = "a10-24gb"\ncount = 1\n[driver]\ncuda = 13000\n', "'driver.version'"),
        (
            'sku = "a10-24gb"\ncount = 2\n[driver]\nversion = "1"\ncuda = 13000\n[pcie]\nmatrix = ["X SYS", "PHB X"]\n',
            "'pcie.matrix'",
        ),
        ('sku = "a10-24gb"\ncount = 2\n[driver]\nversion = "1"\ncuda = 13000\n[[gpu]]\nslot = 2\n', "'gpu[0].slot'"),
    ],
)
def test_invalid_profiles_name_file_field_and_value(tmp_path: Path, snippet: str, field: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(snippet)
    with pytest.raises(ValueError, match="allowed") as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and field in str(info.value)
