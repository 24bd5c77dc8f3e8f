"""The simulated NVML library against what a real driver answered.

``tests/fixtures/gpu-truth/<machine>/probe.json`` holds every answer a real driver (580.159.04)
gave on two machines, each one GPU passed through to a VM (see that folder's README). This test
makes every recorded query again, through the unmodified pynvml, against the lab's simulated
library loaded with the profile that mirrors the machine, and compares the answers: each query must
agree in value, or in error class (the ``NVMLError_*`` subclass, or the Python exception class), or
be one of the identity and live values listed in :data:`LIVE` with the reason it cannot agree.

Run ``python tests/lab/test_nvml_truth.py`` to print the agreement table per machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fleetlab.nvml import build_shim
from fleetlab.profiles import list_profiles, load_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-truth"

#: recorded machine -> the lab profile that mirrors it
MACHINES = {
    "h100-80gb-hbm3": "h100-sxm-1-passthrough",
    "h200-141gb": "h200-sxm-1-passthrough",
}

#: Queries whose value cannot agree with a recording, and why. A query listed here still has to
#: answer in the same way (a value where the driver gave a value, the same error class where it
#: gave an error); only the value itself is not compared.
LIVE: dict[str, str] = {
    "device.nvmlDeviceGetUUID": "identity: a UUID is unique to each physical GPU",
    "device.nvmlDeviceGetSerial": "identity: the board serial number is unique to each board",
    "device.nvmlDeviceGetPdi": "identity: the per-device identifier (nvidia-smi 'GPU PDI') is unique per GPU",
    "device.nvmlDeviceGetIrqNum": "identity: the interrupt line the guest kernel assigned at boot",
    "device.nvmlDeviceGetPowerUsage": "live: instantaneous power draw (71 W and 79 W recorded, moves every read)",
    "device.nvmlDeviceGetTotalEnergyConsumption": "live: energy counter in mJ since the driver loaded",
    "device.temp_gpu": "live: GPU temperature (34 C / 32 C recorded)",
    "device.nvmlDeviceGetMarginTemperature": "live: distance to the slowdown temperature, moves with it",
    "cuda.procs_compute": "identity and live: the pid is the recorder's own; usedGpuMemory of a process "
    "is the driver's per-process accounting (8 GiB + 506 MiB), 8.8 MiB less than the used-memory delta "
    "the shim is given for the same process",
}

#: One no-argument system query and its recorded answer, one device query...: the probe below makes
#: exactly the queries named in the recording, so both sides are made by the same code path.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    import pynvml as N

    recorded = json.load(open(sys.argv[1]))
    state_dir = sys.argv[2]

    def enc(v, depth=0):
        if isinstance(v, bytes):
            return v.decode(errors="replace")
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        if isinstance(v, (list, tuple)):
            return [enc(x, depth + 1) for x in v][:64]
        if hasattr(v, "_fields_"):
            return {f[0]: enc(getattr(v, f[0]), depth + 1) for f in v._fields_}
        if depth < 3 and hasattr(v, "__dict__"):
            return {k: enc(x, depth + 1) for k, x in vars(v).items() if not k.startswith("_")}
        return repr(v)[:200]

    def call(fn, *a):
        try:
            return {"ok": enc(fn(*a))}
        except N.NVMLError as e:
            return {"err": type(e).__name__, "code": getattr(e, "value", None), "msg": str(e)}
        except Exception as e:
            return {"exc": type(e).__name__, "msg": str(e)[:200]}

    def missing(name):
        return {"exc": "AttributeError", "msg": f"this pynvml has no {name}"}

    out = {"init": call(N.nvmlInit)}
    out["system"] = {
        name: call(getattr(N, name)) if hasattr(N, name) else missing(name) for name in recorded["system"]
    }
    out["count"] = call(N.nvmlDeviceGetCount)
    devices = []
    for i, rec in enumerate(recorded["devices"]):
        h = N.nvmlDeviceGetHandleByIndex(i)
        d = {}
        for name in rec:
            if name.startswith("nvmlDeviceGet"):
                d[name] = call(getattr(N, name), h) if hasattr(N, name) else missing(name)
        d["MemoryInfo_v1"] = call(N.nvmlDeviceGetMemoryInfo, h)
        d["MemoryInfo_v2"] = call(N.nvmlDeviceGetMemoryInfo, h, N.nvmlMemory_v2)
        remote_pci = getattr(N, "nvmlDeviceGetNvLinkRemotePciInfo_v2", N.nvmlDeviceGetNvLinkRemotePciInfo)
        d["nvlinks"] = {
            str(link): {
                "state": call(N.nvmlDeviceGetNvLinkState, h, link),
                "version": call(N.nvmlDeviceGetNvLinkVersion, h, link),
                "remote_pci": call(remote_pci, h, link),
                "remote_type": call(N.nvmlDeviceGetNvLinkRemoteDeviceType, h, link),
                "cap_p2p": call(N.nvmlDeviceGetNvLinkCapability, h, link, N.NVML_NVLINK_CAP_P2P_SUPPORTED),
            }
            for link in map(int, rec["nvlinks"])
        }
        d["topo_self"] = call(N.nvmlDeviceGetTopologyCommonAncestor, h, h)
        d["p2p_self_nvlink"] = call(N.nvmlDeviceGetP2PStatus, h, h, N.NVML_P2P_CAPS_INDEX_NVLINK)
        d["p2p_self_read"] = call(N.nvmlDeviceGetP2PStatus, h, h, N.NVML_P2P_CAPS_INDEX_READ)
        for typ in ("NVML_CLOCK_GRAPHICS", "NVML_CLOCK_SM", "NVML_CLOCK_MEM"):
            d[f"clock_{typ}"] = call(N.nvmlDeviceGetClockInfo, h, getattr(N, typ))
            d[f"maxclock_{typ}"] = call(N.nvmlDeviceGetMaxClockInfo, h, getattr(N, typ))
        unc, cor = N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_MEMORY_ERROR_TYPE_CORRECTED
        d["ecc_vol_total"] = call(N.nvmlDeviceGetTotalEccErrors, h, unc, N.NVML_VOLATILE_ECC)
        d["ecc_agg_total"] = call(N.nvmlDeviceGetTotalEccErrors, h, unc, N.NVML_AGGREGATE_ECC)
        d["ecc_agg_corr"] = call(N.nvmlDeviceGetTotalEccErrors, h, cor, N.NVML_AGGREGATE_ECC)
        d["retired_sbe"] = call(
            N.nvmlDeviceGetRetiredPages, h, N.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        )
        d["retired_dbe"] = call(N.nvmlDeviceGetRetiredPages, h, N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        d["temp_gpu"] = call(N.nvmlDeviceGetTemperature, h, N.NVML_TEMPERATURE_GPU)
        d["cpu_affinity"] = call(N.nvmlDeviceGetCpuAffinity, h, 4)
        d["mem_affinity"] = call(N.nvmlDeviceGetMemoryAffinity, h, 4, 0)
        d["field_values"] = call(N.nvmlDeviceGetFieldValues, h, [N.NVML_FI_DEV_NVLINK_LINK_COUNT])
        # what the recorder's arrays were, expanded (the recording has them as {})
        d["expanded"] = {
            "cpu_affinity": call(lambda: list(N.nvmlDeviceGetCpuAffinity(h, 4))),
            "mem_affinity": call(lambda: list(N.nvmlDeviceGetMemoryAffinity(h, 4, 0))),
        }
        devices.append(d)
    out["devices"] = devices

    # The recorder's CUDA phase, replayed through the lab's live state: this process holds a CUDA
    # context's worth of memory, then that plus an 8 GiB tensor, as the vLLM stand-in would write.
    cuda = recorded.get("cuda", {})
    if "nvml_v2_after_ctx" in cuda:
        h = N.nvmlDeviceGetHandleByIndex(0)
        mem = os.path.join(state_dir, f"{os.getpid()}.mem")
        ctx = cuda["nvml_v2_after_ctx"]["ok"]["used"]
        with open(mem, "w") as f:
            f.write(f"0 {ctx}\\n")
        c = {"nvml_v1_after_ctx": call(N.nvmlDeviceGetMemoryInfo, h),
             "nvml_v2_after_ctx": call(N.nvmlDeviceGetMemoryInfo, h, N.nvmlMemory_v2)}
        after = cuda["nvml_v1_after_alloc"]["ok"]["used"] - cuda["nvml_v1_after_ctx"]["ok"]["used"]
        with open(mem, "w") as f:
            f.write(f"0 {ctx + after}\\n")
        c["nvml_v1_after_alloc"] = call(N.nvmlDeviceGetMemoryInfo, h)
        c["procs_compute"] = call(N.nvmlDeviceGetComputeRunningProcesses, h)
        c["procs_graphics"] = call(N.nvmlDeviceGetGraphicsRunningProcesses, h)
        os.unlink(mem)
        out["cuda"] = c
    print(json.dumps(out))
    """
)


