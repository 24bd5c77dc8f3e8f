"""Lab host profiles: what the simulated GPUs of one lab host look like.

A profile is a small TOML file (``fleetlab/profiles/<name>.toml``) that names a catalogue SKU
and says only what is specific to the host: GPU count, driver versions, PCIe/NVLink topology,
per-GPU overrides and faults. GPU-model facts (name, memory, compute capability, links, ...) come
from :data:`fleet.gpus.CATALOGUE` and are never copied into a profile.

:meth:`LabProfile.render` produces the ``key=value`` file the simulated NVML library
(``fleetlab/nvml/fakenvml.c``) reads; :meth:`LabProfile.host_gpus` is what a correct probe of
that host must conclude, so tests can compare the probe with the profile.

Schema (all tables optional unless noted)::

    description = "..."
    sku = "h100-sxm-80gb"          # required, a catalogue key
    count = 8                      # GPUs physically present (default: the SKU's typical count)
    missing = [5]                  # slots that are not enumerated (fell off the bus)

    [driver]
    version = "580.95.05"          # required: nvmlSystemGetDriverVersion
    kernel_module = "580.95.05"    # /proc/driver/nvidia/version (default: version)
    cuda = 13000                   # required: nvmlSystemGetCudaDriverVersion
    build_date = "..."             # date shown in /proc/driver/nvidia/version
    fail_init_on_mismatch = false  # true: nvmlInit fails with LIB_RM_VERSION_MISMATCH (18)
    branch = "r582_49"             # nvmlSystemGetDriverBranch (default "r<major>_00")

    [host]
    virtualization = "none"        # none | passthrough: the GPUs are passed through to a VM;
                                   #   nvmlDeviceGetVirtualizationMode = 1 and NVLink is invisible
                                   #   (every link call NOT_SUPPORTED; [nvlink] is ignored)
    nvml_events = true             # false: the driver supports no NVML event here
                                   #   (nvmlDeviceGetSupportedEventTypes 0, RegisterEvents
                                   #   NOT_SUPPORTED): XIDs are only in the kernel log

    [pcie]
    bus_ids = ["18", "2a", ...]    # hex bus numbers, or full "0000:18:00.0"
    subsystem_id = 0x16C110DE      # default: the SKU's usual board (GpuSku.pci_subsystem_id)
    matrix = ["X NODE SYS", ...]   # explicit PCIe levels per pair (PIX PXB PHB NODE SYS), or:
    numa = [0, 0, 1, 1]            #   same node -> same_numa_level, else cross_numa_level;
                                   #   also nvmlDeviceGetMemoryAffinity (default node 0)
    switch_groups = [[0, 1]]       #   GPUs sharing a PCIe switch tree -> switch_level
    switch_level = "PXB"
    same_numa_level = "NODE"
    cross_numa_level = "SYS"
    default_level = "PHB"          #   without numa/matrix: every pair
    cpu_affinity = ["0-47", ...]   # per slot, cpulist syntax
    acs = "off"                    # ACS on the root and switch ports above the GPUs: off, or
                                   #   redirect (P2P requests sent up to the root complex); the
                                   #   host's /sys/bus/pci/devices shows it (fleetlab.pcitree)

    [nvlink]
    fabric = "switch"              # switch | pairs | none (default: the SKU's typical fabric)
    switch_bus_ids = ["05", ...]   # switch fabric: one per NVSwitch
    links_per_switch = [4, 5, 5, 4]
    switch_device_id = 0x22A310DE
    pairs = [[0, 5], [1, 2]]       # pairs fabric: bridged slots

    [fabric]                       # GPU fabric info, only for SKUs that support it
    state = "completed"            # not_supported | not_started | in_progress | completed
    status = 0
    clique_id = 0
    cluster_uuid = "00000000-0000-0000-0000-000000000000"

    [defaults]
    baseline_used_mib = 0          # memory held by something else with nothing of ours running:
                                   #   adds to v2 used (and v1 used), not to reserved
    reserved_mib = 480             # the driver's reserve, NVML v2 reserved (default: the SKU's
                                   #   GpuSku.memory_reserved); v1 used = reserved + v2 used
    temperature_c = 33
    power_usage_w = 70
    persistence = true
    ecc = true
    mig = false

    [[gpu]]                        # per-slot overrides
    slot = 3
    bus_id = "0000:5d:00.0"; serial = "..."; uuid = "GPU-..."; baseline_used_mib = 600
    pcie_gen = 4; pcie_width = 8; irq = 41
    links_down = [7]
    ecc_errors = { corrected_volatile = 0, uncorrected_volatile = 2, corrected_aggregate = 0,
                   uncorrected_aggregate = 2 }
    remapped_rows = { correctable = 0, uncorrectable = 1, pending = true, failure = false }

Board facts (part number, VBIOS and InfoROM versions, BAR1, clocks, cores, bus width, power
limits) come from the catalogue SKU; memory follows the real driver (nvml.h ``nvmlMemory_v2_t``):
reserved + used + free = total, v1 ``used`` = reserved + v2 ``used``, and live process memory
(``<state dir>/<pid>.mem``) adds to ``used``.
"""

