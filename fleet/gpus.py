"""The GPU catalogue and the typed GPU facts of a host.

The catalogue is the one source of truth for what a GPU model looks like: the planner sizes
memory from it when no probe is available, the lab's simulated GPUs are built from it, and the
audit checks real hosts against it. Values are public facts: NVIDIA datasheets, public
``nvidia-smi`` outputs, and what a real driver answered on an H100 and an H200 (kept in
``tests/fixtures/gpu-truth/``). Memory totals are what NVML reports
(``nvmlDeviceGetMemoryInfo().total``), a little less than the marketing size.

``HostGpus`` is what the planner consumes. The NVML probe fills it from a live host; until
then it is built from the catalogue (``HostGpus.from_catalogue``) or from inventory data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

MiB = 1024**2
GiB = 1024**3

#: The reserve assumed for a SKU nobody has measured yet: above both measured values (480 MiB on
#: H100 80GB, 615 MiB on H200, driver 580), so a plan under-promises rather than over-promises.
ESTIMATED_RESERVE = 640 * MiB


class Fabric(StrEnum):
    """How the GPUs of a host are wired together by NVLink (the one spelling, everywhere)."""

    SWITCH = "switch"  #: every GPU reaches every other through NVSwitch (HGX/DGX boards)
    PAIRS = "pairs"  #: NVLink bridges join GPUs two by two (PCIe cards with bridges)
    NONE = "none"  #: PCIe only


#: ``nvmlBrandType_t`` values of data-centre boards: ``NVML_BRAND_TESLA`` 2, ``NVML_BRAND_NVIDIA`` 14.
DATA_CENTRE_BRANDS = frozenset({2, 14})


@dataclass(frozen=True)
class GpuSku:
    """One GPU model as NVML describes it."""

    key: str  #: short catalogue name used in inventories and lab profiles
    nvml_name: str  #: ``nvmlDeviceGetName``
    memory_total: int  #: bytes, ``nvmlDeviceGetMemoryInfo().total``
    compute_capability: tuple[int, int]
    architecture: int  #: ``nvmlDeviceGetArchitecture`` enum (7 Ampere, 8 Ada, 9 Hopper)
    pci_device_id: int  #: ``nvmlPciInfo_t.pciDeviceId`` (device << 16 | vendor 0x10DE)
    power_limit_mw: int
    pcie_generation: int
    pcie_width: int
    nvlink_links: int  #: links per GPU (0: no NVLink)
    nvlink_version: int  #: ``nvmlNvlinkVersion_t`` enum (4 = NVLink 3.0, 6 = NVLink 4.0)
    ecc: bool  #: ECC supported (``nvmlDeviceGetEccMode`` does not raise NOT_SUPPORTED)
    mig: bool  #: MIG capable
    has_serial: bool  #: boards with an inforom report a serial; consumer boards do not
    fabric_info: bool  #: ``nvmlDeviceGetGpuFabricInfoV`` supported (Hopper+ SXM)
    typical_count: int  #: GPUs in the usual host built around this model
    typical_fabric: Fabric
    #: peer-to-peer over PCIe allowed (``nvmlDeviceGetP2PStatus``); GeForce boards report
    #: ``NVML_P2P_STATUS_GPU_NOT_SUPPORTED`` (``GNS`` in ``nvidia-smi topo -p2p``)
    pcie_p2p: bool = True
    #: bytes the driver reserves (NVML v2 ``reserved``); CUDA's total (``cudaMemGetInfo``, what
    #: vLLM multiplies by ``--gpu-memory-utilization``) is ``memory_total - memory_reserved``
    memory_reserved: int = ESTIMATED_RESERVE
    #: True where ``memory_reserved`` was read from a real driver; False: a conservative estimate
    reserve_measured: bool = False
    #: ``nvmlDeviceGetBoardPartNumber`` values seen on real boards of this model
    board_part_numbers: tuple[str, ...] = ()
    # ---- board facts the simulated NVML answers (added after the fields above; keep order) ----
    #: ``nvmlDeviceGetBAR1MemoryInfo().bar1Total``, bytes (0: not known)
    bar1_total: int = 0
    #: ``nvmlDeviceGetClockInfo``/``MaxClockInfo``, MHz: graphics (= SM) at idle and at most,
    #: memory (HBM/GDDR runs at its max), video at idle and at most (0: not known)
    clock_graphics_idle_mhz: int = 0
    clock_graphics_max_mhz: int = 0
    clock_memory_mhz: int = 0
    clock_video_idle_mhz: int = 0
    clock_video_max_mhz: int = 0
    #: ``nvmlDeviceGetSupportedMemoryClocks``, highest first
    supported_memory_clocks_mhz: tuple[int, ...] = ()
    #: ``nvmlDeviceGetVbiosVersion`` / ``nvmlDeviceGetInforomImageVersion`` of a board seen in the
    #: field ("": not recorded; the simulated library then answers NOT_SUPPORTED)
    vbios_version: str = ""
    inforom_image_version: str = ""
    #: ``nvmlDeviceGetNumGpuCores`` (CUDA cores) and ``nvmlDeviceGetMemoryBusWidth`` (bits)
    cuda_cores: int = 0
    memory_bus_width: int = 0
    #: ``nvmlDeviceGetPowerManagementLimitConstraints`` minimum, mW (the maximum is power_limit_mw)
    power_min_mw: int = 0
    #: ``nvmlDeviceGetBrand``: 14 NVML_BRAND_NVIDIA (data centre), 13 NVIDIA_RTX, 5 GEFORCE
    brand: int = 14
    #: ``nvmlDeviceGetRowRemapperHistogram().max`` on a healthy board (banks with every spare row)
    row_remap_banks: int = 0
    #: ``nvmlDeviceGetPciInfo().pciSubSystemId`` of the usual board (0: not known)
    pci_subsystem_id: int = 0

    @property
    def cuda_total(self) -> int:
        """The memory CUDA reports as total: NVML's total minus the driver's reserve."""
        return self.memory_total - self.memory_reserved

    @property
    def forward_compatible(self) -> bool:
        """CUDA forward compatibility (the ``cuda-compat-X-Y`` package) works on this board: NVIDIA's
        "CUDA Compatibility" guide, "Forward Compatibility": "applicable only for systems with NVIDIA
        Data Center GPUs" (and select NGC Server Ready RTX SKUs, which fleet does not tell apart);
        NVML's brand ``NVIDIA`` (14, data centre) or ``TESLA`` (2), never GeForce or (Quadro) RTX."""
        return self.brand in DATA_CENTRE_BRANDS

    @property
    def memory_gib(self) -> float:
        return self.memory_total / GiB


