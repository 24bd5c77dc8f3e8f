"""Inventory host data validated into typed ``HostSpec`` objects (loading is in ``load.py``).

The keys ``fleet`` reads are validated. Every invalid value, on every host, is reported at
once, naming the file, the host, the field, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from pyinfra.api.inventory import Inventory

from fleet.errors import FieldProblem, InventoryError
from fleet.gpus import CATALOGUE, Fabric, GiB, HostGpus
from fleet.inventory.load import load_pyinfra_inventory

WeightPrecision = Literal["auto", "bf16", "fp16", "fp8", "int8", "int4"]
KvCacheDtype = Literal["auto", "fp8"]
WEIGHT_PRECISIONS: tuple[str, ...] = ("auto", "bf16", "fp16", "fp8", "int8", "int4")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
FABRICS: tuple[str, ...] = tuple(f.value for f in Fabric)

#: The host-data keys fleet reads. Others (ssh_*, pyinfra's _sudo, your own) are left alone,
#: except near-misses of these, which are almost always typos.
FLEET_KEYS = (
    "model",
    "model_config",
    "served_model_name",
    "weights",
    "kv_cache_dtype",
    "workload",
    "port",
    "bind_address",
    "vllm_version",
    "api_key_ref",
    "gpu",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "prefix_caching",
    "allow_pcie_tensor_parallel",
    "shutdown_timeout",
    "lab_profile",
    "pip_index_url",
)
WORKLOAD_KEYS = ("p95_input_tokens", "p95_output_tokens", "prefix_reuse", "target_concurrency")


@dataclass(frozen=True)
class Workload:
    """What the traffic looks like: sizes at the 95th percentile and how much prefix is shared."""

    p95_input_tokens: int
    p95_output_tokens: int
    prefix_reuse: float  #: fraction of input tokens that hit a cached prefix, 0..1
    target_concurrency: int  #: requests in flight the host should sustain

    @property
    def p95_sequence_tokens(self) -> int:
        return self.p95_input_tokens + self.p95_output_tokens

    @property
    def kv_tokens_per_request(self) -> int:
        """KV tokens one request holds that no other request shares (cached prefixes are shared)."""
        return round(self.p95_input_tokens * (1 - self.prefix_reuse)) + self.p95_output_tokens


@dataclass(frozen=True)
class SecretRef:
    """Where a secret lives on the control machine; the value itself never enters an inventory."""

    scheme: Literal["env", "file"]
    target: str

    def __str__(self) -> str:
        return f"{self.scheme}:{self.target}"


@dataclass(frozen=True)
class GpuSpec:
    """GPUs declared in the inventory, for planning without a probe."""

    count: int
    sku: str | None = None
    memory_gib: float | None = None
    nvlink: Fabric = Fabric.NONE

    def host_gpus(self) -> HostGpus:
        if self.sku is not None:
            return HostGpus.from_catalogue(self.sku, self.count, self.nvlink)
        assert self.memory_gib is not None
        return HostGpus.uniform(self.count, int(self.memory_gib * GiB), self.nvlink)


@dataclass(frozen=True)
class HostSpec:
    """Everything fleet needs to know about one host from the inventory."""

    name: str
    inventory: str
    groups: tuple[str, ...]
    model: str
    workload: Workload
    model_config: str | None = None
    served_model_name: str | None = None
    weights: WeightPrecision = "auto"
    kv_cache_dtype: KvCacheDtype = "auto"
    port: int = 8000
    bind_address: str | None = None
    vllm_version: str = "0.33.0"
    api_key_ref: SecretRef | None = None
    gpu: GpuSpec | None = None
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    prefix_caching: bool = True
    allow_pcie_tensor_parallel: bool = False
    shutdown_timeout: int = 30
    lab_profile: str | None = None
    pip_index_url: str | None = None


@dataclass(frozen=True)
class LoadedInventory:
    """A loaded inventory: pyinfra's ``Inventory`` and the validated specs of its hosts."""

    path: str
    pyinfra: Inventory
    hosts: tuple[HostSpec, ...]

    def host(self, name: str) -> HostSpec:
        for spec in self.hosts:
            if spec.name == name:
                return spec
        raise KeyError(name)


# -- validation ---------------------------------------------------------------------------------