from __future__ import annotations

import hashlib
import tomllib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.gpus import CATALOGUE, Fabric, Gpu, GpuSku, HostGpus, MiB

PROFILE_DIR = Path(__file__).with_name("profiles")

#: ``nvmlGpuTopologyLevel_t`` by the symbol ``nvidia-smi topo -m`` prints.
TOPOLOGY_LEVELS: dict[str, int] = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
#: ``nvmlNvLinkDeviceType_t``
NVLINK_REMOTE_GPU = 0
NVLINK_REMOTE_SWITCH = 2
#: ``nvmlGpuP2PStatus_t``
P2P_OK = 0
P2P_GPU_NOT_SUPPORTED = 2
P2P_NOT_SUPPORTED = 5
#: ``nvmlGpuFabricState_t``
FABRIC_STATES: dict[str, int] = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}
#: ``nvmlDeviceGetSupportedEventTypes`` a real H100/H200 answered (driver 580.159.04,
#: tests/fixtures/gpu-truth); the library drops the ECC bits where ECC is off, as NVML documents.
EVENT_TYPES_RECORDED = 0xFF9F
ECC_COUNTERS = ("corrected_volatile", "corrected_aggregate", "uncorrected_volatile", "uncorrected_aggregate")
REMAP_FIELDS = ("correctable", "uncorrectable", "pending", "failure")
_UUID_NAMESPACE = uuid.UUID("6f1c3e0a-6a53-4b8e-9c2e-2f0d8a7b5c41")


class _Fields:
    """Typed access to one TOML table that raises a ValueError naming file, field and value."""

    def __init__(self, path: Path, prefix: str, table: Mapping[str, Any]) -> None:
        self.path, self.prefix, self.table = path, prefix, table

    def fail(self, key: str, value: object, allowed: str) -> ValueError:
        return ValueError(f"{self.path}: field '{self.prefix}{key}' = {value!r} is invalid; allowed: {allowed}")

    def sub(self, key: str) -> _Fields:
        value = self.table.get(key, {})
        if not isinstance(value, Mapping):
            raise self.fail(key, value, "a table")
        return _Fields(self.path, f"{self.prefix}{key}.", value)

    def int_(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        value = self.table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, value, f"an integer >= {minimum}")
        return value

    def bool_(self, key: str, default: bool) -> bool:
        value = self.table.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def str_(self, key: str, default: str | None = None) -> str:
        value = self.table.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(key, value, "a non-empty string")
        return value

    def choice(self, key: str, default: str, allowed: Sequence[str]) -> str:
        value = self.table.get(key, default)
        if value not in allowed:
            raise self.fail(key, value, " | ".join(allowed))
        return str(value)

    def list_(self, key: str) -> list[Any] | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.fail(key, value, "a list")
        return value

    def int_list(self, key: str, length: int | None = None, below: int | None = None) -> list[int] | None:
        values = self.list_(key)
        if values is None:
            return None
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
        if (
            not ok
            or (length is not None and len(values) != length)
            or (below is not None and any(v >= below for v in values))
        ):
            what = "a list of integers >= 0"
            what += f" with {length} entries" if length is not None else ""
            what += f", each < {below}" if below is not None else ""
            raise self.fail(key, values, what)
        return values


@dataclass(frozen=True)
class BusId:
    """A PCI address; NVML prints it as ``%08X:%02X:%02X.0``."""

    domain: int
    bus: int
    device: int = 0

    @classmethod
    def parse(cls, text: str) -> BusId:
        """Parse ``"18"``, ``"18:00.0"``, ``"0000:18:00.0"`` or ``"00000000:18:00.0"``."""
        parts = text.strip().split(":")
        if len(parts) == 1:
            return cls(0, int(parts[0], 16))
        *domain, bus, devfn = parts
        if len(domain) > 1 or not devfn.endswith(".0"):
            raise ValueError(text)
        return cls(int(domain[0], 16) if domain else 0, int(bus, 16), int(devfn[:-2], 16))

    @property
    def nvml(self) -> str:
        return f"{self.domain:08X}:{self.bus:02X}:{self.device:02X}.0"


