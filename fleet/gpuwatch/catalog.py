"""Which XID means what, and when a GPU is quarantined (pure; runs on hosts too).

**The catalogue.** NVIDIA's Xid catalog for Ampere and newer GPUs ("Analyzing Xid Errors with the
Xid Catalog", docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, and its spreadsheet
Xid-Catalog.xlsx) gives every XID a mnemonic and a *Resolution Bucket (Immediate Action)*:
``RESTART_APP``, ``RESET_GPU``, ``RESTART_BM`` (restart the bare-metal machine), ``RESTART_VM``,
``CONTACT_SUPPORT``, ``CHECK_MECHANICALS``, ``UPDATE_SWFW``, ``IGNORE`` and a few named workflows
(``WORKFLOW_XID_48``, ``WORKFLOW_NVLINK_ERR``, ...). :data:`XIDS` keeps the XIDs a datacenter GPU
(A100, H100, H200, B200) reports, with NVIDIA's bucket; :data:`BUCKET_ACTION` folds the buckets
into what fleet does about them:

* ``app``: the application's error, the GPU is fine (``RESTART_APP``, ``CHECK_APP/CUDA``,
  ``CHECK_UVM``, ``WORKFLOW_XID_45``: cleanup after an earlier error);
* ``info``: nothing to do (``IGNORE``, e.g. XID 63, a row remapped, XID 92, a high corrected-error rate);
* ``reset``: the GPU needs a reset (``RESET_GPU``; ``WORKFLOW_XID_48``, a double-bit ECC error,
  whose workflow resets the GPU so the row remapper can retire the row; ``WORKFLOW_NVLINK_ERR``;
  ``XID_154``, "GPU recovery action changed", which names a reset or a reboot);
* ``reboot``: the machine needs a restart (``RESTART_BM``: XID 79, the GPU has fallen off the bus;
  ``RESTART_VM``);
* ``service``: hardware or firmware service (``CONTACT_SUPPORT``, ``CHECK_MECHANICALS``, ``UPDATE_SWFW``).

``reset``, ``reboot`` and ``service`` are critical: a GPU with a critical event since its last good
check is quarantined. An XID the catalogue does not list is ``unknown``: recorded and exported,
not quarantined (NVML reports an XID it cannot name as 999: nvml.h ``nvmlEventData_t``).

ECC events (NVML ``nvmlEventTypeDoubleBitEccError`` / ``...SingleBitEccError``): a double-bit
(uncorrectable) error is critical (``reset``), as NVIDIA's XID 48 workflow treats it; a single-bit
error was corrected by the hardware (``info``).

**Quarantine.** Each event a watcher records gets a sequence number that only grows. An operator
who has repaired a GPU clears it through the newest sequence number it had then
(``fleet gpu clear``); the GPU is quarantined when it has a critical event with a larger number
(:func:`quarantine_since`). No clock is compared, so a host's clock cannot lift a quarantine.

**The kernel log.** Where NVML delivers no events, the watcher reads the driver's kernel log lines,
``NVRM: Xid (PCI:0000:1b:00): 79, pid=..., name=..., GPU has fallen off the bus.`` (open-gpu-kernel-
modules ``nvErrorLog_va``; older drivers print ``NVRM: Xid (0000:03:00): 14, ...``, NVIDIA's "XID
Errors" document): :func:`parse_kernel_xid`.

Written for Python 3.6 (the watcher carries this file to hosts, like the probe carries pynvml):
standard library only, ``typing`` annotations, no ``from __future__ import annotations``.
"""

import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

#: What fleet does about an event.
APP = "app"
INFO = "info"
RESET = "reset"
REBOOT = "reboot"
SERVICE = "service"
UNKNOWN = "unknown"
ACTIONS = (APP, INFO, RESET, REBOOT, SERVICE, UNKNOWN)
#: Actions that quarantine the GPU.
CRITICAL = (RESET, REBOOT, SERVICE)
#: Event kinds: an XID, a single-bit (corrected) or a double-bit (uncorrected) ECC error.
KINDS = ("xid", "sbe", "dbe")

#: NVIDIA's Resolution Bucket (Immediate Action) -> fleet's action.
BUCKET_ACTION = {
    "RESTART_APP": APP,
    "CHECK_APP/CUDA": APP,
    "CHECK_UVM": APP,
    "WORKFLOW_XID_45": APP,
    "IGNORE": INFO,
    "RESET_GPU": RESET,
    "WORKFLOW_XID_48": RESET,
    "WORKFLOW_NVLINK_ERR": RESET,
    "WORKFLOW_NVLINK5_ERR": RESET,
    "XID_154": RESET,
    "RESTART_BM": REBOOT,
    "RESTART_VM": REBOOT,
    "CONTACT_SUPPORT": SERVICE,
    "CHECK_MECHANICALS": SERVICE,
    "UPDATE_SWFW": SERVICE,
}

