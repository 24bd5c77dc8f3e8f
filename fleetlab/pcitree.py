"""The PCI devices of a lab host: a sysfs tree the host sees as ``/sys/bus/pci/devices``.

A lab host shares this machine's kernel, so its own ``/sys/bus/pci/devices`` would list this
machine's devices. The lab writes the profile's PCI hierarchy into the host's root instead and
nspawn binds it read-only over ``/sys/bus/pci/devices`` (``fleetlab.machine``): every GPU of the
profile (those NVML does not enumerate too: they are on the bus), each below a PCIe switch
(downstream port, upstream port) below a root port, as on an HGX baseboard or a PCIe server.
Each function has the sysfs attributes fleet and lspci read (``vendor``, ``device``, ``class``,
``config``: 4096 bytes of configuration space), and each entry of ``devices`` is a symlink to the
function's directory, whose path names the ports above it, root port first, as Linux's sysfs
does (``/sys/devices/pci0000:00/0000:00:01.0/.../0000:1b:00.0``).

Switch ports and root ports carry an ACS extended capability (``PCI_EXT_CAP_ID_ACS``, after an
AER capability, so the extended list is walked) whose Control register follows the profile's
``[pcie] acs``: ``off`` (0, what NVIDIA's and NCCL's guides ask for) or ``redirect`` (SrcValid,
ReqRedir, CmpltRedir, UpstreamFwd: what Linux's ``pci_std_enable_acs`` sets where an IOMMU is on,
and many BIOSes by default). Switches are shared by the GPUs of a ``[pcie] switch_groups`` entry;
every other GPU has a switch of its own, or sits on its root port where its bus number leaves no
room for a switch (a workstation's GPU on bus 01). Bridge bus numbers and vendor ids are illustrative.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fleetlab.profiles import LabProfile

#: Inside a lab host.
PCI_ROOT = "/usr/lib/fleet-lab/hardware/pci"
DEVICES_DIR = PCI_ROOT + "/devices"  #: bound over /sys/bus/pci/devices
TREE_DIR = PCI_ROOT + "/sys"  #: the functions' directories, as /sys/devices holds them
SYSFS_DEVICES = "/sys/bus/pci/devices"

NVIDIA = 0x10DE
SWITCH_VENDOR, SWITCH_DEVICE = 0x1000, 0xC030  # a Broadcom PEX890xx switch (illustrative)
ROOT_VENDOR, ROOT_DEVICE = 0x8086, 0x352A  # a root port (illustrative)
CLASS_BRIDGE = 0x060400
CLASS_3D = 0x030200
#: PCI Express Capabilities register, Device/Port Type
ENDPOINT, ROOT_PORT, UPSTREAM, DOWNSTREAM = 0x0, 0x4, 0x5, 0x6
ACS_CAP = 0x005F  # SrcValid TransBlk ReqRedir CmpltRedir UpstreamFwd DirectTrans
ACS_CTL = {"off": 0x0000, "redirect": 0x001D}  # redirect: SrcValid ReqRedir CmpltRedir UpstreamFwd


@dataclass(frozen=True)
class PciFunction:
    bdf: str  #: ``0000:1b:00.0``
    path: str  #: below TREE_DIR: ``pci0000:00/0000:00:01.0/.../0000:1b:00.0``
    vendor: int
    device: int
    klass: int
    config: bytes


def config_space(
    vendor: int,
    device: int,
    klass: int,
    port_type: int,
    buses: tuple[int, int, int] | None = None,
    acs_ctl: int | None = None,
) -> bytes:
    """4096 bytes of configuration space: the header, a PCI Express capability at 0x40 and, for
    ports, AER at 0x100 followed by ACS at 0x148."""
    space = bytearray(4096)
    header_type = 0x01 if buses is not None else 0x00
    struct.pack_into("<HHHH", space, 0x00, vendor, device, 0x0007, 0x0010)  # command; status: cap list
    struct.pack_into("<I", space, 0x08, (klass << 8) | 0xA1)  # class code, revision
    space[0x0E] = header_type
    if buses is not None:
        space[0x18], space[0x19], space[0x1A] = buses  # primary, secondary, subordinate
    space[0x34] = 0x40
    struct.pack_into("<BBH", space, 0x40, 0x10, 0x00, 0x0002 | (port_type << 4))  # PCIe cap v2
    if acs_ctl is not None:
        struct.pack_into("<I", space, 0x100, 0x0001 | (2 << 16) | (0x148 << 20))  # AER v2, next 0x148
        struct.pack_into("<IHH", space, 0x148, 0x000D | (1 << 16), ACS_CAP, acs_ctl)  # ACS v1, last
    return bytes(space)


def _bdf(domain: int, bus: int, device: int) -> str:
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def host_tree(profile: LabProfile) -> list[PciFunction]:
    """Every PCI function of the profile's GPU hierarchy: root ports, switch ports, GPUs."""
    ctl = ACS_CTL[profile.pcie_acs]
    groups: list[list[int]] = [list(g) for g in profile.switch_groups]
    grouped = {s for g in groups for s in g}
    groups += [[g.slot] for g in profile.slots if g.slot not in grouped]
    groups.sort(key=lambda g: min(profile.slots[s].bus_id.bus for s in g))
    out: list[PciFunction] = []
    sku = profile.sku
    for r, group in enumerate(groups):
        slots = sorted(group, key=lambda s: profile.slots[s].bus_id.bus)
        domain = profile.slots[slots[0]].bus_id.domain
        first, top = profile.slots[slots[0]].bus_id.bus, max(profile.slots[s].bus_id.bus for s in slots)
        if r + 1 > 31:
            raise ValueError(f"lab profile {profile.name}: more than 31 root ports")
        root = _bdf(domain, 0, r + 1)
        root_path = f"pci{domain:04x}:00/{root}"
        parents: list[tuple[str, str]] = []  # (bdf, path) of the port each GPU hangs below
        if first < 3:  # no bus numbers left for a switch: the GPU sits on the root port (a workstation)
            if len(slots) > 1:
                raise ValueError(f"lab profile {profile.name}: no room for a PCIe switch above bus {first:02x}")
            out.append(PciFunction(root, root_path, ROOT_VENDOR, ROOT_DEVICE, CLASS_BRIDGE,
                                   config_space(ROOT_VENDOR, ROOT_DEVICE, CLASS_BRIDGE, ROOT_PORT,
                                                (0, first, first), ctl)))  # fmt: skip
            parents.append((root, root_path))
        else:
            up_bus = first - 2
            up = _bdf(domain, up_bus, 0)
            out.append(PciFunction(root, root_path, ROOT_VENDOR, ROOT_DEVICE, CLASS_BRIDGE,
                                   config_space(ROOT_VENDOR, ROOT_DEVICE, CLASS_BRIDGE, ROOT_PORT,
                                                (0, up_bus, top), ctl)))  # fmt: skip
            out.append(PciFunction(up, f"{root_path}/{up}", SWITCH_VENDOR, SWITCH_DEVICE, CLASS_BRIDGE,
                                   config_space(SWITCH_VENDOR, SWITCH_DEVICE, CLASS_BRIDGE, UPSTREAM,
                                                (up_bus, up_bus + 1, top))))  # fmt: skip
            for k, slot in enumerate(slots):
                gpu_bus = profile.slots[slot].bus_id.bus
                down = _bdf(domain, up_bus + 1, k)
                out.append(PciFunction(down, f"{root_path}/{up}/{down}", SWITCH_VENDOR, SWITCH_DEVICE, CLASS_BRIDGE,
                                       config_space(SWITCH_VENDOR, SWITCH_DEVICE, CLASS_BRIDGE, DOWNSTREAM,
                                                    (up_bus + 1, gpu_bus, gpu_bus), ctl)))  # fmt: skip
                parents.append((down, f"{root_path}/{up}/{down}"))
        for slot, (_, parent_path) in zip(slots, parents, strict=True):
            gpu = profile.slots[slot]
            bdf = _bdf(gpu.bus_id.domain, gpu.bus_id.bus, gpu.bus_id.device)
            device = sku.pci_device_id >> 16
            out.append(PciFunction(bdf, f"{parent_path}/{bdf}", NVIDIA, device, CLASS_3D,
                                   config_space(NVIDIA, device, CLASS_3D, ENDPOINT)))  # fmt: skip
    seen = [f.bdf for f in out]
    if len(seen) != len(set(seen)):
        dup = sorted({b for b in seen if seen.count(b) > 1})
        raise ValueError(f"lab profile {profile.name}: PCI addresses collide ({', '.join(dup)}); spread its bus_ids")
    return out
