"""``HostFacts``: the typed, validated result of the NVML probe (``fleet/facts/nvml_probe.py``).

The probe's JSON comes from a host, so it is input like an inventory: every field is checked for
its type and range where it enters, and anything else is a ``ProbeOutputError`` naming the field
and the value. Optional answers (``None``) are those NVML refused; why is in ``errors``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from fleet.errors import FleetError
from fleet.facts.output import answer_line

SCHEMA = 1
STATUSES = (
    "ok",
    "no-python",
    "no-pynvml",
    "python-too-old",
    "no-nvml-library",
    "driver-not-loaded",
    "lib-rm-version-mismatch",
    "no-gpus",
    "no-permission",
    "nvml-error",
    "probe-crashed",
)
#: nvml.h ``nvmlGpuVirtualizationMode_t``
VIRT_NONE, VIRT_PASSTHROUGH, VIRT_VGPU, VIRT_HOST_VGPU, VIRT_HOST_VSGA = 0, 1, 2, 3, 4
#: nvml.h ``nvmlNvLinkDeviceType_t``
REMOTE_GPU, REMOTE_IBMNPU, REMOTE_SWITCH = 0, 1, 2
#: nvml.h ``nvmlGpuFabricState_t``
FABRIC_NOT_SUPPORTED, FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 0, 1, 2, 3
_BUS_RE = re.compile(r"^[0-9A-F]{4,8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")
_ERROR_RE = re.compile(r"^[A-Za-z0-9_:().-]{1,80}$")


_CUDA = re.compile(r"^\d{1,2}\.\d{1,2}$")


class ProbeOutputError(FleetError):
    """The probe's output is not what this version of fleet understands."""