#: What the operator does, per action (the way out a finding or a refusal names).
WAY_OUT = {
    APP: "the GPU is fine: the application (vLLM) hit an error; look at its journal",
    INFO: "nothing to do now; a rising count is worth a hardware ticket",
    RESET: "reset the GPU with nothing running on it (nvidia-smi -r -i INDEX) or reboot the host, "
    "check it (fleet audit), then lift the quarantine: fleet gpu clear INVENTORY HOST GPU --reason TEXT",
    REBOOT: "reboot the host (the GPU left the PCIe bus or the driver asks for a restart), check it "
    "(fleet audit), then lift the quarantine: fleet gpu clear INVENTORY HOST GPU --reason TEXT",
    SERVICE: "open a hardware ticket (NVIDIA: contact support / check the board); after the repair "
    "lift the quarantine: fleet gpu clear INVENTORY HOST GPU --reason TEXT",
    UNKNOWN: "look the XID up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors)",
}


class Xid(NamedTuple):
    """One row of NVIDIA's Xid catalog."""

    number: int
    mnemonic: str
    description: str
    bucket: str  #: Resolution Bucket (Immediate Action)


def _x(number: int, mnemonic: str, description: str, bucket: str) -> Tuple[int, Xid]:
    return number, Xid(number, mnemonic, description, bucket)


