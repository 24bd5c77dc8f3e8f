"""fleet's PCIe ACS probe: the bridges above each NVIDIA GPU and their ACS control, from sysfs.

Run on a host as root (``fleet.facts.pcie_acs.PcieAcs`` sends it to ``sudo -n python3 -I -``):
the PCI extended configuration space, where the ACS capability lives, is readable by root only
(a non-root read of ``/sys/bus/pci/devices/<bdf>/config`` stops after the first 64 bytes). Reads
only; prints one JSON object and exits 0.

* The GPUs: functions in ``/sys/bus/pci/devices`` with vendor ``0x10de`` and class ``0x0300xx``
  (VGA) or ``0x0302xx`` (3D controller).
* The bridges above a GPU: the PCI addresses in the path its sysfs entry resolves to
  (``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/.../0000:05:00.0``: each component is the
  port the GPU hangs below, root port first; Linux ``drivers/pci/probe.c`` names them so).
* ACS: the extended capability with ID ``0x000D`` (``PCI_EXT_CAP_ID_ACS``, Linux
  ``include/uapi/linux/pci_regs.h``), found by walking the extended capability list from offset
  0x100; its Capability register at +4 and Control register at +6 (16 bits each), as
  ``lspci -vvv`` prints them (``ACSCap:`` / ``ACSCtl:``) and ``setpci ECAP_ACS+6.w`` reads them.

Written for Python 3.6 (standard library only, %-formatting).
"""

import json
import os
import re
import struct
import sys
from typing import Any, Dict, List, Optional

SYSFS_DEVICES = "/sys/bus/pci/devices"
ACS_EXT_CAP_ID = 0x000D
EXT_CAP_START = 0x100
_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def acs_registers(config: bytes) -> Dict[str, Any]:
    """``{"cap": int, "ctl": int}`` from a function's configuration space, ``{"cap": None, "ctl": None}``
    when it has no ACS capability, ``{"error": ...}`` when the extended space cannot be read."""
    if len(config) < EXT_CAP_START + 4:
        return {"error": "%d bytes of configuration space (the extended space needs root)" % len(config)}
    offset, seen = EXT_CAP_START, set()
    while offset and offset not in seen and offset + 8 <= len(config):
        seen.add(offset)
        (header,) = struct.unpack_from("<I", config, offset)
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == ACS_EXT_CAP_ID:
            cap, ctl = struct.unpack_from("<HH", config, offset + 4)
            return {"cap": cap, "ctl": ctl}
        offset = (header >> 20) & 0xFFC
    return {"cap": None, "ctl": None}


def is_gpu(path: str) -> bool:
    try:
        with open(os.path.join(path, "vendor")) as f:
            vendor = f.read().strip()
        with open(os.path.join(path, "class")) as f:
            klass = f.read().strip()
    except OSError:
        return False
    return vendor == "0x10de" and klass[:6] in ("0x0300", "0x0302")


def bridges_above(devices: str, bdf: str) -> List[str]:
    """The PCI addresses between the root complex and ``bdf``, root port first."""
    parts = os.path.realpath(os.path.join(devices, bdf)).split("/")
    return [p.lower() for p in parts[:-1] if _BDF.match(p)]


def read_config(devices: str, bdf: str) -> Optional[bytes]:
    try:
        with open(os.path.join(devices, bdf, "config"), "rb") as f:
            return f.read(4096)
    except OSError:
        return None


def probe(devices: str = SYSFS_DEVICES) -> Dict[str, Any]:
    out: dict[str, Any] = {"schema": 1, "status": "ok", "root": os.geteuid() == 0, "gpus": {}, "bridges": {}}
    try:
        names = sorted(os.listdir(devices))
    except OSError as exc:
        out["status"] = "no-sysfs"
        out["error"] = "%s: %s" % (devices, exc.strerror)
        return out
    for name in names:
        if not _BDF.match(name) or not is_gpu(os.path.join(devices, name)):
            continue
        path = bridges_above(devices, name)
        out["gpus"][name.lower()] = path
        for bridge in path:
            if bridge in out["bridges"]:
                continue
            config = read_config(devices, bridge)
            out["bridges"][bridge] = acs_registers(config) if config is not None else {"error": "unreadable"}
    return out


def main() -> None:
    try:
        result = probe()
    except Exception as exc:  # answer in the protocol, never a traceback
        result = {"schema": 1, "status": "probe-crashed", "error": "%s: %s" % (type(exc).__name__, exc)}
    sys.stdout.write("\n" + json.dumps(result, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
