"""HAProxy's configuration for a fleet, from the inventory and its plan (pure: no I/O).

One configuration per balancer (``balancer.on`` and its admin socket): a frontend per backend on
its ``bind``, a backend per served model with every planned instance as a server named
``<host>:<instance>`` (stable: the same instance always has the same name, so runtime state and
the state file follow it), and:

* ``option httpchk GET /health`` + ``http-check expect status 200``: vLLM's ``/health`` is 503
  once its engine is dead and refused while it loads or is stopped (vLLM 0.33
  ``vllm/entrypoints/serve/instrumentator/health.py``); it stays 200 while vLLM drains, which is
  why fleet takes an instance out of traffic itself (``set server ... state drain``) first;
* ``timeout client``/``timeout server`` of 10 minutes: a non-streaming completion sends nothing
  until its last token, a stream sends a chunk per token; both must outlast the longest
  generation (HAProxy ``timeout server``, configuration.txt 4.2);
* ``retries 3``, ``option redispatch 1``, ``retry-on conn-failure empty-response``: a request
  whose connection failed, or whose server closed without a byte of answer, is sent to another
  server; one that got any answer is not replayed (HAProxy ``retry-on``: "it is very dangerous to
  use any retry-on value beside conn-failure and none" unless replays are safe; an empty response
  is a request vLLM never started);
* ``slowstart 30s``: a server that comes back up gets its share of new connections gradually
  (``balance leastconn`` is dynamic, so the weight ramps with each check);
* ``disabled`` on every server and ``load-server-state-from-file global`` with
  ``server-state-file``: a server HAProxy has not seen before starts in maintenance, one it has
  keeps the state it had at runtime (``show servers state`` is dumped before every reload); only
  fleet's passing gates set a server ``ready`` (``fleet.lb.traffic``).

The API key is never written here: clients send it, HAProxy passes the header through, and
``/health`` needs none (vLLM checks keys on ``/v1`` paths only).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.escape import comment_text, haproxy_word
from fleet.inventory.spec import BalancerSpec, HostSpec, LoadedInventory
from fleet.lb.runtime import ServerState
from fleet.plan.planner import HostPlan
from fleet.render.units import RenderedFile, _environment

#: Where Debian's haproxy (a balancer host) keeps the state fleet dumps before a reload.
SYSTEM_STATE_FILE = "/var/lib/haproxy/server-state"
SYSTEMD_DROPIN = "/etc/systemd/system/haproxy.service.d/fleet-server-state.conf"


def server_name(host: str, instance: str) -> str:
    """The stable name of an instance's server: ``<host>:<instance>`` (``:`` is in neither)."""
    return f"{host}:{instance}"


@dataclass(frozen=True)
class Server:
    host: str
    instance: str  #: "vllm-0"
    address: str  #: where the balancer reaches it
    port: int

    @property
    def name(self) -> str:
        return server_name(self.host, self.instance)

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


@dataclass(frozen=True)
class Backend:
    name: str
    bind: str
    servers: tuple[Server, ...]

    @property
    def frontend(self) -> str:
        return f"fleet_{self.name}"[:100]


@dataclass(frozen=True)
class Timeouts:
    client: str = "10m"
    server: str = "10m"
    slowstart: str = "30s"


@dataclass(frozen=True)
class BalancerConfig:
    """Everything one balancer's configuration holds."""

    spec: BalancerSpec  #: the first host's entry (they agree on ``on``, socket and config path)
    backends: tuple[Backend, ...]
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def system(self) -> bool:
        """A balancer host's Debian haproxy (chroot, its own user, syslog); ``local``: a process of ours."""
        return not self.spec.local

    @property
    def state_file(self) -> str:
        return SYSTEM_STATE_FILE if self.system else f"{self.spec.config}.state"

    @property
    def servers(self) -> list[tuple[str, str]]:
        return [(b.name, s.name) for b in self.backends for s in b.servers]


def group_balancers(entries: Iterable[tuple[BalancerSpec, Server]]) -> list[BalancerConfig]:
    """Servers grouped into their balancers and backends, in inventory order."""
    specs: dict[tuple[str, str], BalancerSpec] = {}
    backends: dict[tuple[str, str], dict[str, tuple[str, list[Server]]]] = {}
    for spec, server in entries:
        specs.setdefault(spec.key, spec)
        by_name = backends.setdefault(spec.key, {})
        by_name.setdefault(spec.backend, (spec.bind, []))[1].append(server)
    return [
        BalancerConfig(specs[key], tuple(Backend(name, bind, tuple(servers)) for name, (bind, servers) in b.items()))
        for key, b in backends.items()
    ]


def render_config(config: BalancerConfig, inventory: str, written_by: str = "fleet lb export") -> str:
    env = _environment()
    env.filters["haproxy"] = haproxy_word
    env.filters["comment"] = comment_text
    return env.get_template("haproxy.cfg.j2").render(
        system=config.system,
        admin_socket=config.spec.admin_socket,
        state_file=config.state_file,
        timeouts=config.timeouts,
        backends=config.backends,
        inventory=inventory,
        written_by=written_by,
    )


def state_dump_command(admin_socket: str, state_file: str) -> str:
    """A shell line that writes ``show servers state`` to ``state_file`` atomically (for a reload)."""
    from fleet.escape import ssh_command

    tmp = f"{state_file}.tmp"
    dump = ssh_command(["socat", "-t", "5", "STDIO", f"UNIX-CONNECT:{admin_socket}"])
    return (
        f"echo 'show servers state' | {dump} > {ssh_command([tmp])} && "
        f"mv -f {ssh_command([tmp])} {ssh_command([state_file])} || true"
    )