@dataclass(frozen=True)
class Link:
    """One NVLink of a GPU: whether it is up and what sits at the far end."""

    active: bool
    remote_type: int  #: NVLINK_REMOTE_GPU or NVLINK_REMOTE_SWITCH
    remote: BusId
    remote_device_id: int


@dataclass(frozen=True)
class SlotGpu:
    """One physical GPU of the host (enumerated or missing)."""

    slot: int
    bus_id: BusId
    uuid: str
    serial: str | None
    baseline_used: int  #: bytes
    pcie_gen: int
    pcie_width: int
    ecc_errors: tuple[int, int, int, int]  #: in ECC_COUNTERS order
    remapped_rows: tuple[int, int, int, int]  #: in REMAP_FIELDS order
    links_down: frozenset[int]
    cpu_affinity: tuple[int, ...]  #: CPU numbers


@dataclass(frozen=True)
class FabricInfo:
    state: int
    status: int
    clique_id: int
    cluster_uuid: uuid.UUID


@dataclass(frozen=True)
class LabProfile:
    """A loaded, validated lab profile."""

    name: str
    path: Path
    description: str
    sku: GpuSku
    slots: tuple[SlotGpu, ...]
    missing: frozenset[int]
    driver_version: str
    kernel_module_version: str
    cuda_driver_version: int
    build_date: str
    fail_init_on_mismatch: bool
    pcie_levels: tuple[tuple[int, ...], ...]  #: by slot
    pci_subsystem_id: int
    fabric: Fabric
    switch_bus_ids: tuple[BusId, ...]
    links_per_switch: tuple[int, ...]
    switch_device_id: int
    pairs: tuple[tuple[int, int], ...]
    fabric_info: FabricInfo | None
    temperature_c: int
    power_usage_w: int
    persistence: bool
    ecc_enabled: bool
    mig_enabled: bool
    virtualization: str = "none"  #: "none" (bare metal) or "passthrough" (one VM owns the GPUs)
    driver_branch: str = ""  #: ``nvmlSystemGetDriverBranch``
    memory_reserved: int = 0  #: bytes, NVML v2 ``reserved`` (the driver's reserve)
    numa_nodes: tuple[int, ...] = ()  #: host NUMA node per slot (``nvmlDeviceGetMemoryAffinity``)
    irqs: tuple[int, ...] = ()  #: ``nvmlDeviceGetIrqNum`` per slot
    nvml_events: bool = True  #: the event API answers (False: every type NOT_SUPPORTED)
    switch_groups: tuple[tuple[int, ...], ...] = ()  #: slots sharing a PCIe switch
    pcie_acs: str = "off"  #: ``off`` or ``redirect``: ACS control of the ports above the GPUs

    @property
    def passthrough(self) -> bool:
        """GPUs passed through to a VM: NVML shows no NVLink (every link call is NOT_SUPPORTED)."""
        return self.virtualization == "passthrough"

    # ---- derived views --------------------------------------------------------------------

    @property
    def enumerated(self) -> tuple[SlotGpu, ...]:
        """The GPUs NVML enumerates, in NVML index order."""
        return tuple(g for g in self.slots if g.slot not in self.missing)

    @property
    def nvml_version(self) -> str:
        return f"{self.cuda_driver_version // 1000}.{self.driver_version}"

    def links(self, slot: int) -> tuple[Link, ...]:
        """The NVLinks NVML shows for one slot, in link order (empty for GPUs without NVLink, and
        for GPUs passed through to a VM, where NVML shows none)."""
        count = self.sku.nvlink_links
        down = self.slots[slot].links_down
        if count == 0 or self.passthrough:
            return ()
        if self.fabric is Fabric.SWITCH:
            targets = [
                (sw, NVLINK_REMOTE_SWITCH, self.switch_device_id)
                for sw, n in zip(self.switch_bus_ids, self.links_per_switch, strict=True)
                for _ in range(n)
            ]
            return tuple(Link(i not in down, t, bus, dev) for i, (bus, t, dev) in enumerate(targets))
        peer = self._pair_peer(slot)
        result = []
        for i in range(count):
            if peer is None:
                result.append(Link(False, NVLINK_REMOTE_GPU, BusId(0, 0), 0))
            else:
                up = i not in down and peer not in self.missing
                result.append(Link(up, NVLINK_REMOTE_GPU, self.slots[peer].bus_id, self.sku.pci_device_id))
        return tuple(result)

    def _pair_peer(self, slot: int) -> int | None:
        if self.fabric is not Fabric.PAIRS:
            return None
        for a, b in self.pairs:
            if slot in (a, b):
                return b if slot == a else a
        return None

    def nvlink_connected(self, a: int, b: int) -> bool:
        """Whether slots ``a`` and ``b`` reach each other over at least one active NVLink."""
        if a == b or self.sku.nvlink_links == 0:
            return False
        if self.fabric is Fabric.SWITCH:
            return any(link.active for link in self.links(a)) and any(link.active for link in self.links(b))
        peer_bus = self.slots[b].bus_id
        return any(link.active and link.remote == peer_bus for link in self.links(a))

    def p2p_status(self, a: int, b: int) -> tuple[int, int, int, int, int]:
        """``nvmlDeviceGetP2PStatus`` for caps indices READ, WRITE, NVLINK, ATOMICS, PCI."""
        nvlink = self.nvlink_connected(a, b)
        if a == b:
            pcie = P2P_NOT_SUPPORTED
        elif nvlink or self.sku.pcie_p2p:
            pcie = P2P_OK
        else:
            pcie = P2P_GPU_NOT_SUPPORTED
        return (pcie, pcie, P2P_OK if nvlink else P2P_NOT_SUPPORTED, pcie, pcie)

    def islands(self) -> tuple[frozenset[int], ...]:
        """NVLink islands over NVML indices, as a probe following active links finds them."""
        slots = [g.slot for g in self.enumerated]
        parent = list(range(len(slots)))

        def find(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for i, a in enumerate(slots):
            for j, b in enumerate(slots):
                if i < j and self.nvlink_connected(a, b):
                    parent[find(j)] = find(i)
        groups: dict[int, set[int]] = {}
        for i in range(len(slots)):
            groups.setdefault(find(i), set()).add(i)
        return tuple(frozenset(g) for g in sorted(groups.values(), key=min))

    def host_gpus(self) -> HostGpus:
        """What a correct probe of this host concludes: visible GPUs and NVLink islands."""
        gpus = tuple(
            Gpu(
                index=i,
                name=self.sku.nvml_name,
                memory_total=self.sku.memory_total,
                memory_used=g.baseline_used,
                uuid=g.uuid,
            )
            for i, g in enumerate(self.enumerated)
        )
        return HostGpus(
            gpus=gpus,
            islands=self.islands(),
            source="probe",
            driver_version=self.driver_version,
            sku=self.sku,
        )

    def proc_driver_version_text(self) -> str:
        """The content of ``/proc/driver/nvidia/version`` on this host (the kernel module's view)."""
        return (
            f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {self.kernel_module_version}  {self.build_date}\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1) \n"
        )

    # ---- rendering for the C library ------------------------------------------------------

    def _render_board(self, gpu: SlotGpu) -> list[str]:
        """Board facts from the catalogue and host facts from the profile (one GPU)."""
        sku = self.sku
        out = [
            f"virtualization={1 if self.passthrough else 0}",
            f"irq={self.irqs[gpu.slot]}",
            f"numa_node={self.numa_nodes[gpu.slot]}",
            f"brand={sku.brand}",
            f"conf_compute={1 if sku.architecture >= 9 else 0}",  # confidential computing: Hopper+
        ]
        if sku.board_part_numbers:
            out.append(f"board_part_number={sku.board_part_numbers[0]}")
        if sku.vbios_version:
            out.append(f"vbios={sku.vbios_version}")
        if sku.inforom_image_version:
            out.append(f"inforom={sku.inforom_image_version}")
        if sku.bar1_total:
            # 1.625 MiB of BAR1 mapped at idle (recorded on H100 and H200)
            out.append(f"bar1={sku.bar1_total} {1703936}")
        if sku.clock_graphics_max_mhz:
            out.append(
                f"clocks={sku.clock_graphics_idle_mhz} {sku.clock_graphics_max_mhz} {sku.clock_memory_mhz} "
                f"{sku.clock_video_idle_mhz} {sku.clock_video_max_mhz}"
            )
        if sku.supported_memory_clocks_mhz:
            out.append("mem_clocks=" + " ".join(map(str, sku.supported_memory_clocks_mhz)))
        if sku.cuda_cores:
            out.append(f"cores={sku.cuda_cores}")
        if sku.memory_bus_width:
            out.append(f"bus_width={sku.memory_bus_width}")
        out.append(f"power_min={sku.power_min_mw}")
        if sku.row_remap_banks:
            out.append(f"row_remap_banks={sku.row_remap_banks}")
        return out

    def render(self) -> str:
        """The ``key=value`` file that ``fakenvml.c`` reads (``FLEET_NVML_PROFILE``)."""
        lines = [
            f"# fleet lab NVML profile '{self.name}' rendered from {self.path.name}; do not edit",
            f"driver_version={self.driver_version}",
            f"nvml_version={self.nvml_version}",
            f"cuda_driver_version={self.cuda_driver_version}",
            f"gpu_count={len(self.enumerated)}",
        ]
        if self.driver_branch:
            lines.append(f"driver_branch={self.driver_branch}")
        if self.fail_init_on_mismatch and self.driver_version != self.kernel_module_version:
            lines.append("init_error=18")
        for index, gpu in enumerate(self.enumerated):
            lines.extend(f"gpu.{index}.{line}" for line in self._render_gpu(gpu))
        return "\n".join(lines) + "\n"

    def _render_gpu(self, gpu: SlotGpu) -> list[str]:
        sku = self.sku
        out = [
            f"name={sku.nvml_name}",
            f"uuid={gpu.uuid}",
            f"pci={gpu.bus_id.domain} {gpu.bus_id.bus} {gpu.bus_id.device}",
            f"pci_device_id={sku.pci_device_id:#x}",
            f"pci_subsystem_id={self.pci_subsystem_id:#x}",
            f"minor={gpu.slot}",
            f"arch={sku.architecture}",
            f"cc={sku.compute_capability[0]} {sku.compute_capability[1]}",
            f"memory={sku.memory_total} {self.memory_reserved} {gpu.baseline_used}",
            f"persistence={int(self.persistence)}",
            f"power={sku.power_limit_mw} {sku.power_limit_mw} {self.power_usage_w * 1000}",
            f"temperature={self.temperature_c}",
            f"pcie={gpu.pcie_gen} {sku.pcie_generation} {sku.pcie_generation} {gpu.pcie_width} {sku.pcie_width}",
        ]
        if gpu.serial is not None:
            out.append(f"serial={gpu.serial}")
        # nvmlDeviceGetSupportedEventTypes as recorded on H100/H200 (driver 580), or none at all
        out.append(f"event_types={EVENT_TYPES_RECORDED if self.nvml_events else 0:#x}")
        out.extend(self._render_board(gpu))
        if sku.ecc:
            enabled = int(self.ecc_enabled)
            out.append(f"ecc={enabled} {enabled} " + " ".join(map(str, gpu.ecc_errors)))
            if sku.architecture >= 7:  # Ampere and newer remap rows instead of retiring pages
                out.append("remapped_rows=" + " ".join(map(str, gpu.remapped_rows)))
        if sku.mig:
            out.append(f"mig={int(self.mig_enabled)} {int(self.mig_enabled)}")
        if sku.nvlink_links and self.passthrough:
            out.append(f"nvlink={sku.nvlink_links} {sku.nvlink_version}")
            out.append("nvlink_hidden=1")
        elif sku.nvlink_links:
            out.append(f"nvlink={sku.nvlink_links} {sku.nvlink_version}")
            for i, link in enumerate(self.links(gpu.slot)):
                r = link.remote
                out.append(
                    f"link.{i}={int(link.active)} {link.remote_type} {r.domain} {r.bus} {r.device} "
                    f"{link.remote_device_id:#x}"
                )
        if sku.fabric_info and self.fabric_info is not None:
            f = self.fabric_info
            out.append(f"fabric={f.state} {f.status} {f.clique_id} 0 0 {f.cluster_uuid.hex}")
        if gpu.cpu_affinity:
            out.append("cpu_affinity=" + " ".join(f"{w:#x}" for w in _cpu_mask_words(gpu.cpu_affinity)))
        peers = [g.slot for g in self.enumerated]
        out.append("topo=" + " ".join(str(self.pcie_levels[gpu.slot][p]) for p in peers))
        out.append("p2p=" + " ".join(" ".join(map(str, self.p2p_status(gpu.slot, p))) for p in peers))
        return out