def queries(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flatten a probe record into ``{query name: answer}`` (only the NVML queries)."""
    flat: dict[str, dict[str, Any]] = {"init": record["init"], "count": record["count"]}
    flat.update({f"system.{k}": v for k, v in record["system"].items()})
    for index, device in enumerate(record["devices"]):
        prefix = "device" if index == 0 else f"device{index}"
        for key, value in device.items():
            if key == "nvlinks":
                for link, calls in value.items():
                    flat.update({f"{prefix}.nvlink.{link}.{kind}": v for kind, v in calls.items()})
            elif key != "expanded" and isinstance(value, dict):
                flat[f"{prefix}.{key}"] = value
    for key in ("nvml_v1_after_ctx", "nvml_v2_after_ctx", "nvml_v1_after_alloc", "procs_compute", "procs_graphics"):
        if key in record.get("cuda", {}):
            flat[f"cuda.{key}"] = record["cuda"][key]
    return flat


def kind(answer: dict[str, Any]) -> tuple[str, str]:
    """The class of an answer: ("ok", ""), ("err", "NVMLError_NotSupported"), ("exc", "TypeError")."""
    if "ok" in answer:
        return ("ok", "")
    if "err" in answer:
        return ("err", str(answer["err"]))
    return ("exc", str(answer.get("exc")))


def verdict(name: str, real: dict[str, Any], lab: dict[str, Any] | None) -> str:
    """``agree``, ``live`` (a value listed in LIVE that differs, same answer class) or ``differ``."""
    if lab is None or kind(real) != kind(lab):
        return "differ"
    if "ok" not in real or real["ok"] == lab["ok"]:
        return "agree"
    return "live" if name in LIVE else "differ"


def compare(real: dict[str, Any], lab: dict[str, Any]) -> dict[str, tuple[str, Any, Any]]:
    """Every recorded query with its verdict and both answers."""
    ours = queries(lab)
    return {
        name: (verdict(name, answer, ours.get(name)), answer, ours.get(name)) for name, answer in queries(real).items()
    }


def run_probe(shim_dir: Path, profile_name: str, machine: str, work: Path) -> dict[str, Any]:
    """Replay the recording of ``machine`` against the shim loaded with ``profile_name``."""
    profile_file = work / f"{Path(profile_name).stem}.profile"
    profile_file.write_text(load_profile(profile_name).render())
    state = work / "state"
    state.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(shim_dir),
        "FLEET_NVML_PROFILE": str(profile_file),
        "FLEET_NVML_STATE_DIR": str(state),
    }
    recording = FIXTURES / machine / "probe.json"
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(recording), str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def recorded(machine: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / machine / "probe.json").read_text())
    return data


# ---- tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim")).parent


@pytest.fixture(scope="module")
def replays(shim_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {
        machine: run_probe(shim_dir, profile, machine, tmp_path_factory.mktemp(machine))
        for machine, profile in MACHINES.items()
    }


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_every_recorded_query_agrees(machine: str, replays: dict[str, dict[str, Any]]) -> None:
    result = compare(recorded(machine), replays[machine])
    differ = {name: (real, lab) for name, (v, real, lab) in result.items() if v == "differ"}
    assert not differ, f"{machine}: {len(differ)} queries differ from the real driver:\n" + "\n".join(
        f"  {name}: real {real} / lab {lab}" for name, (real, lab) in sorted(differ.items())
    )
    counts = Counter(v for v, _, _ in result.values())
    assert counts["agree"] > 250  # the recording really was replayed, not an empty diff
    assert counts["live"] <= len(LIVE)


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_nothing_the_real_driver_has_is_missing(machine: str, replays: dict[str, dict[str, Any]]) -> None:
    """The shim's rule for what it does not model is the driver's NotSupported, never a missing symbol."""
    real = queries(recorded(machine))
    for name, answer in queries(replays[machine]).items():
        if answer.get("err") == "NVMLError_FunctionNotFound":
            assert real.get(name, {}).get("err") == "NVMLError_FunctionNotFound", name
        assert answer.get("exc") != "NVMLLibraryMismatchError", name


def test_every_live_exception_is_a_recorded_query() -> None:
    for machine in MACHINES:
        names = set(queries(recorded(machine)))
        assert set(LIVE) <= names, set(LIVE) - names


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_memory_adds_up_like_the_real_driver(machine: str, replays: dict[str, dict[str, Any]]) -> None:
    """v2: reserved + used + free = total, v1 used = reserved + v2 used; CUDA's total = total - reserved."""
    profile = load_profile(MACHINES[machine])
    device = replays[machine]["devices"][0]
    v1, v2 = device["MemoryInfo_v1"]["ok"], device["MemoryInfo_v2"]["ok"]
    assert v2["reserved"] + v2["used"] + v2["free"] == v2["total"] == v1["total"]
    assert v1["used"] == v2["reserved"] + v2["used"] and v1["free"] == v2["free"]
    assert v2["reserved"] == profile.sku.memory_reserved
    assert profile.sku.cuda_total == recorded(machine)["cuda"]["mem_get_info_total"]
    # with a CUDA context's worth held (552,402,944 B recorded), reserved is unchanged and v1 adds it
    ctx1, ctx2 = (replays[machine]["cuda"][k]["ok"] for k in ("nvml_v1_after_ctx", "nvml_v2_after_ctx"))
    assert ctx2["reserved"] == v2["reserved"] and ctx1["used"] == ctx2["reserved"] + ctx2["used"]
    assert ctx2["free"] == v2["free"] - ctx2["used"]


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_arrays_the_recorder_did_not_expand(machine: str, replays: dict[str, dict[str, Any]]) -> None:
    """CPU affinity of the 16-vCPU VMs (``nvidia-smi topo -m``: 0-15, NUMA 0): one word, 0xffff."""
    expanded = replays[machine]["devices"][0]["expanded"]
    assert expanded["cpu_affinity"] == {"ok": [0xFFFF, 0, 0, 0]}
    assert expanded["mem_affinity"] == {"ok": [1, 0, 0, 0]}
    assert "CPU Affinity" in (FIXTURES / machine / "topo-nvlink-driver.txt").read_text()


@pytest.mark.parametrize("profile", list_profiles())
def test_every_profile_answers_every_recorded_query(
    profile: str, shim_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Multi-GPU and faulty profiles get the same fidelity: a value or the driver's error, never a
    missing symbol; against the H100 recording they differ only where the machine differs."""
    real = queries(recorded("h100-80gb-hbm3"))
    lab = run_probe(shim_dir, profile, "h100-80gb-hbm3", tmp_path_factory.mktemp(profile))
    for name, answer in queries(lab).items():
        assert answer.get("err") != "NVMLError_FunctionNotFound" or real[name].get("err") == answer["err"], name
        assert "exc" not in answer or answer["exc"] == real[name].get("exc"), (name, answer)
    if profile == "h100-sxm-8":
        result = compare(recorded("h100-80gb-hbm3"), lab)
        differ = {name for name, (v, _, _) in result.items() if v == "differ"}
        # what an 8-GPU HGX board on bare metal answers unlike one GPU passed through to a VM
        machine = {
            "count",
            "device.nvmlDeviceGetPciInfo",
            "device.nvmlDeviceGetPciInfo_v3",
            "device.nvmlDeviceGetBoardId",
            "device.nvmlDeviceGetVirtualizationMode",
            "system.nvmlSystemGetDriverVersion",
            "system.nvmlSystemGetNVMLVersion",
            "system.nvmlSystemGetDriverBranch",
        }
        nvlink = {name for name in differ if name.startswith("device.nvlink.")}
        assert differ == machine | nvlink
        # links 0-17 (5 queries each) answer values where the VM answered NotSupported; past the
        # last link (18, 19) both answer alike
        assert len(nvlink) == 18 * 5


def test_the_diff_sees_a_difference() -> None:
    ok, other = {"ok": 1}, {"ok": 2}
    not_supported = {"err": "NVMLError_NotSupported", "code": 3}
    invalid = {"err": "NVMLError_InvalidArgument", "code": 2}
    assert verdict("device.nvmlDeviceGetBrand", ok, ok) == "agree"
    assert verdict("device.nvmlDeviceGetBrand", ok, other) == "differ"
    assert verdict("device.nvmlDeviceGetBrand", ok, not_supported) == "differ"
    assert verdict("device.nvmlDeviceGetBrand", ok, None) == "differ"
    assert verdict("device.nvlink.18.cap_p2p", invalid, not_supported) == "differ"
    assert verdict("device.nvlink.18.cap_p2p", invalid, invalid) == "agree"
    assert verdict("device.nvmlDeviceGetUUID", {"ok": "GPU-a"}, {"ok": "GPU-b"}) == "live"
    assert verdict("device.nvmlDeviceGetUUID", {"ok": "GPU-a"}, not_supported) == "differ"
    assert verdict("x", {"exc": "TypeError"}, {"exc": "TypeError"}) == "agree"


def table(shim_dir: Path, work: Path, profiles: dict[str, str] = MACHINES) -> str:
    """The agreement table (total / agree / live / differ) per machine, and what differs."""
    lines = []
    for machine, profile in profiles.items():
        (work / machine).mkdir(parents=True, exist_ok=True)
        result = compare(recorded(machine), run_probe(shim_dir, profile, machine, work / machine))
        counts = Counter(v for v, _, _ in result.values())
        lines.append(
            f"{machine} vs {profile}: {len(result)} queries, {counts['agree']} agree, "
            f"{counts['live']} live/identity, {counts['differ']} differ"
        )
        lines.extend(
            f"    {name}: real {json.dumps(real)[:120]} / lab {json.dumps(lab)[:120]}"
            for name, (v, real, lab) in sorted(result.items())
            if v == "differ"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a report for people
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        chosen = dict(arg.split("=", 1) for arg in sys.argv[1:]) or MACHINES
        print(table(build_shim(Path(tmp) / "shim").parent, Path(tmp), chosen))