def systemd_dropin(admin_socket: str, state_file: str, config: str = "/etc/haproxy/haproxy.cfg") -> str:
    """A drop-in for Debian's ``haproxy.service``: the unit reads ``config`` (Debian's unit takes its
    path from ``CONFIG``), and every ``systemctl reload`` checks the configuration, dumps the
    servers' runtime state, then reloads (Debian's own two ``ExecReload=`` replaced)."""
    from fleet.escape import systemd_assignment

    dump = state_dump_command(admin_socket, state_file).replace("%", "%%").replace("$", "$$")
    return (
        "# Written by fleet: keep HAProxy's runtime server states across `systemctl reload haproxy`\n"
        "[Service]\n"
        f"Environment={systemd_assignment('CONFIG', config)}\n"
        "ExecReload=\n"
        "ExecReload=/usr/sbin/haproxy -Ws -f $CONFIG -c -q $EXTRAOPTS\n"
        f"ExecReload=/bin/sh -c {_systemd_quote(dump)}\n"
        "ExecReload=/bin/kill -USR2 $MAINPID\n"
    )


def _systemd_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def export_files(configs: Sequence[BalancerConfig], inventory: str) -> list[RenderedFile]:
    """``DIR/<balancer>/haproxy.cfg`` per balancer (``local`` for this machine's), and for a
    balancer host the systemd drop-in ``fleet deploy`` installs with it."""
    files = []
    for c in configs:
        where = export_dir(c)
        files.append(RenderedFile(f"{where}/{c.spec.config.rsplit('/', 1)[-1]}", render_config(c, inventory), 0o644))
        if c.system:
            dropin = systemd_dropin(c.spec.admin_socket, c.state_file, c.spec.config)
            files.append(RenderedFile(f"{where}/fleet-server-state.conf", dropin, 0o644))
    return files


def export_dir(c: BalancerConfig) -> str:
    """``local`` or the balancer host's name, and the socket's name when a machine has several."""
    where = "local" if c.spec.local else c.spec.on
    sock = c.spec.admin_socket.rsplit("/", 1)[-1]
    return where if sock == "admin.sock" else f"{where}/{sock}"


def server_address(spec: HostSpec, data: Mapping[str, Any]) -> str:
    """Where a balancer reaches the host's instances: its ``bind_address`` when it binds one
    address, else its ``ssh_hostname``, else its name (as the rollout's gates reach them)."""
    if spec.bind_address not in (None, "0.0.0.0", "::"):
        return str(spec.bind_address)
    hostname = data.get("ssh_hostname")
    return hostname if isinstance(hostname, str) and hostname else spec.name


def fleet_configs(loaded: LoadedInventory, plans: Mapping[str, HostPlan | None]) -> list[BalancerConfig]:
    """Every balancer's configuration from the inventory's hosts and their plans (a host without a
    plan has no server yet)."""
    entries = []
    for spec in loaded.hosts:
        plan = plans.get(spec.name)
        if plan is None:
            continue
        # each instance behind its own balancer: the host's, or its entry's on a host with models
        # (a backend per served model, ``fleet.plan.models``)
        behind = {i.index: spec.balancer for i in plan.instances}
        for m in plan.models:
            behind.update({i.index: spec.models[m.entry].spec.balancer for i in m.plan.instances})
        data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
        address = server_address(spec, data)
        # a headless node of an instance spanning hosts serves no HTTP: its leader is the server
        entries += [
            (b, Server(spec.name, i.unit_name, address, i.port))
            for i in plan.instances
            if i.serves and (b := behind[i.index]) is not None
        ]
    return group_balancers(entries)


@dataclass(frozen=True)
class Reconfiguration:
    """What a deploy writes to one balancer, against what HAProxy runs now."""

    config: BalancerConfig  #: the configuration to write
    added: tuple[tuple[str, str], ...]  #: (backend, server) HAProxy does not have yet: written disabled
    kept: tuple[tuple[str, str], ...]  #: servers of hosts this deploy did not plan, kept as HAProxy has them
    retired: tuple[tuple[str, str], ...]  #: servers HAProxy has that the new configuration drops


def reconfigure(
    config: BalancerConfig, running: Sequence[ServerState], inventory_hosts: Collection[str]
) -> Reconfiguration:
    """The configuration a deploy writes, from the planned servers and what HAProxy runs (pure).

    A server this deploy planned is written as planned. One HAProxy has for an inventory host this
    deploy did not plan (left out by ``--limit``, drained, waiting for its driver) is kept with the
    address and port HAProxy has, so a partial deploy never drops it. Any other (its host left the
    inventory, or its host's plan no longer has that instance or that backend) is retired: the
    caller takes it out of traffic before the new configuration drops it."""
    planned_hosts = {s.host for b in config.backends for s in b.servers}
    servers = {b.name: list(b.servers) for b in config.backends}
    have = {(st.backend, st.server) for st in running}
    planned = [(b.name, s.name) for b in config.backends for s in b.servers]
    kept: list[tuple[str, str]] = []
    retired: list[tuple[str, str]] = []
    for st in running:
        if (st.backend, st.server) in planned:
            continue
        host, sep, instance = st.server.partition(":")
        keep = sep and host in inventory_hosts and host not in planned_hosts and st.backend in servers and st.port
        if keep:
            servers[st.backend].append(Server(host, instance, st.address, st.port))
            kept.append((st.backend, st.server))
        else:
            retired.append((st.backend, st.server))
    backends = tuple(replace(b, servers=tuple(servers[b.name])) for b in config.backends)
    return Reconfiguration(
        replace(config, backends=backends), tuple(k for k in planned if k not in have), tuple(kept), tuple(retired)
    )
