"""Deploying instances that span hosts (``fleet.plan.multinode``): what a deploy checks and decides
for them, apart from the single-host path it otherwise shares.

Each node of instance ``vllm-N`` is unit ``fleet-vllm-N.service`` on its own host, rendered from
that host's plan like any instance (its argv carries ``--nnodes --node-rank --master-addr
--master-port``, and ``--headless`` on every node but rank 0). What vLLM 0.33 requires of the
start, from its code:

* with ``nnodes > 1`` every rank joins the torch.distributed world at
  ``tcp://master_addr:master_port`` (``init_distributed_environment``,
  ``vllm/distributed/parallel_state.py``). The store's server is global rank 0's, on node rank 0
  (the leader); the other ranks' store clients retry connecting until torch's timeout
  (``default_pg_timeout``: vLLM passes none). **So neither side must start first**: a headless
  node started before its leader waits for it, and the leader's engine core waits in its store
  for every node before it finishes starting. The deploy starts every node of an instance in the
  same step (pyinfra's lock-step run starts each host's units at once), and gates on the leader:
  vLLM's API server listens only after the engine core started (``run_server``,
  ``vllm/entrypoints/launchers/api_server/entry.py``), which is after every node joined, so a
  leader that answers a completion is an instance whose every node serves;
* a headless node (``run_headless``, ``vllm/entrypoints/cli/serve.py``) serves no HTTP: there is
  nothing to gate on it but the leader;
* a node that dies ends the instance: its peers' collectives fail; the leader's API server then
  exits 0 (its watchdog, as for any engine death) and a headless node's ``run_headless`` returns
  (exit 0). The units' ``Restart=always`` brings each back, and they join again.

Decided here (pure): which instances span which hosts (:func:`spans`), the release every node
must share (:func:`release_problems`), and which nodes are held back because another node of
their instance cannot start (:func:`held_back`). Acted here: the preflight of the rendezvous port
(:func:`check_rendezvous`): free on the leader, and reachable from each other node, checked by
listening on it for a few seconds on the leader while each other node connects to it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fleet.escape import ssh_command
from fleet.plan.planner import HostPlan

#: How long the leader listens on the rendezvous port at preflight, and the others try to connect.
PROBE_SECONDS = 8.0


@dataclass(frozen=True)
class Span:
    """One instance over several hosts, as the deploy sees it."""

    name: str  #: the instance (``vllm-N``): unit ``fleet-vllm-N.service`` on every node's host
    hosts: tuple[str, ...]  #: node rank order: ``hosts[0]`` leads (serves the API)
    master_addr: str
    master_port: int

    @property
    def leader(self) -> str:
        return self.hosts[0]

    @property
    def workers(self) -> tuple[str, ...]:
        return self.hosts[1:]

    @property
    def unit(self) -> str:
        return f"fleet-{self.name}.service"

    def describe(self) -> str:
        return f"{self.leader}/{self.name} on {', '.join(self.hosts)}"


def spans(plans: Mapping[str, HostPlan]) -> list[Span]:
    """Every instance spanning hosts among ``plans`` (once, from whichever of its nodes' plans is
    there), in the order of their leaders' plans."""
    out: dict[tuple[str, tuple[str, ...]], Span] = {}
    for plan in plans.values():
        for inst in plan.instances:
            node = inst.node
            if node is None:
                continue
            addr, _, port = node.master.rpartition(":")
            key = (inst.unit_name, node.hosts)
            out.setdefault(key, Span(inst.unit_name, node.hosts, addr.strip("[]"), int(port)))
    return list(out.values())


def release_problems(found: Sequence[Span], plans: Mapping[str, HostPlan]) -> list[str]:
    """The same vLLM release on every node of an instance (vLLM's ranks must run the same code);
    each instance whose planned nodes differ, named with each node's release."""
    problems = []
    for s in found:
        releases = {h: plans[h].vllm_version for h in s.hosts if h in plans}
        if len(set(releases.values())) > 1:
            said = ", ".join(f"{h}: {v}" for h, v in releases.items())
            problems.append(
                f"instance {s.describe()}: its nodes would run different vLLM releases ({said}); every node of "
                "an instance runs the same one: set vllm_version once for the group. Nothing was touched"
            )
    return problems


def held_back(found: Sequence[Span], able: Callable[[str], str | None], to_start: Sequence[str]) -> dict[str, str]:
    """Hosts of ``to_start`` not to start because another node of their instance cannot serve:
    host -> why. ``able(host)``: None when the host can run its node, else its state (failed,
    refused, ...). A node started without its peers would wait in the rendezvous holding its GPUs."""
    out: dict[str, str] = {}
    for s in found:
        unable = {h: why for h in s.hosts if (why := able(h)) is not None}
        if not unable:
            continue
        said = "; ".join(f"{h} is {why}" for h, why in unable.items())
        for h in s.hosts:
            if h in to_start and h not in unable:
                out[h] = f"not started: instance {s.describe()} cannot start on all its nodes ({said})"
    return out