#: The XIDs of Ampere and newer datacenter GPUs, from NVIDIA's Xid catalog.
XIDS: Dict[int, Xid] = dict(
    [
        _x(8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP"),
        _x(11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "invalid or corrupted push buffer stream", "RESTART_APP"),
        _x(13, "ROBUST_CHANNEL_GR_EXCEPTION", "graphics engine exception", "RESTART_APP"),
        _x(31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP"),
        _x(32, "ROBUST_CHANNEL_PBDMA_ERROR", "invalid or corrupted push buffer stream", "RESTART_APP"),
        _x(43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE"),
        _x(45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "preemptive cleanup, due to previous errors", "WORKFLOW_XID_45"),
        _x(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", "RESET_GPU"),
        _x(48, "ROBUST_CHANNEL_GPU_ECC_DBE", "double-bit ECC error", "WORKFLOW_XID_48"),
        _x(
            54,
            "SILENT_RUNNING_PWR_REDUCED_CLOCKING",
            "auxiliary power is not connected to the board",
            "CHECK_MECHANICALS",
        ),
        _x(62, "PMU_HALT_ERROR", "internal micro-controller halt", "RESET_GPU"),
        _x(63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", "IGNORE"),
        _x(64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU"),
        _x(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "graphics engine class error", "RESTART_APP"),
        _x(74, "NVLINK_ERROR", "NVLink error", "WORKFLOW_NVLINK_ERR"),
        _x(78, "VGPU_START_ERROR", "vGPU start error", "UPDATE_SWFW"),
        _x(79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", "RESTART_BM"),
        _x(80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "corrupted data sent to the GPU", "RESTART_APP"),
        _x(92, "EXCESSIVE_SBE_INTERRUPTS", "high single-bit ECC error rate", "IGNORE"),
        _x(94, "ROBUST_CHANNEL_CONTAINED_ERROR", "contained memory error", "RESTART_APP"),
        _x(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "uncontained memory error", "RESET_GPU"),
        _x(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "context switch timeout", "RESET_GPU"),
        _x(110, "SEC_FAULT_ERROR", "security fault", "RESET_GPU"),
        _x(119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", "RESET_GPU"),
        _x(120, "GSP_ERROR", "GSP error", "RESET_GPU"),
        _x(121, "C2C_ERROR", "C2C error", "IGNORE"),
        _x(136, "ALI_TRAINING_FAIL", "link training failed", "RESET_GPU"),
        _x(137, "NVLINK_PRIV_ERR", "NVLink privilege error", "IGNORE"),
        _x(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC unrecovered error", "RESET_GPU"),
        _x(143, "GPU_INIT_ERROR", "GPU initialization error", "RESET_GPU"),
        _x(144, "NVLINK_SAW_ERROR", "NVLink SAW error", "WORKFLOW_NVLINK5_ERR"),
        _x(145, "NVLINK_RLW_ERROR", "NVLink RLW error", "WORKFLOW_NVLINK5_ERR"),
        _x(146, "NVLINK_TLW_ERROR", "NVLink TLW error", "WORKFLOW_NVLINK5_ERR"),
        _x(147, "NVLINK_TREX_ERROR", "NVLink TREX error", "WORKFLOW_NVLINK5_ERR"),
        _x(148, "NVLINK_NVLPW_CTRL_ERROR", "NVLink NVLPW_CTRL error", "WORKFLOW_NVLINK5_ERR"),
        _x(149, "NVLINK_NETIR_ERROR", "NVLink NETIR error", "WORKFLOW_NVLINK5_ERR"),
        _x(150, "NVLINK_MSE_ERROR", "NVLink MSE error", "WORKFLOW_NVLINK5_ERR"),
        _x(151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", "key rotation error", "RESTART_VM"),
        _x(154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", "XID_154"),
        _x(155, "NVLINK_SW_DEFINED_ERROR", "NVLink software-defined error", "RESET_GPU"),
        _x(156, "RESOURCE_RETIREMENT_EVENT", "resource retirement event", "RESET_GPU"),
        _x(157, "RESOURCE_RETIREMENT_FAILURE", "resource retirement failure", "IGNORE"),
        _x(158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", "RESET_GPU"),
        _x(159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHI non-data error", "CHECK_UVM"),
    ]
)


def xid_action(number: int) -> str:
    """fleet's action for an XID; ``unknown`` for one the catalogue does not list."""
    entry = XIDS.get(number)
    return BUCKET_ACTION.get(entry.bucket, UNKNOWN) if entry is not None else UNKNOWN


def meaning(kind: str, xid: Optional[int] = None) -> Tuple[str, str]:
    """``(action, text)`` for one event: what it is and what NVIDIA says to do."""
    if kind == "dbe":
        return RESET, "double-bit (uncorrectable) ECC error: the GPU needs a reset (as NVIDIA's XID 48 workflow)"
    if kind == "sbe":
        return INFO, "single-bit ECC error, corrected by the hardware"
    if kind != "xid" or xid is None:
        raise ValueError("kind=%r xid=%r: an event is an xid with its number, sbe or dbe" % (kind, xid))
    entry = XIDS.get(xid)
    if entry is None:
        return UNKNOWN, "XID %d: not in fleet's catalogue (see NVIDIA's Xid catalog)" % xid
    return xid_action(xid), "XID %d %s (%s): NVIDIA's immediate action %s" % (
        xid,
        entry.mnemonic,
        entry.description,
        entry.bucket,
    )


def is_critical(event: Mapping[str, Any]) -> bool:
    """Whether a recorded event quarantines its GPU."""
    return event.get("action") in CRITICAL


def quarantine_since(events: Iterable[Mapping[str, Any]], cleared_through: int) -> Optional[Mapping[str, Any]]:
    """The first critical event after the last clear (its ``seq`` above ``cleared_through``), or
    None: the GPU is not quarantined."""
    after = [e for e in events if is_critical(e) and int(e.get("seq", 0)) > cleared_through]
    return min(after, key=lambda e: int(e["seq"])) if after else None


def trim(events: List[Dict[str, Any]], keep: int) -> Tuple[List[Dict[str, Any]], int]:
    """Keep at most ``keep`` events, dropping the oldest non-critical ones first (a flood of
    corrected errors never pushes out the event that quarantined a GPU). Returns the kept events
    in sequence order and how many were dropped."""
    ordered = sorted(events, key=lambda e: int(e["seq"]))
    dropped = 0
    while len(ordered) > keep:
        victim = next((i for i, e in enumerate(ordered) if not is_critical(e)), 0)
        del ordered[victim]
        dropped += 1
    return ordered, dropped


_KERNEL_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<domain>[0-9A-Fa-f]{4,8}):(?P<bus>[0-9A-Fa-f]{2}):(?P<device>[0-9A-Fa-f]{2})"
    r"(?:\.[0-7])?\): (?P<xid>\d+)(?:,\s*(?P<text>.*))?$"
)


class KernelXid(NamedTuple):
    bus_id: str  #: as NVML spells it: ``00000000:1B:00.0``
    xid: int
    text: str


def nvml_bus_id(domain: int, bus: int, device: int) -> str:
    """The bus id as ``nvmlPciInfo_t.busId`` spells it (``%08X:%02X:%02X.0``, nvml.h)."""
    return "%08X:%02X:%02X.0" % (domain, bus, device)


def parse_kernel_xid(line: str) -> Optional[KernelXid]:
    """An ``NVRM: Xid`` kernel log line -> (NVML bus id, XID, the rest); None for any other line."""
    m = _KERNEL_XID.search(line.rstrip())
    if m is None:
        return None
    bus_id = nvml_bus_id(int(m.group("domain"), 16), int(m.group("bus"), 16), int(m.group("device"), 16))
    return KernelXid(bus_id, int(m.group("xid")), (m.group("text") or "").strip())