CATALOGUE: dict[str, GpuSku] = {
    sku.key: sku
    for sku in (
        GpuSku(
            key="h100-sxm-80gb",
            # recorded (driver 580.159.04, tests/fixtures/gpu-truth/h100-80gb-hbm3)
            bar1_total=128 * GiB,
            clock_graphics_idle_mhz=345,
            clock_graphics_max_mhz=1980,
            clock_memory_mhz=2619,
            clock_video_idle_mhz=765,
            clock_video_max_mhz=1545,
            supported_memory_clocks_mhz=(2619, 1593),
            vbios_version="96.00.DA.00.0C",
            inforom_image_version="G520.0200.00.05",
            cuda_cores=16896,
            memory_bus_width=5120,
            power_min_mw=200_000,
            row_remap_banks=2560,
            pci_subsystem_id=0x16C110DE,
            nvml_name="NVIDIA H100 80GB HBM3",
            memory_total=81559 * MiB,
            compute_capability=(9, 0),
            architecture=9,
            pci_device_id=0x233010DE,
            power_limit_mw=700_000,
            pcie_generation=5,
            pcie_width=16,
            nvlink_links=18,
            nvlink_version=6,
            ecc=True,
            mig=True,
            has_serial=True,
            fabric_info=True,
            typical_count=8,
            typical_fabric=Fabric.SWITCH,
            memory_reserved=480 * MiB,
            reserve_measured=True,
            # -000: tests/fixtures/gpu-truth; -5R0: another board of the same SKU (VBIOS 96.00.CF.00.01),
            # recorded by fleet's probe (tests/fixtures/probe/h100-80gb-hbm3-vm-carried.json)
            board_part_numbers=("692-2G520-0200-000", "692-2G520-0200-5R0"),
        ),
        GpuSku(
            key="h100-pcie-80gb",
            # NVIDIA H100 PCIe product brief (boost 1755 MHz, HBM2e 5120-bit, 14592 cores);
            # BAR1 and clock floor as on the SXM board [estimate]
            bar1_total=128 * GiB,
            clock_graphics_idle_mhz=345,
            clock_graphics_max_mhz=1755,
            clock_memory_mhz=1593,
            clock_video_idle_mhz=765,
            clock_video_max_mhz=1545,
            supported_memory_clocks_mhz=(1593,),
            cuda_cores=14592,
            memory_bus_width=5120,
            power_min_mw=200_000,
            nvml_name="NVIDIA H100 PCIe",
            memory_total=81559 * MiB,
            compute_capability=(9, 0),
            architecture=9,
            pci_device_id=0x233110DE,
            power_limit_mw=350_000,
            pcie_generation=5,
            pcie_width=16,
            nvlink_links=12,
            nvlink_version=6,
            ecc=True,
            mig=True,
            has_serial=True,
            fabric_info=False,
            typical_count=8,
            typical_fabric=Fabric.PAIRS,
        ),
        GpuSku(
            key="h200-sxm-141gb",
            # recorded (driver 580.159.04, tests/fixtures/gpu-truth/h200-141gb)
            bar1_total=256 * GiB,
            clock_graphics_idle_mhz=345,
            clock_graphics_max_mhz=1980,
            clock_memory_mhz=3201,
            clock_video_idle_mhz=765,
            clock_video_max_mhz=1545,
            supported_memory_clocks_mhz=(3201, 2201),
            vbios_version="96.00.A5.00.1A",
            inforom_image_version="G520.0282.02.02",
            cuda_cores=16896,
            memory_bus_width=6016,
            power_min_mw=200_000,
            row_remap_banks=3072,
            pci_subsystem_id=0x18BF10DE,
            memory_reserved=644_939_776,  # 615 MiB + 64 KiB, measured (NVML v2 reserved, driver 580)
            reserve_measured=True,
            board_part_numbers=("692-2G520-0282-000",),
            nvml_name="NVIDIA H200",
            memory_total=143771 * MiB,
            compute_capability=(9, 0),
            architecture=9,
            pci_device_id=0x233510DE,
            power_limit_mw=700_000,
            pcie_generation=5,
            pcie_width=16,
            nvlink_links=18,
            nvlink_version=6,
            ecc=True,
            mig=True,
            has_serial=True,
            fabric_info=True,
            typical_count=8,
            typical_fabric=Fabric.SWITCH,
        ),
        GpuSku(
            key="a100-sxm-80gb",
            # NVIDIA A100 datasheet (boost 1410 MHz, HBM2e 1593 MHz x 5120-bit, 6912 cores);
            # nvidia-smi -q on DGX A100: BAR1 131072 MiB, idle 210 MHz [public outputs]
            bar1_total=128 * GiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=1410,
            clock_memory_mhz=1593,
            clock_video_idle_mhz=585,
            clock_video_max_mhz=1290,
            supported_memory_clocks_mhz=(1593,),
            cuda_cores=6912,
            memory_bus_width=5120,
            power_min_mw=100_000,
            nvml_name="NVIDIA A100-SXM4-80GB",
            memory_total=81920 * MiB,
            compute_capability=(8, 0),
            architecture=7,
            pci_device_id=0x20B210DE,
            power_limit_mw=400_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=12,
            nvlink_version=4,
            ecc=True,
            mig=True,
            has_serial=True,
            fabric_info=False,
            typical_count=8,
            typical_fabric=Fabric.SWITCH,
        ),
        GpuSku(
            key="a100-sxm-40gb",
            # NVIDIA A100 datasheet (boost 1410 MHz, HBM2 1215 MHz x 5120-bit, 6912 cores)
            bar1_total=64 * GiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=1410,
            clock_memory_mhz=1215,
            clock_video_idle_mhz=585,
            clock_video_max_mhz=1290,
            supported_memory_clocks_mhz=(1215,),
            cuda_cores=6912,
            memory_bus_width=5120,
            power_min_mw=100_000,
            nvml_name="NVIDIA A100-SXM4-40GB",
            memory_total=40960 * MiB,
            compute_capability=(8, 0),
            architecture=7,
            pci_device_id=0x20B010DE,
            power_limit_mw=400_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=12,
            nvlink_version=4,
            ecc=True,
            mig=True,
            has_serial=True,
            fabric_info=False,
            typical_count=8,
            typical_fabric=Fabric.SWITCH,
        ),
        GpuSku(
            key="l40s-48gb",
            # NVIDIA L40S datasheet (boost 2520 MHz, GDDR6 384-bit, 18176 cores); BAR1 64 GiB [estimate]
            bar1_total=64 * GiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=2520,
            clock_memory_mhz=9001,
            clock_video_idle_mhz=1185,
            clock_video_max_mhz=1965,
            supported_memory_clocks_mhz=(9001, 5001, 810, 405),
            cuda_cores=18176,
            memory_bus_width=384,
            power_min_mw=100_000,
            nvml_name="NVIDIA L40S",
            memory_total=46068 * MiB,
            compute_capability=(8, 9),
            architecture=8,
            pci_device_id=0x26B910DE,
            power_limit_mw=350_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=0,
            nvlink_version=0,
            ecc=True,
            mig=False,
            has_serial=True,
            fabric_info=False,
            typical_count=4,
            typical_fabric=Fabric.NONE,
        ),
        GpuSku(
            key="rtx-a6000-48gb",
            # NVIDIA RTX A6000 datasheet (boost 1800 MHz, GDDR6 384-bit, 10752 cores); BAR1 256 MiB
            # without resizable BAR [estimate]
            bar1_total=256 * MiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=2100,
            clock_memory_mhz=8001,
            clock_video_idle_mhz=555,
            clock_video_max_mhz=1950,
            supported_memory_clocks_mhz=(8001, 5001, 810, 405),
            cuda_cores=10752,
            memory_bus_width=384,
            power_min_mw=100_000,
            brand=13,
            nvml_name="NVIDIA RTX A6000",
            memory_total=49140 * MiB,
            compute_capability=(8, 6),
            architecture=7,
            pci_device_id=0x223010DE,
            power_limit_mw=300_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=4,
            nvlink_version=4,
            ecc=True,
            mig=False,
            has_serial=True,
            fabric_info=False,
            typical_count=2,
            typical_fabric=Fabric.PAIRS,
        ),
        GpuSku(
            key="a10-24gb",
            # NVIDIA A10 datasheet (boost 1695 MHz, GDDR6 384-bit, 9216 cores); BAR1 32 GiB [public outputs]
            bar1_total=32 * GiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=1695,
            clock_memory_mhz=6251,
            clock_video_idle_mhz=555,
            clock_video_max_mhz=1470,
            supported_memory_clocks_mhz=(6251, 5001, 810, 405),
            cuda_cores=9216,
            memory_bus_width=384,
            power_min_mw=100_000,
            nvml_name="NVIDIA A10",
            memory_total=23028 * MiB,
            compute_capability=(8, 6),
            architecture=7,
            pci_device_id=0x223610DE,
            power_limit_mw=150_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=0,
            nvlink_version=0,
            ecc=True,
            mig=False,
            has_serial=True,
            fabric_info=False,
            typical_count=1,
            typical_fabric=Fabric.NONE,
        ),
        GpuSku(
            key="rtx-4090-24gb",
            # GeForce RTX 4090 specifications (boost 2520 MHz, max 3120, GDDR6X 384-bit, 16384 cores);
            # BAR1 256 MiB without resizable BAR [estimate]; GeForce: no inforom, no part number
            bar1_total=256 * MiB,
            clock_graphics_idle_mhz=210,
            clock_graphics_max_mhz=3120,
            clock_memory_mhz=10501,
            clock_video_idle_mhz=1185,
            clock_video_max_mhz=2415,
            supported_memory_clocks_mhz=(10501, 10251, 5001, 810, 405),
            cuda_cores=16384,
            memory_bus_width=384,
            power_min_mw=150_000,
            brand=5,
            nvml_name="NVIDIA GeForce RTX 4090",
            memory_total=24564 * MiB,
            compute_capability=(8, 9),
            architecture=8,
            pci_device_id=0x268410DE,
            power_limit_mw=450_000,
            pcie_generation=4,
            pcie_width=16,
            nvlink_links=0,
            nvlink_version=0,
            ecc=False,
            mig=False,
            has_serial=False,
            fabric_info=False,
            typical_count=2,
            typical_fabric=Fabric.NONE,
            pcie_p2p=False,
        ),
    )
}