# ---- loading -----------------------------------------------------------------------------------


def list_profiles() -> list[str]:
    """Names of the profiles shipped with fleet (``fleetlab/profiles/*.toml``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def _resolve(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" or "/" in name_or_path:
        if not candidate.is_file():
            raise ValueError(f"{candidate}: lab profile file not found")
        return candidate
    path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(f"unknown lab profile {name_or_path!r}; known: {', '.join(list_profiles())}")
    return path


def load_profile(name_or_path: str) -> LabProfile:
    """Load and validate a profile by shipped name or by file path.

    Raises ``ValueError`` naming the file, the field, the bad value and what is allowed.
    """
    path = _resolve(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    return _build(path, _Fields(path, "", data))


def _build(path: Path, top: _Fields) -> LabProfile:
    sku_key = top.choice("sku", "", sorted(CATALOGUE))
    sku = CATALOGUE[sku_key]
    count = top.int_("count", sku.typical_count, minimum=1)
    missing = frozenset(top.int_list("missing", below=count) or [])
    driver, pcie, nvlink, defaults = (
        top.sub("driver"),
        top.sub("pcie"),
        top.sub("nvlink"),
        top.sub("defaults"),
    )
    version = driver.str_("version")
    host = top.sub("host")
    virtualization = host.choice("virtualization", "none", ("none", "passthrough"))
    fabric = Fabric.NONE if virtualization == "passthrough" else _fabric(nvlink, sku)
    slots = _slots(path, top, pcie, defaults, sku, count)
    return LabProfile(
        name=path.stem,
        path=path,
        description=str(top.table.get("description", "")),
        sku=sku,
        slots=slots,
        missing=missing,
        driver_version=version,
        kernel_module_version=driver.str_("kernel_module", version),
        cuda_driver_version=driver.int_("cuda", minimum=1000),
        build_date=driver.str_("build_date", "Tue Sep 23 09:55:41 UTC 2025"),
        fail_init_on_mismatch=driver.bool_("fail_init_on_mismatch", False),
        pcie_levels=_pcie_levels(pcie, count),
        pci_subsystem_id=pcie.int_("subsystem_id", sku.pci_subsystem_id),
        fabric=fabric,
        switch_bus_ids=_switch_bus_ids(nvlink, fabric),
        links_per_switch=_links_per_switch(nvlink, fabric, sku),
        switch_device_id=nvlink.int_("switch_device_id", 0),
        pairs=_pairs(nvlink, fabric, count),
        fabric_info=_fabric_info(top.sub("fabric")) if sku.fabric_info else None,
        temperature_c=defaults.int_("temperature_c", 33),
        power_usage_w=defaults.int_("power_usage_w", 70),
        persistence=defaults.bool_("persistence", True),
        ecc_enabled=defaults.bool_("ecc", sku.ecc),
        mig_enabled=defaults.bool_("mig", False),
        virtualization=virtualization,
        driver_branch=driver.str_("branch", f"r{version.split('.')[0]}_00"),
        memory_reserved=defaults.int_("reserved_mib", 0) * MiB
        if "reserved_mib" in defaults.table
        else sku.memory_reserved,
        numa_nodes=tuple(pcie.int_list("numa", length=count) or [0] * count),
        irqs=tuple(_irqs(top, count)),
        nvml_events=host.bool_("nvml_events", True),
        switch_groups=tuple(tuple(g) for g in pcie.list_("switch_groups") or []),
        pcie_acs=pcie.choice("acs", "off", ("off", "redirect")),
    )


def _irqs(top: _Fields, count: int) -> list[int]:
    """``nvmlDeviceGetIrqNum`` per slot: ``[[gpu]] irq`` or an interrupt line per slot."""
    overrides = _gpu_overrides(top, count)
    return [overrides[s].int_("irq", 41 + s) if s in overrides else 41 + s for s in range(count)]


def _fabric(nvlink: _Fields, sku: GpuSku) -> Fabric:
    fabric = nvlink.choice("fabric", sku.typical_fabric, tuple(f.value for f in Fabric))
    if fabric != Fabric.NONE and sku.nvlink_links == 0:
        raise nvlink.fail("fabric", fabric, f"'none' ({sku.key} has no NVLink)")
    return Fabric(fabric)


def _switch_bus_ids(nvlink: _Fields, fabric: Fabric) -> tuple[BusId, ...]:
    values = nvlink.list_("switch_bus_ids")
    if fabric is not Fabric.SWITCH:
        return ()
    if not values:
        raise nvlink.fail("switch_bus_ids", values, "a non-empty list of PCI bus ids (switch fabric)")
    return tuple(_bus_id(nvlink, "switch_bus_ids", v) for v in values)


def _links_per_switch(nvlink: _Fields, fabric: Fabric, sku: GpuSku) -> tuple[int, ...]:
    if fabric is not Fabric.SWITCH:
        return ()
    switches = len(nvlink.list_("switch_bus_ids") or [])
    given = nvlink.int_list("links_per_switch", length=switches)
    if given is None:
        base, extra = divmod(sku.nvlink_links, switches)
        given = [base + (1 if i < extra else 0) for i in range(switches)]
    if sum(given) != sku.nvlink_links:
        raise nvlink.fail("links_per_switch", given, f"counts summing to {sku.nvlink_links} ({sku.key} links)")
    return tuple(given)


def _pairs(nvlink: _Fields, fabric: Fabric, count: int) -> tuple[tuple[int, int], ...]:
    values = nvlink.list_("pairs") or []
    if fabric is not Fabric.PAIRS:
        return ()
    seen: set[int] = set()
    pairs = []
    for pair in values:
        ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, int) and 0 <= s < count for s in pair)
        if not ok or pair[0] == pair[1] or seen & set(pair):
            raise nvlink.fail("pairs", values, f"a list of disjoint [a, b] slot pairs, slots < {count}")
        seen.update(pair)
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def _fabric_info(table: _Fields) -> FabricInfo:
    state = table.choice("state", "completed", tuple(FABRIC_STATES))
    raw_uuid = table.str_("cluster_uuid", "00000000-0000-0000-0000-000000000000")
    try:
        cluster = uuid.UUID(raw_uuid)
    except ValueError:
        raise table.fail("cluster_uuid", raw_uuid, "a UUID like 00000000-0000-0000-0000-000000000000") from None
    return FabricInfo(FABRIC_STATES[state], table.int_("status", 0), table.int_("clique_id", 0), cluster)


def _bus_id(table: _Fields, key: str, value: object) -> BusId:
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return BusId.parse(value)
    except ValueError:
        raise table.fail(key, value, "a PCI bus id like '18', '0000:18:00.0' or '00000000:18:00.0'") from None


def _pcie_levels(pcie: _Fields, count: int) -> tuple[tuple[int, ...], ...]:
    """The PCIe common-ancestor level of every slot pair."""
    matrix = pcie.list_("matrix")
    if matrix is not None:
        return _parse_matrix(pcie, matrix, count)
    levels = tuple(TOPOLOGY_LEVELS)[1:]
    numa = pcie.int_list("numa", length=count)
    groups = pcie.list_("switch_groups") or []
    switch_level = TOPOLOGY_LEVELS[pcie.choice("switch_level", "PXB", levels)]
    same = TOPOLOGY_LEVELS[pcie.choice("same_numa_level", "NODE", levels)]
    cross = TOPOLOGY_LEVELS[pcie.choice("cross_numa_level", "SYS", levels)]
    default = TOPOLOGY_LEVELS[pcie.choice("default_level", "PHB", levels)]
    group_of: dict[int, int] = {}
    for g, members in enumerate(groups):
        if not isinstance(members, list) or not all(isinstance(s, int) and 0 <= s < count for s in members):
            raise pcie.fail("switch_groups", groups, f"a list of lists of slots < {count}")
        group_of.update(dict.fromkeys(members, g))

    def level(a: int, b: int) -> int:
        if a == b:
            return 0
        if a in group_of and group_of.get(b) == group_of[a]:
            return switch_level
        if numa is None:
            return default
        return same if numa[a] == numa[b] else cross

    return tuple(tuple(level(a, b) for b in range(count)) for a in range(count))


def _parse_matrix(pcie: _Fields, rows: list[Any], count: int) -> tuple[tuple[int, ...], ...]:
    allowed = f"{count} rows of {count} symbols from {' '.join(TOPOLOGY_LEVELS)}, X on the diagonal, symmetric"
    parsed = []
    for row in rows:
        symbols = row.split() if isinstance(row, str) else []
        if len(symbols) != count or any(s not in TOPOLOGY_LEVELS for s in symbols):
            raise pcie.fail("matrix", row, allowed)
        parsed.append(tuple(TOPOLOGY_LEVELS[s] for s in symbols))
    if len(parsed) != count:
        raise pcie.fail("matrix", rows, allowed)
    for a in range(count):
        for b in range(count):
            if parsed[a][b] != parsed[b][a] or (parsed[a][b] == 0) != (a == b):
                raise pcie.fail("matrix", rows[a], allowed)
    return tuple(parsed)


def _slots(path: Path, top: _Fields, pcie: _Fields, defaults: _Fields, sku: GpuSku, count: int) -> tuple[SlotGpu, ...]:
    bus_values = pcie.list_("bus_ids")
    if bus_values is None:
        bus_values = [f"{0x10 * (i + 1):02x}" for i in range(count)]
    if len(bus_values) != count:
        raise pcie.fail("bus_ids", bus_values, f"{count} PCI bus ids (one per GPU)")
    affinity = pcie.list_("cpu_affinity") or [""] * count
    if len(affinity) != count:
        raise pcie.fail("cpu_affinity", affinity, f"{count} cpulists (one per GPU)")
    overrides = _gpu_overrides(top, count)
    baseline = defaults.int_("baseline_used_mib", 0)
    slots = []
    for slot in range(count):
        o = overrides.get(slot, _Fields(path, f"gpu[slot={slot}].", {}))
        serial = _serial(path, slot) if sku.has_serial else None
        if "serial" in o.table:
            serial = o.str_("serial")
        ecc = o.sub("ecc_errors")
        remap = o.sub("remapped_rows")
        slots.append(
            SlotGpu(
                slot=slot,
                bus_id=_bus_id(o, "bus_id", o.table["bus_id"])
                if "bus_id" in o.table
                else _bus_id(pcie, "bus_ids", bus_values[slot]),
                uuid=o.str_("uuid", _uuid(path, slot)),
                serial=serial,
                baseline_used=o.int_("baseline_used_mib", baseline) * MiB,
                pcie_gen=o.int_("pcie_gen", sku.pcie_generation, minimum=1),
                pcie_width=o.int_("pcie_width", sku.pcie_width, minimum=1),
                ecc_errors=(
                    ecc.int_(ECC_COUNTERS[0], 0),
                    ecc.int_(ECC_COUNTERS[1], 0),
                    ecc.int_(ECC_COUNTERS[2], 0),
                    ecc.int_(ECC_COUNTERS[3], 0),
                ),
                remapped_rows=(
                    remap.int_("correctable", 0),
                    remap.int_("uncorrectable", 0),
                    int(remap.bool_("pending", False)),
                    int(remap.bool_("failure", False)),
                ),
                links_down=frozenset(o.int_list("links_down", below=max(sku.nvlink_links, 1)) or []),
                cpu_affinity=_cpulist(pcie, affinity[slot]),
            )
        )
    return tuple(slots)


def _gpu_overrides(top: _Fields, count: int) -> dict[int, _Fields]:
    entries = top.list_("gpu") or []
    result: dict[int, _Fields] = {}
    for n, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise top.fail(f"gpu[{n}]", entry, "a table")
        fields = _Fields(top.path, f"gpu[{n}].", entry)
        slot = fields.int_("slot")
        if slot >= count or slot in result:
            raise fields.fail("slot", slot, f"a distinct slot number < {count}")
        result[slot] = fields
    return result


def _cpulist(table: _Fields, text: object) -> tuple[int, ...]:
    """Parse a Linux cpulist (``"0-47,96-143"``)."""
    if not isinstance(text, str):
        raise table.fail("cpu_affinity", text, "cpulist strings like '0-47,96-143'")
    cpus: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise table.fail("cpu_affinity", text, "cpulist strings like '0-47,96-143'") from None
    return tuple(cpus)


def _cpu_mask_words(cpus: Sequence[int]) -> list[int]:
    words = [0] * (max(cpus) // 64 + 1)
    for cpu in cpus:
        words[cpu // 64] |= 1 << (cpu % 64)
    return words


def _uuid(path: Path, slot: int) -> str:
    """A stable per-profile, per-slot GPU UUID (the same on every render)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{path.stem}/{slot}')}"


def _serial(path: Path, slot: int) -> str:
    """A stable 13-digit board serial, the shape NVML reports for boards with an inforom."""
    digest = int(hashlib.sha256(f"{path.stem}/{slot}".encode()).hexdigest(), 16)
    return f"1{digest % 10**12:012d}"


__all__ = [
    "PROFILE_DIR",
    "TOPOLOGY_LEVELS",
    "BusId",
    "FabricInfo",
    "LabProfile",
    "Link",
    "SlotGpu",
    "list_profiles",
    "load_profile",
]