class _In:
    """Typed access to one JSON object, raising ``ProbeOutputError`` with the field's path."""

    def __init__(self, path: str, raw: object) -> None:
        if not isinstance(raw, Mapping):
            raise ProbeOutputError(f"probe output field {path or '<top>'}: expected an object, got {_short(raw)}")
        self.path, self.raw = path, raw

    def _fail(self, key: str, value: object, expected: str) -> ProbeOutputError:
        return ProbeOutputError(f"probe output field {self.path}{key} = {_short(value)}: expected {expected}")

    def int_(self, key: str, low: int = 0, high: int = 2**64, optional: bool = True) -> int | None:
        value = self.raw.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._fail(key, value, f"an integer from {low} to {high}")
        return value

    def req_int(self, key: str, low: int = 0, high: int = 2**64) -> int:
        value = self.int_(key, low, high, optional=False)
        assert value is not None
        return value

    def str_(self, key: str, max_len: int = 300, pattern: re.Pattern[str] | None = None) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or len(value) > max_len or (pattern is not None and not pattern.match(value)):
            raise self._fail(
                key, value, f"a string of at most {max_len} characters" + (" in the right form" if pattern else "")
            )
        return value

    def bool_(self, key: str) -> bool:
        value = self.raw.get(key)
        if not isinstance(value, bool):
            raise self._fail(key, value, "true or false")
        return value

    def ints(self, key: str, length: int | None = None) -> tuple[int, ...] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok or (length is not None and len(value) != length):
            raise self._fail(key, value, "a list of integers" + (f" with {length} entries" if length else ""))
        return tuple(value)

    def obj(self, key: str) -> _In | None:
        value = self.raw.get(key)
        return None if value is None else _In(f"{self.path}{key}.", value)

    def list_(self, key: str) -> list[_In] | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._fail(key, value, "a list")
        return [_In(f"{self.path}{key}[{i}].", v) for i, v in enumerate(value)]

    def errors(self, key: str) -> dict[str, str]:
        value = self.raw.get(key) or {}
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and len(k) < 100 and isinstance(v, str) and _ERROR_RE.match(v) for k, v in value.items()
        ):
            raise self._fail(key, value, "an object of query -> error class")
        return dict(value)

    def matrix(self, key: str, n: int) -> tuple[tuple[int | None, ...], ...]:
        value = self.raw.get(key)
        if value is None:
            return tuple(tuple(None for _ in range(n)) for _ in range(n))
        ok = (
            isinstance(value, list)
            and len(value) == n
            and all(
                isinstance(row, list)
                and len(row) == n
                and all(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000) for v in row)
                for row in value
            )
        )
        if not ok:
            raise self._fail(key, value, f"a {n}x{n} matrix of small integers or null")
        return tuple(tuple(row) for row in value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Memory:
    """NVML v2 memory info (bytes): ``reserved`` is the driver's, ``used`` excludes it."""

    total: int
    reserved: int
    used: int
    free: int


@dataclass(frozen=True)
class Pcie:
    gen: int | None
    max_gen: int | None  #: what this GPU can reach in this system (GPU and slot)
    gpu_max_gen: int | None  #: what the GPU itself supports
    width: int | None
    max_width: int | None
    replay_counter: int | None


@dataclass(frozen=True)
class EccErrors:
    corrected_volatile: int | None
    uncorrected_volatile: int | None
    corrected_aggregate: int | None
    uncorrected_aggregate: int | None


@dataclass(frozen=True)
class RetiredPages:
    sbe: int | None
    dbe: int | None
    pending: int | None


@dataclass(frozen=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class NvLink:
    link: int
    active: bool
    version: int | None
    remote_type: int | None
    remote_bus_id: str | None


@dataclass(frozen=True)
class Fabric:
    state: int
    status: int
    clique_id: int
    cluster_uuid: str


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory: int | None
    comm: str | None
    unit: str | None


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as NVML answered for it."""

    index: int
    name: str | None
    board_part_number: str | None
    uuid: str | None
    serial: str | None
    vbios: str | None
    inforom: str | None
    bus_id: str | None
    pci_device_id: int | None
    architecture: int | None
    compute_capability: tuple[int, ...] | None
    memory: Memory | None
    ecc_mode: tuple[int, ...] | None
    ecc_errors: EccErrors | None
    remapped_rows: RemappedRows | None
    retired_pages: RetiredPages | None
    persistence: int | None
    mig_mode: tuple[int, ...] | None
    power_limit_mw: int | None
    power_usage_mw: int | None
    temperature_c: int | None
    clocks: dict[str, int | None]
    clock_event_reasons: int | None
    utilization_gpu: int | None
    pcie: Pcie
    virtualization_mode: int | None
    nvlinks: tuple[NvLink, ...]
    fabric: Fabric | None
    processes: tuple[GpuProcess, ...] | None
    errors: dict[str, str] = field(default_factory=dict)  #: this GPU's failed queries

    @property
    def active_links(self) -> tuple[NvLink, ...]:
        return tuple(link for link in self.nvlinks if link.active)

    @property
    def nvlink_error(self) -> str | None:
        """The error that ended the NVLink walk at link 0 (no link visible at all), if any."""
        return None if self.nvlinks else self.errors.get("nvlink.0.state")


@dataclass(frozen=True)
class HostFacts:
    """Everything the probe found on one host."""

    status: str
    error_class: str | None
    error_message: str | None
    python: str | None
    packages: dict[str, str | None]
    kernel_module_version: str | None  #: from /proc/driver/nvidia/version; None: module not loaded
    pci_gpus: int | None  #: NVIDIA GPUs on the PCI bus (sysfs)
    driver_version: str | None
    nvml_version: str | None
    cuda_driver_version: int | None
    gpu_count: int | None
    gpus: tuple[GpuFacts, ...]
    common_ancestor: tuple[tuple[int | None, ...], ...]
    p2p_nvlink: tuple[tuple[int | None, ...], ...]
    p2p_read: tuple[tuple[int | None, ...], ...]
    errors: dict[str, str]  #: system-level and pair queries that failed
    #: which pynvml answered: ``fleet:nvidia-ml-py==<version>/pynvml.py`` (the copy the probe carries,
    #: ``fleet.facts.nvml``) or a file of the host's Python; None before it was imported
    pynvml: str | None = None
    #: ``X.Y`` of each installed ``/usr/local/cuda-X.Y/compat/libcuda.so.1`` (cuda-compat-X-Y)
    cuda_compat: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def all_errors(self) -> dict[str, str]:
        """Every failed query of the host, GPU ones prefixed ``gpu<i>.``."""
        out = dict(self.errors)
        for g in self.gpus:
            out.update({f"gpu{g.index}.{k}": v for k, v in g.errors.items()})
        return out

    @property
    def passthrough(self) -> bool:
        return any(g.virtualization_mode == VIRT_PASSTHROUGH for g in self.gpus)


# ---- parsing ------------------------------------------------------------------------------------


def parse_probe_output(lines: Sequence[str]) -> HostFacts:
    """Parse the probe's stdout (its JSON is the last non-empty line) into validated ``HostFacts``."""
    text = answer_line(lines)
    if not text:
        raise ProbeOutputError("the probe printed nothing (is python3 on the host's PATH?)")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProbeOutputError(f"the probe's last line is not JSON ({exc}): {_short(text)}") from None
    return parse_probe(raw)


def parse_probe(raw: object) -> HostFacts:
    top = _In("", raw)
    schema = top.int_("schema")
    if schema != SCHEMA:
        raise ProbeOutputError(f"probe output schema {schema!r}: this fleet reads schema {SCHEMA}")
    status = top.str_("status")
    if status not in STATUSES:
        raise ProbeOutputError(f"probe output field status = {_short(status)}: expected one of {', '.join(STATUSES)}")
    error = top.obj("error")
    kernel = top.obj("kernel_module")
    packages_raw = top.raw.get("packages") or {}
    if not isinstance(packages_raw, Mapping) or not all(
        isinstance(k, str) and (v is None or (isinstance(v, str) and len(v) < 100)) for k, v in packages_raw.items()
    ):
        raise ProbeOutputError(f"probe output field packages = {_short(packages_raw)}: expected name -> version")
    gpus = tuple(_gpu(g) for g in top.list_("gpus") or [])
    n = len(gpus)
    topo = top.obj("topology") or _In("topology.", {})
    facts = HostFacts(
        status=status,
        error_class=error.str_("class", 100) if error else None,
        error_message=error.str_("message", 400) if error else None,
        python=top.str_("python", 400),
        packages=dict(packages_raw),
        kernel_module_version=kernel.str_("version", 40) if kernel else None,
        pci_gpus=top.int_("pci_gpus", 0, 1024),
        driver_version=top.str_("driver_version", 40),
        nvml_version=top.str_("nvml_version", 40),
        cuda_driver_version=top.int_("cuda_driver_version", 0, 1_000_000),
        gpu_count=top.int_("gpu_count", 0, 1024),
        gpus=gpus,
        common_ancestor=topo.matrix("common_ancestor", n),
        p2p_nvlink=topo.matrix("p2p_nvlink", n),
        p2p_read=topo.matrix("p2p_read", n),
        errors=top.errors("errors"),
        pynvml=top.str_("pynvml", 300),
        cuda_compat=_cuda_compat(top.raw.get("cuda_compat")),
    )
    return attach_gpu_errors(facts)


def _cuda_compat(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > 16 or not all(isinstance(v, str) and _CUDA.match(v) for v in value):
        raise ProbeOutputError(f"probe output field cuda_compat = {_short(value)}: expected a list of CUDA X.Y")
    return tuple(value)


def _gpu(g: _In) -> GpuFacts:
    index = g.req_int("index", 0, 1023)
    mem = g.obj("memory")
    ecc = g.obj("ecc_errors")
    retired = g.obj("retired_pages")
    pcie = g.obj("pcie") or _In(f"{g.path}pcie.", {})
    fabric = g.obj("fabric")
    rows = g.ints("remapped_rows", 4)
    clocks = g.obj("clocks") or _In(f"{g.path}clocks.", {})
    links = g.list_("nvlinks") or []
    procs = g.list_("processes")
    return GpuFacts(
        index=index,
        name=g.str_("name", 96),
        board_part_number=g.str_("board_part_number", 80),
        uuid=g.str_("uuid", 96),
        serial=g.str_("serial", 80),
        vbios=g.str_("vbios", 80),
        inforom=g.str_("inforom", 80),
        bus_id=g.str_("bus_id", 16, _BUS_RE),
        pci_device_id=g.int_("pci_device_id", 0, 2**32 - 1),
        architecture=g.int_("architecture", 0, 1000),
        compute_capability=g.ints("compute_capability", 2),
        memory=Memory(mem.req_int("total"), mem.req_int("reserved"), mem.req_int("used"), mem.req_int("free"))
        if mem
        else None,
        ecc_mode=g.ints("ecc_mode", 2),
        ecc_errors=EccErrors(
            ecc.int_("corrected_volatile"),
            ecc.int_("uncorrected_volatile"),
            ecc.int_("corrected_aggregate"),
            ecc.int_("uncorrected_aggregate"),
        )
        if ecc
        else None,
        remapped_rows=RemappedRows(rows[0], rows[1], bool(rows[2]), bool(rows[3])) if rows else None,
        retired_pages=RetiredPages(retired.int_("sbe"), retired.int_("dbe"), retired.int_("pending", 0, 1))
        if retired
        else None,
        persistence=g.int_("persistence", 0, 1),
        mig_mode=g.ints("mig_mode", 2),
        power_limit_mw=g.int_("power_limit_mw", 0, 10**7),
        power_usage_mw=g.int_("power_usage_mw", 0, 10**7),
        temperature_c=g.int_("temperature_c", 0, 200),
        clocks={k: clocks.int_(k, 0, 100_000) for k in ("graphics", "sm", "mem", "max_graphics", "max_sm", "max_mem")},
        clock_event_reasons=g.int_("clock_event_reasons", 0, 2**64),
        utilization_gpu=g.int_("utilization_gpu", 0, 100),
        pcie=Pcie(
            pcie.int_("gen", 0, 16),
            pcie.int_("max_gen", 0, 16),
            pcie.int_("gpu_max_gen", 0, 16),
            pcie.int_("width", 0, 64),
            pcie.int_("max_width", 0, 64),
            pcie.int_("replay_counter", 0, 2**64),
        ),
        virtualization_mode=g.int_("virtualization_mode", 0, 16),
        nvlinks=tuple(
            NvLink(
                link=x.req_int("link", 0, 63),
                active=x.bool_("active"),
                version=x.int_("version", 0, 64),
                remote_type=x.int_("remote_type", 0, 255),
                remote_bus_id=x.str_("remote_bus_id", 16, _BUS_RE),
            )
            for x in links
        ),
        fabric=Fabric(
            fabric.req_int("state", 0, 16),
            fabric.req_int("status", 0, 2**32),
            fabric.req_int("clique_id", 0, 2**32),
            fabric.str_("cluster_uuid", 32, re.compile(r"^[0-9a-f]{32}$")) or "",
        )
        if fabric
        else None,
        processes=tuple(
            GpuProcess(
                pid=p.req_int("pid", 1, 2**32),
                used_memory=p.int_("used_memory"),
                comm=p.str_("comm", 64),
                unit=p.str_("unit", 128),
            )
            for p in procs
        )
        if procs is not None
        else None,
        errors={},
    )


def attach_gpu_errors(facts: HostFacts) -> HostFacts:
    """Move ``gpu<i>.<query>`` errors from the host's table onto the GPUs they belong to."""
    host_errors: dict[str, str] = {}
    per_gpu: dict[int, dict[str, str]] = {}
    for key, value in facts.errors.items():
        m = re.match(r"^gpu(\d+)\.(.+)$", key)
        if m:
            per_gpu.setdefault(int(m.group(1)), {})[m.group(2)] = value
        else:
            host_errors[key] = value
    gpus = tuple(replace(g, errors={**g.errors, **per_gpu.get(g.index, {})}) for g in facts.gpus)
    return replace(facts, gpus=gpus, errors=host_errors)