def sku_for(key_or_name: str) -> GpuSku:
    """Find a catalogue entry by its key or by the name NVML reports.

    Raises ``KeyError`` with the list of known keys, so callers can show it.
    """
    if key_or_name in CATALOGUE:
        return CATALOGUE[key_or_name]
    for sku in CATALOGUE.values():
        if sku.nvml_name == key_or_name:
            return sku
    raise KeyError(key_or_name)


def nvlink_islands(count: int, fabric: Fabric) -> tuple[frozenset[int], ...]:
    """The groups of GPU indices that NVLink joins, for a regular layout.

    ``switch`` gives one island of all GPUs, ``pairs`` gives (0,1), (2,3), ..., ``none`` gives
    one island per GPU. A probe replaces this with what the links really show.
    """
    fabric = Fabric(fabric)
    if fabric is Fabric.SWITCH:
        return (frozenset(range(count)),)
    if fabric is Fabric.PAIRS:
        islands = [frozenset({i, i + 1}) for i in range(0, count - 1, 2)]
        if count % 2:
            islands.append(frozenset({count - 1}))
        return tuple(islands)
    return tuple(frozenset({i}) for i in range(count))


@dataclass(frozen=True)
class Gpu:
    """One GPU of a host as the planner sees it."""

    index: int  #: NVML index (the lab and our units use it for CUDA_VISIBLE_DEVICES)
    name: str
    memory_total: int  #: bytes
    memory_used: int = 0  #: bytes already in use by something else (from a probe)
    uuid: str = ""
    #: the driver's reserve a probe read (NVML v2 ``reserved``); None: use the catalogue's
    memory_reserved: int | None = None
    #: ``nvmlDeviceGetCudaComputeCapability`` (major, minor); None: not known
    compute_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class HostGpus:
    """The GPUs of one host and how NVLink joins them.

    ``islands`` partitions the GPU indices: GPUs in one island reach each other over NVLink;
    tensor parallelism must stay inside one island.
    """

    gpus: tuple[Gpu, ...]
    islands: tuple[frozenset[int], ...]
    source: str  #: where these facts came from: "probe", "catalogue:<key>", "inventory"
    driver_version: str = ""
    sku: GpuSku | None = field(default=None, compare=False)
    #: ``nvmlSystemGetCudaDriverVersion`` of a probed host (``13000``: CUDA 13.0); None: not known
    cuda_driver_version: int | None = None

    @classmethod
    def from_catalogue(cls, key: str, count: int | None = None, fabric: Fabric | None = None) -> HostGpus:
        sku = sku_for(key)
        n = count if count is not None else sku.typical_count
        fab: Fabric = fabric if fabric is not None else sku.typical_fabric
        if sku.nvlink_links == 0:
            fab = Fabric.NONE
        gpus = tuple(
            Gpu(index=i, name=sku.nvml_name, memory_total=sku.memory_total, compute_capability=sku.compute_capability)
            for i in range(n)
        )
        return cls(gpus=gpus, islands=nvlink_islands(n, fab), source=f"catalogue:{sku.key}", sku=sku)

    @classmethod
    def uniform(cls, count: int, memory_total: int, fabric: Fabric, name: str = "GPU") -> HostGpus:
        """A host described only by inventory numbers: N GPUs of one size joined by ``fabric``."""
        gpus = tuple(Gpu(index=i, name=name, memory_total=memory_total) for i in range(count))
        return cls(gpus=gpus, islands=nvlink_islands(count, fabric), source="inventory")

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def usable(self) -> frozenset[int]:
        """The GPUs the planner may place instances on: those in an island (a quarantined GPU is
        left out of every island, ``fleet.gpuwatch.quarantine.usable_gpus``; indices keep their
        meaning)."""
        return frozenset().union(*self.islands)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability of the host's GPUs (what a kernel choice must fit), else
        its catalogue model's; None: not known (GPUs declared only by memory size)."""
        known = [g.compute_capability for g in self.gpus if g.compute_capability is not None]
        if self.gpus and len(known) == len(self.gpus):
            return min(known)
        return self.sku.compute_capability if self.sku is not None else None

    def island_of(self, index: int) -> frozenset[int]:
        for island in self.islands:
            if index in island:
                return island
        return frozenset({index})
