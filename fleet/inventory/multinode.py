"""Which hosts may form a multi-node instance, checked across hosts before anything runs.

A group opts in with ``multi_node: true``. Its hosts form a *pool*: the hosts that say
``multi_node: true`` and belong to exactly the same inventory groups (the hosts listed in one
group). When the model does not fit one host, ``fleet.plan.multinode`` plans instances spanning
hosts of one pool: tensor parallel inside each host's NVLink island, one pipeline stage per host
(vLLM 0.33's multiprocessing backend: ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--headless`` on every node but rank 0; ``vllm/config/parallel.py``,
``vllm/entrypoints/cli/serve.py``).

vLLM sizes every rank of an instance alike (one ``--tensor-parallel-size`` for all nodes, one KV
block count: the smallest rank's, ``get_kv_cache_configs`` in ``vllm/v1/core/kv_cache_planning.py``)
and runs one release on all of them, so the hosts of a pool must agree on:

* their GPUs as declared (``gpu``: model, memory, count, NVLink fabric) and the NVIDIA driver
  (``nvidia_driver_version``): hosts that differ are named;
* what the instance is (the settings every node's ``vllm serve`` takes): model, weights, KV cache
  dtype, vLLM release, port, TP, utilization, prefix caching, served name, the rendezvous port and
  the pinned pipeline size;

and the rendezvous port (``master_port``, vLLM's default 29501) must not collide with a serving
or SSH port on the same machine (``fleet.inventory.ports``). A pinned ``pipeline_parallel_size``
needs that many hosts in the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from fleet.errors import FieldProblem
from fleet.inventory.ports import HostSpec as PortSpec
from fleet.inventory.ports import Listener, collisions, spec_listeners

#: Settings every node of a multi-node instance must share (each node runs the same ``vllm serve``).
SHARED_SETTINGS: tuple[str, ...] = (
    "model",
    "model_config",
    "weights",
    "kv_cache_dtype",
    "vllm_version",
    "port",  # not bind_address: each node has its own (the leader's serves the API)
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "prefix_caching",
    "served_model_name",
    "shutdown_timeout",
    "master_port",
    "pipeline_parallel_size",
    "workload",
)


class NodeSpec(PortSpec, Protocol):
    """What these checks read of a host (``fleet.inventory.spec.HostSpec``, which imports this module)."""

    @property
    def groups(self) -> tuple[str, ...]: ...
    @property
    def multi_node(self) -> bool: ...
    @property
    def master_port(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int | None: ...
    @property
    def nvidia_driver_version(self) -> str | None: ...


def pools(specs: Iterable[NodeSpec]) -> dict[tuple[str, ...], list[NodeSpec]]:
    """The multi-node pools: hosts with ``multi_node: true``, keyed by the groups they belong to."""
    out: dict[tuple[str, ...], list[NodeSpec]] = {}
    for spec in specs:
        if spec.multi_node:
            out.setdefault(tuple(spec.groups), []).append(spec)
    return out


def pool_name(groups: Sequence[str]) -> str:
    return "group " + "/".join(groups) if groups else "the hosts without a group"


def _gpu_shape(spec: NodeSpec) -> str | None:
    gpu = getattr(spec, "gpu", None)
    if gpu is None:
        return None
    kind = gpu.sku if gpu.sku is not None else f"{gpu.memory_gib:g} GiB"
    return f"{gpu.count} × {kind}, nvlink {gpu.nvlink.value}"


def _differ(members: Sequence[NodeSpec], fld: str, value_of: object, what: str, way_out: str) -> list[FieldProblem]:
    """One problem per host whose ``what`` differs from the pool's first host."""
    assert callable(value_of)
    first = members[0]
    want = value_of(first)
    problems = []
    others = [s for s in members[1:] if value_of(s) != want]
    for spec in others:
        problems.append(
            FieldProblem(
                spec.source_of(fld),
                spec.name,
                fld,
                value_of(spec),
                f"multi_node: {what} differs from host {first.name}'s ({want}) in {pool_name(first.groups)}: the hosts "
                f"of one multi-node instance must have the same {what} "
                f"(differing: {', '.join(s.name for s in others)}); {way_out}",
            )
        )
    return problems


def pool_problems(members: Sequence[NodeSpec]) -> list[FieldProblem]:
    """Why the hosts of one pool cannot form an instance together (empty: they can)."""
    problems = _differ(
        members, "gpu", _gpu_shape, "GPUs (model, memory, count, NVLink)",
        "put hosts with other GPUs in a group of their own",
    )  # fmt: skip
    problems += _differ(
        members, "nvidia_driver_version", lambda s: s.nvidia_driver_version, "NVIDIA driver",
        "pin one nvidia_driver_version for the group",
    )  # fmt: skip
    for fld in SHARED_SETTINGS:
        problems += _differ(
            members, fld, lambda s, f=fld: getattr(s, f, None), fld,
            f"every node runs the same vllm serve: set {fld} once for the group",
        )  # fmt: skip
    pinned = members[0].pipeline_parallel_size
    if pinned is not None and pinned > len(members):
        first = members[0]
        problems.append(
            FieldProblem(
                first.source_of("pipeline_parallel_size"),
                first.name,
                "pipeline_parallel_size",
                pinned,
                f"one pipeline stage per host: {pool_name(first.groups)} has {len(members)} multi-node host(s) "
                f"({', '.join(s.name for s in members)}); add hosts to the group, or pin at most {len(members)}, "
                "or remove pipeline_parallel_size (fleet picks the fewest hosts that fit)",
            )
        )
    return problems


def _rendezvous(spec: NodeSpec) -> Listener:
    return Listener(
        spec.name, spec.source_of("master_port"), spec.machine, None, spec.master_port, spec.master_port,
        "multi-node rendezvous", "master_port",
    )  # fmt: skip


def rendezvous_problems(specs: Sequence[NodeSpec]) -> list[FieldProblem]:
    """A multi-node host's rendezvous port colliding with a serving or SSH port on its machine.

    Every host of a pool may lead an instance (vLLM's rank 0 binds ``--master-port``), so each one's
    is checked, against its own ports and those of every host on the same machine.
    """
    nodes = [s for s in specs if s.multi_node]
    if not nodes:
        return []
    listeners = [_rendezvous(s) for s in nodes] + spec_listeners(specs)
    return [p for p in collisions(listeners) if p.field == "master_port"]


def multi_node_problems(specs: Sequence[NodeSpec]) -> list[FieldProblem]:
    """Every multi-node problem of the inventory (pools that cannot form an instance, rendezvous ports)."""
    problems = rendezvous_problems(specs)
    for members in pools(specs).values():
        problems += pool_problems(members)
    return problems