class _Checker:
    """Collects every problem of one host instead of stopping at the first."""

    def __init__(self, inventory: str, host: str, data: dict[str, Any]):
        self.inventory, self.host, self.data = inventory, host, data
        self.problems: list[FieldProblem] = []

    def problem(self, field: str, value: object, allowed: str) -> None:
        self.problems.append(FieldProblem(self.inventory, self.host, field, value, allowed))

    def integer(self, field: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.problem(field, value, f"an integer from {low} to {high}")
            return low
        return value

    def number(self, field: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and (value < low or value > high or (low_open and value == low)):
            ok = False
        if not ok:
            bracket = "(" if low_open else "["
            self.problem(field, value, f"a number in {bracket}{low}, {high}]")
            return high
        return float(value)

    def choice(self, field: str, value: Any, choices: tuple[str, ...]) -> str:
        if value not in choices:
            self.problem(field, value, "one of " + ", ".join(choices))
            return choices[0]
        return str(value)

    def text(self, field: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.problem(field, value, "a non-empty string")
            return ""
        return value

    def boolean(self, field: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.problem(field, value, "true or false")
            return False
        return value


def _workload(c: _Checker, raw: Any) -> Workload:
    if not isinstance(raw, dict):
        c.problem("workload", raw, "a dict with " + ", ".join(WORKLOAD_KEYS))
        return Workload(1, 1, 0.0, 1)
    for key in raw:
        if key not in WORKLOAD_KEYS:
            c.problem(f"workload.{key}", raw[key], "unknown key; allowed: " + ", ".join(WORKLOAD_KEYS))
    for key in WORKLOAD_KEYS:
        if key not in raw:
            c.problem(f"workload.{key}", None, "required")
    return Workload(
        p95_input_tokens=c.integer("workload.p95_input_tokens", raw.get("p95_input_tokens", 1), 1, 10_000_000),
        p95_output_tokens=c.integer("workload.p95_output_tokens", raw.get("p95_output_tokens", 1), 1, 10_000_000),
        prefix_reuse=c.number("workload.prefix_reuse", raw.get("prefix_reuse", 0.0), 0.0, 1.0),
        target_concurrency=c.integer("workload.target_concurrency", raw.get("target_concurrency", 1), 1, 1_000_000),
    )


_SECRET_RE = re.compile(r"^(env):([A-Za-z_][A-Za-z0-9_]*)$|^(file):(/.+)$")


def _secret(c: _Checker, raw: Any) -> SecretRef | None:
    if raw is None:
        return None
    match = _SECRET_RE.match(raw) if isinstance(raw, str) else None
    if match is None:
        shown = "<hidden>" if isinstance(raw, str) and ":" not in raw else raw
        c.problem(
            "api_key_ref",
            shown,
            "a reference to the key, not the key: env:VARIABLE (read on the control machine) "
            "or file:/absolute/path (readable only by you)",
        )
        return None
    scheme: Literal["env", "file"] = "env" if match.group(1) else "file"
    return SecretRef(scheme, match.group(2) or match.group(4))


def _gpu(c: _Checker, raw: Any) -> GpuSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        c.problem("gpu", raw, "a dict: {sku, count, nvlink} or {memory_gib, count, nvlink}")
        return None
    count = c.integer("gpu.count", raw.get("count", 1), 1, 64)
    nvlink_raw = raw.get("nvlink", None)
    if isinstance(nvlink_raw, bool):
        nvlink_raw = Fabric.SWITCH if nvlink_raw else Fabric.NONE
    sku = raw.get("sku")
    if sku is not None:
        if sku not in CATALOGUE:
            c.problem("gpu.sku", sku, "one of " + ", ".join(CATALOGUE))
            return None
        fabric = CATALOGUE[sku].typical_fabric if nvlink_raw is None else nvlink_raw
        return GpuSpec(count, sku=sku, nvlink=Fabric(c.choice("gpu.nvlink", fabric, FABRICS)))
    memory = c.number("gpu.memory_gib", raw.get("memory_gib"), 1, 4096) if "memory_gib" in raw else None
    if memory is None:
        c.problem("gpu", raw, "needs sku (one of " + ", ".join(CATALOGUE) + ") or memory_gib")
        return None
    fabric = c.choice("gpu.nvlink", Fabric.NONE if nvlink_raw is None else nvlink_raw, FABRICS)
    return GpuSpec(count, memory_gib=memory, nvlink=Fabric(fabric))


def _typos(c: _Checker) -> None:
    for key in c.data:
        if key in FLEET_KEYS or key.startswith(("ssh_", "_")):
            continue
        close = difflib.get_close_matches(key, FLEET_KEYS, n=1, cutoff=0.8)
        if close:
            c.problem(key, c.data[key], f"unknown field; did you mean {close[0]!r}?")


def host_spec(inventory: str, name: str, groups: tuple[str, ...], data: dict[str, Any]) -> HostSpec:
    """Validate one host's data; ``InventoryError`` lists every problem found."""
    c = _Checker(inventory, name, data)
    _typos(c)
    if "model" not in data:
        c.problem("model", None, "required: a Hugging Face model id (org/name) or a path to the model directory")
    if "workload" not in data:
        c.problem("workload", None, "required: {" + ", ".join(f"{k}: ..." for k in WORKLOAD_KEYS) + "}")
    tp = data.get("tensor_parallel_size")
    util = data.get("gpu_memory_utilization")
    version = c.text("vllm_version", data.get("vllm_version", "0.33.0"))
    if version and not re.fullmatch(r"\d+\.\d+\.\d+", version):
        c.problem("vllm_version", version, "a release version like 0.33.0")
    spec = HostSpec(
        name=name,
        inventory=inventory,
        groups=groups,
        model=c.text("model", data.get("model", "?")),
        workload=_workload(c, data.get("workload", {})),
        model_config=c.text("model_config", data["model_config"]) if "model_config" in data else None,
        served_model_name=c.text("served_model_name", data["served_model_name"])
        if "served_model_name" in data
        else None,
        weights=cast(WeightPrecision, c.choice("weights", data.get("weights", "auto"), WEIGHT_PRECISIONS)),
        kv_cache_dtype=cast(
            KvCacheDtype, c.choice("kv_cache_dtype", data.get("kv_cache_dtype", "auto"), KV_CACHE_DTYPES)
        ),
        port=c.integer("port", data.get("port", 8000), 1024, 65535 - 64),
        bind_address=c.text("bind_address", data["bind_address"]) if "bind_address" in data else None,
        vllm_version=version,
        api_key_ref=_secret(c, data.get("api_key_ref")),
        gpu=_gpu(c, data.get("gpu")),
        tensor_parallel_size=c.integer("tensor_parallel_size", tp, 1, 64) if tp is not None else None,
        gpu_memory_utilization=c.number("gpu_memory_utilization", util, 0.0, 0.95, low_open=True)
        if util is not None
        else None,
        prefix_caching=c.boolean("prefix_caching", data.get("prefix_caching", True)),
        allow_pcie_tensor_parallel=c.boolean(
            "allow_pcie_tensor_parallel", data.get("allow_pcie_tensor_parallel", False)
        ),
        shutdown_timeout=c.integer("shutdown_timeout", data.get("shutdown_timeout", 30), 0, 3600),
        lab_profile=c.text("lab_profile", data["lab_profile"]) if "lab_profile" in data else None,
        pip_index_url=c.text("pip_index_url", data["pip_index_url"]) if "pip_index_url" in data else None,
    )
    if c.problems:
        raise InventoryError(c.problems)
    return spec


def load_inventory(path: str | Path, limit: list[str] | None = None) -> LoadedInventory:
    """Load and validate an inventory. ``limit``: host names or group names, like pyinfra's."""
    inventory = load_pyinfra_inventory(path)
    problems: list[FieldProblem] = []
    specs: list[HostSpec] = []
    selected = _limit(inventory, limit, str(path))
    for host in inventory:
        if selected is not None and host.name not in selected:
            continue
        try:
            data = host.data.dict()  # type: ignore[no-untyped-call]
            specs.append(host_spec(str(path), host.name, tuple(host.groups), data))
        except InventoryError as exc:
            problems.extend(exc.problems)
    if problems:
        raise InventoryError(problems)
    if not specs:
        raise InventoryError([FieldProblem(str(path), "-", "hosts", limit, "no hosts selected")])
    return LoadedInventory(str(path), inventory, tuple(specs))


def _limit(inventory: Inventory, limit: list[str] | None, path: str) -> set[str] | None:
    if not limit:
        return None
    names: set[str] = set()
    for pattern in limit:
        group = inventory.get_group(pattern, None)
        if group:
            names.update(h.name for h in group)
            continue
        matched = {h.name for h in inventory if fnmatch.fnmatch(h.name, pattern)}
        if not matched:
            known = ", ".join(h.name for h in inventory)
            raise InventoryError(
                [FieldProblem(path, "-", "--limit", pattern, f"matches no host or group; hosts: {known}")]
            )
        names.update(matched)
    return names
