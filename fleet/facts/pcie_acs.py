"""PCIe ACS on the bridges above a host's GPUs, as a pyinfra fact (read-only, as root).

``PcieAcs`` sends ``fleet/facts/pcie_acs_probe.py`` to the host's ``python3 -I`` on stdin under
``sudo -n`` (nothing is written on the host) and validates its one JSON line into
:class:`AcsFacts`: for each NVIDIA GPU (by the bus id NVML gives it) the bridges above it, root
port first, and for each bridge its ACS Capability and Control registers. A host where root is
not available without a password answers ``no-root``; one without python3, ``no-python``: the
audit says so instead of guessing.

ACS Control bits (PCIe Base Specification, "ACS Extended Capability"; Linux
``include/uapi/linux/pci_regs.h`` ``PCI_ACS_*``; ``lspci -vvv`` prints them as ``ACSCtl:``):
Source Validation (SrcValid, 0x01), Translation Blocking (TransBlk, 0x02), P2P Request Redirect
(ReqRedir, 0x04), P2P Completion Redirect (CmpltRedir, 0x08), Upstream Forwarding (UpstreamFwd,
0x10), P2P Egress Control (EgressCtrl, 0x20), Direct Translated P2P (DirectTrans, 0x40).
:data:`REDIRECT` are the bits Linux's ``pci=disable_acs_redir=`` clears "to always allow passing
P2P traffic uninterrupted" (``Documentation/admin-guide/kernel-parameters.txt``).

**Example:**

.. code:: python

    acs = host.get_fact(PcieAcs)
    [b.bdf for b in acs.bridges.values() if b.redirects]
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.facts.output import answer_object

ACS_FLAGS: tuple[tuple[int, str], ...] = (
    (0x01, "SrcValid"),
    (0x02, "TransBlk"),
    (0x04, "ReqRedir"),
    (0x08, "CmpltRedir"),
    (0x10, "UpstreamFwd"),
    (0x20, "EgressCtrl"),
    (0x40, "DirectTrans"),
)
#: P2P Request Redirect, P2P Completion Redirect, P2P Egress Control.
REDIRECT = 0x04 | 0x08 | 0x20
STATUSES = ("ok", "no-root", "no-python", "no-sysfs", "probe-crashed", "bad-output")
_END = "FLEET_PCIE_ACS_EOF"


def flags(value: int) -> str:
    """``lspci -vvv``'s spelling: ``SrcValid+ TransBlk- ReqRedir+ ...``."""
    return " ".join(f"{name}{'+' if value & bit else '-'}" for bit, name in ACS_FLAGS)


def nvml_bus_id(bdf: str) -> str:
    """``0000:18:00.0`` (sysfs) -> ``00000000:18:00.0`` (NVML's ``busId``)."""
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@dataclass(frozen=True)
class BridgeAcs:
    """One bridge above a GPU: its ACS registers, None when it has no ACS capability."""

    bdf: str  #: sysfs spelling, ``0000:17:01.0``
    cap: int | None
    ctl: int | None
    error: str | None = None  #: why the registers could not be read

    @property
    def redirects(self) -> bool:
        """Whether ACS sends peer-to-peer traffic up to the root complex (or blocks it)."""
        return self.ctl is not None and bool(self.ctl & REDIRECT)


@dataclass(frozen=True)
class AcsFacts:
    status: str
    error: str | None
    gpus: dict[str, tuple[str, ...]]  #: NVML bus id -> bridges above it, root port first
    bridges: dict[str, BridgeAcs]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@cache
def probe_script() -> str:
    return resources.files("fleet.facts").joinpath("pcie_acs_probe.py").read_text()


def acs_command() -> str:
    """As root (already, or through ``sudo -n``), the probe on the host's python3; always exit 0."""

    def answer(status: str, error: str) -> str:
        return shlex.quote(json.dumps({"schema": 1, "status": status, "error": error}))

    no_root = answer("no-root", "root is needed to read PCI extended configuration space; sudo -n refused")
    no_python = answer("no-python", "no python3 on the host")
    return (
        'if [ "$(id -u)" = 0 ]; then S=; elif sudo -n true 2>/dev/null; then S="sudo -n"; else '
        f"printf '%s\\n' {no_root}; exit 0; fi; "
        f"if ! command -v python3 >/dev/null 2>&1; then printf '%s\\n' {no_python}; exit 0; fi; "
        f"$S python3 -I - <<'{_END}'\n{probe_script()}{_END}\n"
    )


def _bad(why: str) -> AcsFacts:
    return AcsFacts("bad-output", why[:300], {}, {})


def _register(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFF:
        raise ValueError(f"{value!r} is not a 16-bit register")
    return value


def parse_acs_output(lines: Sequence[str]) -> AcsFacts:
    """The probe's output (its JSON is the last non-empty line) -> :class:`AcsFacts` (pure)."""
    raw = answer_object(lines, STATUSES)
    if isinstance(raw, str):
        return _bad(raw)
    error = raw.get("error")
    if raw["status"] != "ok":
        return AcsFacts(raw["status"], str(error)[:300] if error else None, {}, {})
    try:
        bridges = {}
        for bdf, regs in dict(raw.get("bridges") or {}).items():
            if not isinstance(regs, dict):
                raise ValueError(f"bridge {bdf}: {regs!r}")
            bridges[str(bdf)] = BridgeAcs(str(bdf), _register(regs.get("cap")), _register(regs.get("ctl")),
                                          str(regs["error"])[:200] if regs.get("error") else None)  # fmt: skip
        gpus = {}
        for bdf, path in dict(raw.get("gpus") or {}).items():
            if not isinstance(path, list) or not all(isinstance(p, str) and p in bridges for p in path):
                raise ValueError(f"GPU {bdf}: path {path!r}")
            gpus[nvml_bus_id(str(bdf))] = tuple(path)
    except (ValueError, TypeError, AttributeError) as exc:
        return _bad(f"unexpected answer ({exc})")
    return AcsFacts("ok", None, gpus, bridges)


class PcieAcs(FactBase[AcsFacts]):
    """
    ACS control of the PCIe bridges above each NVIDIA GPU (read as root, changes nothing).
    """

    @override
    def command(self) -> str:
        return acs_command()

    @override
    def process(self, output: list[str]) -> AcsFacts:
        return parse_acs_output(output)
