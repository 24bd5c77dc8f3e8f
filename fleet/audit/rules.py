"""Audit rules: pure functions of one host's probed facts, what the inventory expects, and the GPU
catalogue (``fleet.gpus``). Each rule returns findings; ``audit_host`` runs them all.

Facts behind the rules (NVML semantics from ``nvml.h``):

* clock-event (throttle) reason bits, ``nvmlClocksEventReasons``: GpuIdle 0x1, SwPowerCap 0x4,
  HwSlowdown 0x8, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40, HwPowerBrakeSlowdown 0x80;
* a GPU passed through to a VM (``nvmlDeviceGetVirtualizationMode`` = PASSTHROUGH) answers every
  NVLink query NotSupported: it is reported as such, never as links down;
* idle GPUs lower their PCIe link generation to save power, so the current generation is compared
  with the maximum only when the GPU is not idle (clock-event reason GpuIdle clear); at idle the
  rule compares what the slot allows (``nvmlDeviceGetMaxPcieLinkGeneration``) with what the GPU
  supports (``nvmlDeviceGetGpuMaxPcieLinkGeneration``). Link width does not change at idle;
* Hopper NVSwitch systems report the fabric manager's progress through
  ``nvmlDeviceGetGpuFabricInfoV``: anything but COMPLETED with status 0 leaves NVLink unusable
  (CUDA error 802 "system not yet initialized");
* vLLM 0.20 and later ship CUDA 13 builds (``envs.VLLM_MAIN_CUDA_VERSION`` = "13.0"), which need a
  CUDA 13 driver (580+, NVIDIA's CUDA compatibility table); 0.14-0.18: CUDA 12.9; 0.11: 12.8.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from fleet.audit.findings import Finding, Severity
from fleet.facts.hostfacts import (
    FABRIC_COMPLETED,
    FABRIC_NOT_SUPPORTED,
    REMOTE_SWITCH,
    GpuFacts,
    HostFacts,
)
from fleet.gpus import CATALOGUE, Fabric, GpuSku, sku_for
from fleet.inventory.drivers import cuda_label, driver_for_cuda
from fleet.inventory.drivers import vllm_cuda_requirement as vllm_cuda_requirement

# clock-event reason bits (nvml.h nvmlClocksEventReason*)
GPU_IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80

#: vLLM release (major, minor) from which on -> the CUDA driver version its wheels need.
#: Units fleet runs vLLM in (``fleet/render/units.py``): processes in them are ours.
OUR_UNIT = re.compile(r"^fleet-vllm-\d+\.service$")
ECC_CORRECTED_VOLATILE_LIMIT = 1000
RETIRED_PAGES_LIMIT = 60  #: NVIDIA's RMA threshold for dynamic page retirement
BASEBOARD_COUNTS = (4, 8)  #: GPUs on an HGX/DGX baseboard


@dataclass(frozen=True)
class Expectation:
    """What the inventory says a host should have."""

    gpu_count: int | None = None
    sku: str | None = None  #: catalogue key
    vllm_version: str | None = None


def _f(
    rule: str, sev: Severity, host: str, msg: str, gpu: int | None = None, link: int | None = None, way: str = ""
) -> Finding:
    return Finding(rule, sev, host, msg, gpu, link, way)


def host_sku(facts: HostFacts) -> GpuSku | None:
    names = {g.name for g in facts.gpus if g.name}
    if len(names) != 1:
        return None
    try:
        return sku_for(names.pop())
    except KeyError:
        return None


# ---- the host's state: probe, driver -------------------------------------------------------------

STATUS_FINDINGS: dict[str, tuple[str, Severity, str, str]] = {
    "no-python": (
        "probe-no-python",
        Severity.ERROR,
        "no Python on the host to run the probe",
        "install python3 (3.6 or newer; the probe carries the rest), or name one with --python",
    ),
    "python-too-old": (
        "probe-python-too-old",
        Severity.ERROR,
        "the host's Python is older than the probe needs (3.6)",
        "install python3 3.6 or newer (Debian/Ubuntu's python3 package), or name one with --python",
    ),
    "no-pynvml": (
        "probe-no-pynvml",
        Severity.ERROR,
        "the probe ran without pynvml (fleet sends its own with the probe; this answer came from a probe run "
        "without it)",
        "probe through fleet (fleet audit), or install nvidia-ml-py for the Python that ran the probe",
    ),
    "no-nvml-library": (
        "nvml-library-missing",
        Severity.CRITICAL,
        "no NVML library (libnvidia-ml.so.1): the NVIDIA driver's user-space part is not installed",
        "install the NVIDIA driver",
    ),
    "driver-not-loaded": (
        "driver-not-loaded",
        Severity.CRITICAL,
        "NVML: the NVIDIA kernel module is not loaded",
        "load it (modprobe nvidia) or rebuild it for the running kernel, then reboot",
    ),
    "lib-rm-version-mismatch": (
        "driver-mismatch",
        Severity.CRITICAL,
        "NVML refuses to initialise: library and kernel module versions differ (LIB_RM_VERSION_MISMATCH)",
        "reboot into the upgraded driver, and hold NVIDIA packages against unattended upgrades",
    ),
    "no-gpus": (
        "no-gpus",
        Severity.CRITICAL,
        "the driver is loaded but enumerates no GPU",
        "check lspci and dmesg (Xid)",
    ),
    "no-permission": (
        "nvml-no-permission",
        Severity.ERROR,
        "no permission to open /dev/nvidia*",
        "probe as a user with GPU access",
    ),
    "nvml-error": ("nvml-init-failed", Severity.CRITICAL, "nvmlInit failed", "check dmesg and nvidia-smi"),
    "probe-crashed": ("probe-crashed", Severity.ERROR, "the probe script failed", "report this with the message"),
}


def rule_status(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    if facts.ok:
        return []
    rule, sev, msg, way = STATUS_FINDINGS[facts.status]
    if facts.error_message:
        msg = f"{msg} ({facts.error_class}: {facts.error_message})"
    if facts.status == "lib-rm-version-mismatch" and facts.kernel_module_version:
        msg += f"; kernel module {facts.kernel_module_version}"
    return [_f(rule, sev, host, msg, way=way)]


def rule_driver_mismatch(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    if not facts.ok or not facts.driver_version:
        return []
    if facts.kernel_module_version is None:
        return [
            _f(
                "driver-mismatch",
                Severity.ERROR,
                host,
                f"NVML answers driver {facts.driver_version} but /proc/driver/nvidia/version is missing",
                way="check which kernel module is loaded (lsmod | grep nvidia)",
            )
        ]
    if facts.kernel_module_version != facts.driver_version:
        return [
            _f(
                "driver-mismatch",
                Severity.CRITICAL,
                host,
                f"NVML library is driver {facts.driver_version} but the loaded kernel module is "
                f"{facts.kernel_module_version}",
                way="reboot into the installed driver (a driver upgrade without reboot); hold NVIDIA packages",
            )
        ]
    return []


def rule_function_not_found(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    missing = sorted({k.split(".", 1)[-1] for k, v in facts.all_errors().items() if v == "FunctionNotFound"})
    if not missing:
        return []
    return [
        _f(
            "nvml-function-missing",
            Severity.WARNING,
            host,
            f"the driver's NVML lacks {len(missing)} queries (older driver?): {', '.join(missing)}; "
            "checks that need them were skipped",
            way="upgrade the driver to the fleet's pinned branch",
        )
    ]


def rule_cuda_driver(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    if not facts.ok or facts.cuda_driver_version is None or not expect.vllm_version:
        return []
    need = vllm_cuda_requirement(expect.vllm_version)
    if need is None or facts.cuda_driver_version >= need:
        return []
    want = _cuda(need)
    if want in facts.cuda_compat and _compat_applies(facts):
        return [
            _f(
                "cuda-compat-in-use",
                Severity.INFO,
                host,
                f"CUDA driver {_cuda(facts.cuda_driver_version)} is older than vLLM {expect.vllm_version} needs "
                f"({want}); /usr/local/cuda-{want}/compat (cuda-compat) bridges it for fleet's vLLM units",
                way=f"nothing to do; a driver of branch {driver_for_cuda(need)} or newer would make it unneeded",
            )
        ]
    branch = driver_for_cuda(need)
    upgrade = f"upgrade the driver to branch {branch} or newer (CUDA {want})" if branch else f"a CUDA {want} driver"
    return [
        _f(
            "cuda-driver-too-old",
            Severity.CRITICAL,
            host,
            f"CUDA driver {_cuda(facts.cuda_driver_version)} is older than vLLM {expect.vllm_version} needs ({want})",
            way=(
                f"{upgrade}, {_compat_way(facts, want)}, or pin an older vLLM"
                if _compat_applies(facts)
                else f"{upgrade} or pin an older vLLM {_compat_way(facts, want)}"
            ),
        )
    ]


def _skus(facts: HostFacts) -> list[GpuSku] | str:
    """The catalogue models of the host's GPUs, or the name of one the catalogue lacks."""
    skus = []
    for name in sorted({g.name or "?" for g in facts.gpus}):
        try:
            skus.append(sku_for(name))
        except KeyError:
            return name
    return skus