# -- the rendezvous port at preflight (I/O) -------------------------------------------------------

LISTEN = r"""
import json, socket, sys, time
a, p, t, n = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET6 if ":" in a else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does: TIME_WAIT is no holder
try:
    s.bind((a, p)); s.listen(16)
except OSError as e:
    print(json.dumps({"bind": "%s (errno %s)" % (e.strerror or e, e.errno), "errno": e.errno})); sys.exit(0)
s.settimeout(0.2); got = []; end = time.monotonic() + t
while time.monotonic() < end and len(got) < n:
    try:
        c, peer = s.accept(); got.append(peer[0]); c.close()
    except OSError:
        pass
print(json.dumps({"bind": "ok", "accepted": got}))
"""

CONNECT = r"""
import errno, json, socket, sys, time
a, p, t = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + t; last = "no try"
while time.monotonic() < end:
    try:
        socket.create_connection((a, p), timeout=2).close(); print(json.dumps({"connect": "ok"})); sys.exit(0)
    except OSError as e:
        last = "%s: %s" % (errno.errorcode.get(e.errno or 0, type(e).__name__), e.strerror or e)
    time.sleep(0.2)
print(json.dumps({"connect": last}))
"""

#: (host, command) -> (exit status, stdout, stderr); raises on a host that cannot be reached
Run = Callable[[str, str], tuple[int, str, str]]


def _answer(result: tuple[int, str, str] | BaseException | None) -> dict[str, object] | str:
    if result is None:
        return "no answer"
    if isinstance(result, BaseException):
        return f"could not run the check: {result}"
    rc, out, err = result
    lines = [x for x in out.splitlines() if x.strip().startswith("{")]
    if rc != 0 or not lines:
        return f"the check exited {rc}: {(err or out).strip()[-300:]}"
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        return f"unreadable answer: {lines[-1][:200]}"
    return answer if isinstance(answer, dict) else f"unreadable answer: {lines[-1][:200]}"


def rendezvous_verdict(
    s: Span, leader: dict[str, object] | str, workers: Mapping[str, dict[str, object] | str]
) -> dict[str, str]:
    """Host -> why it is refused, from the leader's listen and each worker's connect (pure)."""
    port = s.master_port
    where = f"{s.master_addr}:{port}"
    if isinstance(leader, str):
        return {s.leader: f"instance {s.describe()}: the rendezvous port {where} could not be checked: {leader}"}
    if leader.get("bind") != "ok":
        taken = leader.get("errno") == 98  # EADDRINUSE
        why = (
            f"is taken on {s.leader} (something listens there: `ss -ltnp 'sport = :{port}'` on {s.leader} names "
            f"it): stop it, or set master_port in the group's data to a free port"
            if taken
            else f"cannot be bound on {s.leader}: {leader.get('bind')}; master_addr {s.master_addr} must be an "
            f"address of {s.leader}"
        )
        return {s.leader: f"instance {s.describe()}: the rendezvous port {where} {why}. Nothing was started"}
    out: dict[str, str] = {}
    for host, answer in workers.items():
        said = answer if isinstance(answer, str) else str(answer.get("connect"))
        if said != "ok":
            out[host] = (
                f"instance {s.describe()}: {host} cannot reach the leader's rendezvous port {where} ({said}): open "
                f"TCP {port} from {host} to {s.leader} (a firewall, a security group), or set master_port to a "
                "port they may use. Nothing was started"
            )
    return out


def check_rendezvous(found: Sequence[Span], run: Run, seconds: float = PROBE_SECONDS) -> dict[str, str]:
    """For each instance, at once: listen on the rendezvous port on the leader (free?) while each
    other node connects to it (reachable?); host -> why refused (empty: every check passed). Run
    only where the instance is not running (its leader holds the port then)."""
    results: dict[tuple[int, str], tuple[int, str, str] | BaseException | None] = {}

    def call(key: tuple[int, str], host: str, command: str) -> None:
        try:
            results[key] = run(host, command)
        except Exception as exc:  # reported as this host's check that could not run
            results[key] = exc

    threads = []
    for i, s in enumerate(found):
        listen = ssh_command(["python3", "-c", LISTEN, s.master_addr, str(s.master_port), str(seconds),
                              str(len(s.workers))])  # fmt: skip
        threads.append(threading.Thread(target=call, args=((i, s.leader), s.leader, listen)))
        for w in s.workers:
            connect = ssh_command(["python3", "-c", CONNECT, s.master_addr, str(s.master_port), str(seconds - 1)])
            threads.append(threading.Thread(target=call, args=((i, w), w, connect)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused: dict[str, str] = {}
    for i, s in enumerate(found):
        verdict = rendezvous_verdict(
            s, _answer(results.get((i, s.leader))), {w: _answer(results.get((i, w))) for w in s.workers}
        )
        for host, why in verdict.items():
            refused[host] = f"{refused[host]}; {why}" if host in refused else why
    return refused
