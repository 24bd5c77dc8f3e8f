"""GPU faults for the simulated NVML: an XID or an ECC error on one GPU at one time.

The library (``fakenvml.c``) reads ``<state dir>/events``, one fault a line::

    <unix time> <nvml index> xid <n>     an XID critical error (nvmlEventTypeXidCriticalError, eventData n)
    <unix time> <nvml index> sbe         a single-bit ECC error (nvmlEventTypeSingleBitEccError)
    <unix time> <nvml index> dbe         a double-bit ECC error (nvmlEventTypeDoubleBitEccError)

and delivers each through ``nvmlEventSetWait_v2`` to every event set that registered that type
on that GPU before the fault's time; a due ECC fault also counts in
``nvmlDeviceGetTotalEccErrors``. Lines are appended (one ``write`` each, so concurrent writers
never interleave), never rewritten: delivery is tracked by line number.

The kernel-log side of a fault (``NVRM: Xid (PCI:...): 79, ...``) is a separate line written to
the host's ``/dev/kmsg``: :func:`kernel_log_line`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

EVENTS_FILE = "events"
KINDS = ("xid", "sbe", "dbe")


def fault_line(gpu: int, kind: str, xid: int | None = None, at: float | None = None) -> str:
    """One line of the events file (pure but for the default time: now)."""
    if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < 32:
        raise ValueError(f"gpu={gpu!r}: an NVML index 0..31")
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {', '.join(KINDS)}")
    if kind == "xid":
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid < 1 << 32:
            raise ValueError(f"xid={xid!r}: a positive XID number")
        tail = f"xid {xid}"
    elif xid is not None:
        raise ValueError(f"xid={xid!r}: only an 'xid' fault carries an XID")
    else:
        tail = kind
    when = time.time() if at is None else at
    return f"{when:.6f} {gpu} {tail}\n"


def inject(state_dir: Path, gpu: int, kind: str, xid: int | None = None, at: float | None = None) -> str:
    """Append one fault to ``state_dir/events``; return the line written."""
    line = fault_line(gpu, kind, xid, at)
    fd = os.open(Path(state_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return line


def kernel_log_line(bus_id: str, xid: int, text: str, pid: int | None = None) -> str:
    """An XID as the NVIDIA kernel module logs it (``nvErrorLog_va``), e.g.
    ``NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.``

    ``bus_id`` is ``dddd:bb:dd`` (the driver prints domain, bus and device, not the function).
    """
    who = f"pid={pid}, name=vllm, " if pid is not None else "pid='<unknown>', name=<unknown>, "
    return f"NVRM: Xid (PCI:{bus_id}): {xid}, {who}{text}"


__all__ = ["EVENTS_FILE", "KINDS", "fault_line", "inject", "kernel_log_line"]