def _compat_applies(facts: HostFacts) -> bool:
    """CUDA forward compatibility works on the host: every GPU a data-centre board (``fleet.gpus``)."""
    skus = _skus(facts)
    return isinstance(skus, list) and bool(skus) and all(s.forward_compatible for s in skus)


def _compat_way(facts: HostFacts, want: str) -> str:
    """cuda-compat as a way out where it applies: every GPU a data-centre board (``fleet.plan.cuda``)."""
    skus = _skus(facts)
    if isinstance(skus, str):
        return f"(cuda-compat: {skus} is not in fleet's catalogue, so whether it applies is not known)"
    if _compat_applies(facts):
        pkg = "cuda-compat-" + want.replace(".", "-")
        return (
            f"or keep the driver and install {pkg} (forward compatibility, data-centre GPUs: fleet deploy does it "
            "with nvidia_driver_version: keep and cuda_compat: auto)"
        )
    other = ", ".join(s.nvml_name for s in skus if not s.forward_compatible) or "no GPU"
    return f"(cuda-compat does not apply: {other} is not a data-centre GPU)"


_cuda = cuda_label


# ---- GPU count and model -------------------------------------------------------------------------


def rule_gpu_count(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    if not facts.ok:
        return []
    n = len(facts.gpus)
    out = []
    if expect.gpu_count is not None and n < expect.gpu_count:
        out.append(
            _f(
                "gpu-missing",
                Severity.CRITICAL,
                host,
                f"{n} GPUs enumerated, the inventory says {expect.gpu_count}",
                way="check lspci and dmesg for Xid 79 (fallen off the bus); reseat or RMA",
            )
        )
    if facts.pci_gpus is not None and facts.pci_gpus > n:
        out.append(
            _f(
                "gpu-missing",
                Severity.CRITICAL,
                host,
                f"{facts.pci_gpus} NVIDIA GPUs on the PCI bus but NVML enumerates {n}",
                way="dmesg | grep -i xid; a GPU NVML cannot initialise needs a reset or RMA",
            )
        )
    sku = host_sku(facts)
    if (
        not out
        and sku is not None
        and sku.typical_fabric is Fabric.SWITCH
        and not facts.passthrough
        and n not in BASEBOARD_COUNTS
    ):
        out.append(
            _f(
                "gpu-missing",
                Severity.ERROR,
                host,
                f"{n} {sku.nvml_name} GPUs: an NVSwitch baseboard carries {' or '.join(map(str, BASEBOARD_COUNTS))}",
                way="check lspci and dmesg for a GPU that fell off the bus",
            )
        )
    return out


def rule_gpu_model(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        if g.name is None:
            continue
        try:
            sku = sku_for(g.name)
        except KeyError:
            out.append(
                _f(
                    "gpu-unknown",
                    Severity.INFO,
                    host,
                    f"{g.name} is not in fleet's GPU catalogue; model checks skipped",
                    g.index,
                )
            )
            continue
        if expect.sku is not None and expect.sku in CATALOGUE and CATALOGUE[expect.sku] is not sku:
            out.append(
                _f(
                    "gpu-model-mismatch",
                    Severity.ERROR,
                    host,
                    f"{g.name}, the inventory says {CATALOGUE[expect.sku].nvml_name}",
                    g.index,
                    way="fix the inventory's gpu.sku or the host",
                )
            )
        if g.board_part_number and sku.board_part_numbers and g.board_part_number not in sku.board_part_numbers:
            out.append(
                _f(
                    "gpu-board-unexpected",
                    Severity.WARNING,
                    host,
                    f"board part number {g.board_part_number} is not one known for {sku.nvml_name} "
                    f"({', '.join(sku.board_part_numbers)})",
                    g.index,
                )
            )
        if g.memory and abs(g.memory.total - sku.memory_total) > sku.memory_total // 100:
            out.append(
                _f(
                    "gpu-memory-unexpected",
                    Severity.WARNING,
                    host,
                    f"{g.memory.total / 2**30:.1f} GiB total, {sku.nvml_name} has {sku.memory_gib:.1f} GiB",
                    g.index,
                )
            )
    return out


# ---- NVLink and fabric ---------------------------------------------------------------------------


def rule_nvlink(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out: list[Finding] = []
    for g in facts.gpus:
        sku = _sku(g)
        if sku is None or sku.nvlink_links == 0:
            continue  # PCIe-only cards: nothing to expect, nothing to report
        if not g.nvlinks:
            err = g.nvlink_error or "no answer"
            if g.virtualization_mode == 1:
                sev = Severity.INFO if len(facts.gpus) == 1 else Severity.WARNING
                out.append(
                    _f(
                        "nvlink-not-visible-vm",
                        sev,
                        host,
                        f"GPU passed through to a VM: NVML does not show its {sku.nvlink_links} NVLinks ({err}); "
                        "NVLink health cannot be checked from inside the VM",
                        g.index,
                        way="check NVLink from the hypervisor; do not plan tensor parallelism over NVLink here",
                    )
                )
            else:
                out.append(
                    _f(
                        "nvlink-not-reported",
                        Severity.ERROR,
                        host,
                        f"{sku.nvml_name} has {sku.nvlink_links} NVLinks but NVML reports none ({err})",
                        g.index,
                        way="check nvidia-smi nvlink -s and the fabric manager",
                    )
                )
            continue
        for link in g.nvlinks:
            if not link.active:
                out.append(
                    _f(
                        "nvlink-down",
                        Severity.ERROR,
                        host,
                        f"NVLink {link.link} is inactive",
                        g.index,
                        link.link,
                        way="nvidia-smi nvlink -s / -e; reset the GPU, reseat, or RMA the baseboard",
                    )
                )
            elif link.version is not None and link.version != sku.nvlink_version:
                out.append(
                    _f(
                        "nvlink-version",
                        Severity.WARNING,
                        host,
                        f"NVLink {link.link} runs version enum {link.version}, "
                        f"{sku.nvml_name} has {sku.nvlink_version}",
                        g.index,
                        link.link,
                    )
                )
        if len(g.nvlinks) < sku.nvlink_links:
            out.append(
                _f(
                    "nvlink-missing",
                    Severity.ERROR,
                    host,
                    f"{len(g.nvlinks)} NVLinks reported, {sku.nvml_name} has {sku.nvlink_links}",
                    g.index,
                    way="nvidia-smi nvlink -s; reset the GPU or RMA",
                )
            )
    return out


def rule_fabric(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    names = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
    for g in facts.gpus:
        sku = _sku(g)
        on_switch = any(link.remote_type == REMOTE_SWITCH for link in g.nvlinks)
        if sku is None or not sku.fabric_info or not on_switch or g.fabric is None:
            continue
        if g.fabric.state == FABRIC_NOT_SUPPORTED:
            continue
        if g.fabric.state != FABRIC_COMPLETED:
            out.append(
                _f(
                    "fabric-not-ready",
                    Severity.ERROR,
                    host,
                    f"NVSwitch fabric registration {names.get(g.fabric.state, g.fabric.state)}: NVLink is unusable "
                    "(CUDA error 802) until the fabric manager finishes",
                    g.index,
                    way="systemctl status nvidia-fabricmanager; its version must equal the driver's",
                )
            )
        elif g.fabric.status != 0:
            out.append(
                _f(
                    "fabric-not-ready",
                    Severity.ERROR,
                    host,
                    f"NVSwitch fabric registration completed with error status {g.fabric.status}",
                    g.index,
                    way="journalctl -u nvidia-fabricmanager",
                )
            )
    return out


# ---- PCIe ----------------------------------------------------------------------------------------


def rule_pcie(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        p = g.pcie
        if p.width is not None and p.max_width is not None and p.width < p.max_width:
            out.append(
                _f(
                    "pcie-width-degraded",
                    Severity.ERROR,
                    host,
                    f"PCIe link trained at x{p.width}, the GPU supports x{p.max_width}",
                    g.index,
                    way="reseat the GPU or riser; check the slot",
                )
            )
        idle = g.clock_event_reasons is not None and g.clock_event_reasons & GPU_IDLE
        if p.gen is not None and p.max_gen is not None and p.gen < p.max_gen and not idle:
            how = "at load" if g.clock_event_reasons is not None else "idle state unknown (no clock-event reasons)"
            out.append(
                _f(
                    "pcie-gen-degraded",
                    Severity.ERROR,
                    host,
                    f"PCIe link at Gen{p.gen}, the slot and GPU allow Gen{p.max_gen} (compared {how})",
                    g.index,
                    way="reseat the GPU or riser; check BIOS PCIe settings",
                )
            )
        if p.max_gen is not None and p.gpu_max_gen is not None and p.max_gen < p.gpu_max_gen:
            out.append(
                _f(
                    "pcie-slot-capped",
                    Severity.WARNING,
                    host,
                    f"the slot allows Gen{p.max_gen}, the GPU supports Gen{p.gpu_max_gen} (compared max vs capability)",
                    g.index,
                    way="check the BIOS PCIe generation setting and the riser",
                )
            )
    return out


# ---- memory health -------------------------------------------------------------------------------


def rule_ecc(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        sku = _sku(g)
        if g.ecc_mode is not None and g.ecc_mode[0] == 0 and sku is not None and sku.ecc:
            out.append(
                _f(
                    "ecc-disabled",
                    Severity.WARNING,
                    host,
                    "ECC is off on a board that supports it",
                    g.index,
                    way="nvidia-smi -e 1 and reboot",
                )
            )
        e = g.ecc_errors
        if e is None:
            continue
        if e.uncorrected_volatile:
            out.append(
                _f(
                    "ecc-uncorrected",
                    Severity.ERROR,
                    host,
                    f"{e.uncorrected_volatile} uncorrected ECC errors since the last driver load",
                    g.index,
                    way="drain the GPU; reset it; RMA if they recur",
                )
            )
        elif e.uncorrected_aggregate:
            out.append(
                _f(
                    "ecc-uncorrected-history",
                    Severity.WARNING,
                    host,
                    f"{e.uncorrected_aggregate} uncorrected ECC errors over the GPU's life",
                    g.index,
                )
            )
        if e.corrected_volatile and e.corrected_volatile >= ECC_CORRECTED_VOLATILE_LIMIT:
            out.append(
                _f(
                    "ecc-corrected-high",
                    Severity.WARNING,
                    host,
                    f"{e.corrected_volatile} corrected ECC errors since the last driver load",
                    g.index,
                )
            )
    return out


def rule_memory_repair(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        r = g.remapped_rows
        if r is not None:
            if r.failure:
                out.append(
                    _f(
                        "row-remap-failed",
                        Severity.CRITICAL,
                        host,
                        "row remapping failed: no spare rows left",
                        g.index,
                        way="RMA the GPU",
                    )
                )
            if r.pending:
                out.append(
                    _f(
                        "row-remap-pending",
                        Severity.ERROR,
                        host,
                        f"a row remap is pending ({r.uncorrectable} rows remapped for uncorrectable errors)",
                        g.index,
                        way="drain and reset the GPU (nvidia-smi -r) to apply the remap",
                    )
                )
        p = g.retired_pages
        if p is not None:
            total = (p.sbe or 0) + (p.dbe or 0)
            if total >= RETIRED_PAGES_LIMIT:
                out.append(
                    _f(
                        "retired-pages",
                        Severity.ERROR,
                        host,
                        f"{total} retired pages (limit {RETIRED_PAGES_LIMIT})",
                        g.index,
                        way="RMA the GPU",
                    )
                )
            if p.pending:
                out.append(
                    _f(
                        "retired-pages-pending",
                        Severity.ERROR,
                        host,
                        "page retirement pending",
                        g.index,
                        way="drain and reset the GPU",
                    )
                )
    return out


# ---- configuration and state ---------------------------------------------------------------------


def rule_persistence(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    return [
        _f(
            "persistence-off",
            Severity.WARNING,
            host,
            "persistence mode is off: the driver tears the GPU down between clients (slow starts, lost state)",
            g.index,
            way="enable nvidia-persistenced",
        )
        for g in facts.gpus
        if g.persistence == 0
    ]


def rule_mig(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        if g.mig_mode is None:
            continue
        current, pending = g.mig_mode
        if current == 1:
            out.append(
                _f(
                    "mig-enabled",
                    Severity.ERROR,
                    host,
                    "MIG is on: vLLM would see MIG slices, not the whole GPU",
                    g.index,
                    way="nvidia-smi -i N -mig 0 and reset the GPU",
                )
            )
        elif pending == 1:
            out.append(
                _f(
                    "mig-pending",
                    Severity.WARNING,
                    host,
                    "MIG will be on after the next GPU reset",
                    g.index,
                    way="nvidia-smi -i N -mig 0",
                )
            )
    return out


def rule_throttle(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        r = g.clock_event_reasons
        if not r:
            continue
        if r & (HW_THERMAL | HW_SLOWDOWN):
            out.append(
                _f(
                    "throttle-thermal",
                    Severity.ERROR,
                    host,
                    "hardware slowdown (thermal): clocks cut",
                    g.index,
                    way="check cooling, airflow and fan/BMC logs",
                )
            )
        elif r & SW_THERMAL:
            out.append(
                _f(
                    "throttle-thermal",
                    Severity.WARNING,
                    host,
                    "software thermal slowdown",
                    g.index,
                    way="check cooling",
                )
            )
        if r & HW_POWER_BRAKE:
            out.append(
                _f(
                    "throttle-power",
                    Severity.ERROR,
                    host,
                    "hardware power brake: the PSU/BMC cut power",
                    g.index,
                    way="check power supplies",
                )
            )
        elif r & SW_POWER_CAP:
            out.append(
                _f(
                    "throttle-power",
                    Severity.WARNING,
                    host,
                    "clocks held down by the power cap",
                    g.index,
                    way="check the power limit (nvidia-smi -q -d POWER)",
                )
            )
    return out


def rule_foreign_processes(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    out = []
    for g in facts.gpus:
        for p in g.processes or ():
            if p.unit is not None and OUR_UNIT.match(p.unit):
                continue
            held = f"{p.used_memory / 2**30:.1f} GiB" if p.used_memory is not None else "memory"
            out.append(
                _f(
                    "foreign-process",
                    Severity.WARNING,
                    host,
                    f"pid {p.pid} ({p.comm or '?'}, {p.unit or 'no unit'}) holds {held}, not a fleet vLLM unit",
                    g.index,
                    way="stop it, or lower gpu_memory_utilization (fleet plan counts it)",
                )
            )
    return out


def _sku(g: GpuFacts) -> GpuSku | None:
    if g.name is None:
        return None
    try:
        return sku_for(g.name)
    except KeyError:
        return None


Rule = Callable[[str, HostFacts, Expectation], list[Finding]]
HOST_RULES: tuple[Rule, ...] = (
    rule_status,
    rule_driver_mismatch,
    rule_function_not_found,
    rule_cuda_driver,
    rule_gpu_count,
    rule_gpu_model,
    rule_nvlink,
    rule_fabric,
    rule_pcie,
    rule_ecc,
    rule_memory_repair,
    rule_persistence,
    rule_mig,
    rule_throttle,
    rule_foreign_processes,
)


def audit_host(host: str, facts: HostFacts, expect: Expectation) -> list[Finding]:
    """Every host rule over one host's facts."""
    return [f for rule in HOST_RULES for f in rule(host, facts, expect)]


def unreachable(host: str, reason: str) -> Finding:
    return _f("host-unreachable", Severity.CRITICAL, host, reason, way="check SSH (address, key, known_hosts)")
