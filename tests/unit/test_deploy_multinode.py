"""Deploying an instance over several hosts (``fleet.deploy.multinode``): which instances span which
hosts, the release every node shares, which nodes are held back, and the rendezvous port's
preflight (its scripts run here for real, on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
from pathlib import Path

import pytest

from fleet.deploy import multinode
from fleet.deploy.multinode import Span, held_back, release_problems, rendezvous_verdict, spans
from fleet.deploy.runner import _endpoints, check_hosts
from fleet.plan.outcomes import load_for_planning
from fleet.plan.planner import HostPlan

from .test_plan_multinode import L70, ONE_H100, _group, inventory

PAIR = Span("vllm-0", ("n1", "n2"), "127.0.250.3", 29501)


@pytest.fixture
def plans(tmp_path: Path) -> dict[str, HostPlan]:
    path = inventory(tmp_path, _group("pair", ["n1", "n2"], 3, model=L70, weights="fp8", multi_node=True,
                                      gpu=ONE_H100, pip_index_url="http://127.0.0.1:9/simple/"))  # fmt: skip
    return check_hosts(load_for_planning(path))


def test_one_instance_over_two_hosts_is_one_span_led_by_rank_0(plans: dict[str, HostPlan]) -> None:
    assert spans(plans) == [PAIR]
    assert spans({"n2": plans["n2"]}) == [PAIR]  # from any of its nodes' plans
    assert PAIR.unit == "fleet-vllm-0.service" and PAIR.workers == ("n2",)
    assert spans({}) == []


def test_only_the_leader_has_an_endpoint_to_gate_on(plans: dict[str, HostPlan]) -> None:
    """run_headless (vllm/entrypoints/cli/serve.py): a headless node serves no HTTP."""
    assert [(e.unit, e.url) for e in _endpoints(plans["n1"], "127.0.250.3")] == [
        ("fleet-vllm-0.service", "http://127.0.250.3:8000")
    ]
    assert _endpoints(plans["n2"], "127.0.250.4") == []
    n2 = plans["n2"].instances[0]
    assert "--headless" in n2.argv and n2.argv[n2.argv.index("--master-addr") + 1] == "127.0.250.3"


def test_every_node_must_plan_the_same_release(plans: dict[str, HostPlan]) -> None:
    assert release_problems(spans(plans), plans) == []
    mixed = {**plans, "n2": dataclasses.replace(plans["n2"], vllm_version="0.32.0")}
    (problem,) = release_problems(spans(mixed), mixed)
    assert "n1/vllm-0 on n1, n2" in problem and "n1: 0.33.0, n2: 0.32.0" in problem
    assert "Nothing was touched" in problem


@pytest.mark.parametrize(
    ("unable", "to_start", "held"),
    [
        ({}, ["n1", "n2"], {}),
        ({"n2": "refused"}, ["n1", "n2"], {"n1": "n2 is refused"}),
        ({"n1": "failed"}, ["n1", "n2"], {"n2": "n1 is failed"}),
        ({"n1": "failed"}, ["n1"], {}),  # n2 not to start (quiet): nothing to hold back
        ({"n1": "failed", "n2": "unreachable"}, ["n1", "n2"], {}),
    ],
)
def test_a_node_is_not_started_without_its_peers(
    unable: dict[str, str], to_start: list[str], held: dict[str, str]
) -> None:
    got = held_back([PAIR], unable.get, to_start)
    assert sorted(got) == sorted(held)
    for host, part in held.items():
        assert part in got[host] and "n1/vllm-0 on n1, n2" in got[host] and got[host].startswith("not started")


def test_rendezvous_verdicts() -> None:
    ok = {"bind": "ok", "accepted": ["127.0.250.4"]}
    assert rendezvous_verdict(PAIR, ok, {"n2": {"connect": "ok"}}) == {}
    taken = rendezvous_verdict(PAIR, {"bind": "Address already in use (errno 98)", "errno": 98}, {"n2": {}})
    assert list(taken) == ["n1"] and "127.0.250.3:29501 is taken on n1" in taken["n1"]
    assert "ss -ltnp 'sport = :29501'" in taken["n1"] and "master_port" in taken["n1"]
    foreign = rendezvous_verdict(PAIR, {"bind": "Cannot assign requested address (errno 99)", "errno": 99}, {})
    assert "master_addr 127.0.250.3 must be an address of n1" in foreign["n1"]
    blocked = rendezvous_verdict(PAIR, ok, {"n2": {"connect": "EHOSTUNREACH: No route to host"}})
    assert list(blocked) == ["n2"] and "n2 cannot reach the leader's rendezvous port 127.0.250.3:29501" in blocked["n2"]
    assert "EHOSTUNREACH" in blocked["n2"] and "open TCP 29501 from n2 to n1" in blocked["n2"]
    assert "could not be checked: ssh: timeout" in rendezvous_verdict(PAIR, "ssh: timeout", {})["n1"]


def _here(host: str, command: str) -> tuple[int, str, str]:
    """The preflight's command run on this machine instead of over SSH."""
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, done.stdout, done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_rendezvous_check_listens_on_the_leader_while_the_worker_connects() -> None:
    span = Span("vllm-0", ("n1", "n2", "n3"), "127.0.0.1", _free_port())
    assert multinode.check_rendezvous([span], _here, seconds=4) == {}


def test_the_rendezvous_check_names_a_taken_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        span = Span("vllm-0", ("n1", "n2"), "127.0.0.1", taken.getsockname()[1])
        got = multinode.check_rendezvous([span], _here, seconds=2)
    assert list(got) == ["n1"] and "is taken on n1" in got["n1"]


def test_a_leader_whose_check_cannot_run_is_named() -> None:
    span = Span("vllm-0", ("n1", "n2"), "127.0.0.1", _free_port())

    def run(host: str, command: str) -> tuple[int, str, str]:
        if host == "n1":
            raise OSError("connection lost")
        return _here(host, command)

    got = multinode.check_rendezvous([span], run, seconds=2)
    assert list(got) == ["n1"] and "could not be checked: could not run the check: connection lost" in got["n1"]


def test_a_worker_that_cannot_connect_is_named_with_the_error_it_got() -> None:
    """Nothing listens (the leader's answer says it did): the worker's real connects are refused."""
    span = Span("vllm-0", ("n1", "n2"), "127.0.0.1", _free_port())

    def run(host: str, command: str) -> tuple[int, str, str]:
        return (0, '{"bind": "ok", "accepted": []}\n', "") if host == "n1" else _here(host, command)

    got = multinode.check_rendezvous([span], run, seconds=2)
    assert list(got) == ["n2"] and "ECONNREFUSED" in got["n2"], got


def test_connections_left_in_time_wait_do_not_make_the_port_taken() -> None:
    """The leader's store closed its connections first (TIME_WAIT on the port): a restarted leader
    binds it (torch sets SO_REUSEADDR), so the preflight must not call it taken."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _peer = server.accept()
        conn.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    span = Span("vllm-0", ("n1", "n2"), "127.0.0.1", port)
    assert multinode.check_rendezvous([span], _here, seconds=2) == {}


def test_balancers_and_scrapes_name_the_leader_only(tmp_path: Path) -> None:
    """A headless node serves no HTTP: no HAProxy server and no Prometheus target for it."""
    from fleet.lb.config import fleet_configs
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.plan.outcomes import build_fleet_plan

    lb = {"kind": "haproxy", "on": "lb1", "bind": "127.0.0.9:8080"}
    path = inventory(tmp_path, "balancers = [('lb1', {'role': 'balancer', 'ssh_hostname': '127.0.0.9'})]\n"
                     + _group("pair", ["n1", "n2"], 3, model=L70, weights="fp8", multi_node=True, gpu=ONE_H100,
                              pip_index_url="http://127.0.0.1:9/simple/", balancer=lb))  # fmt: skip
    loaded = load_for_planning(path)
    fleet = build_fleet_plan(loaded)
    (config,) = fleet_configs(loaded, {o.spec.name: o.plan for o in fleet.outcomes})
    servers = [(s.host, s.instance) for b in config.backends for s in b.servers]
    assert servers == [("n1", "vllm-0")]
    assert [(t.host, t.port) for t in targets_from_outcomes(fleet.outcomes, loaded)] == [("n1", 8000)]


@pytest.mark.parametrize(
    ("changed", "serving", "rolled", "failed"),
    [
        (["n1", "n2"], ["n1", "n2", "n3"], ["n1", "n2"], {}),
        # only the leader's files changed: the worker's host is rolled with it (one unit)
        (["n1"], ["n1", "n2", "n3"], ["n1", "n2"], {}),
        (["n2"], ["n1", "n2"], ["n1", "n2"], {}),
        (["n3"], ["n1", "n2", "n3"], ["n3"], {}),  # n3 serves nothing of the pair: alone
        # the worker's host did not get through the deploy: the leader's host is held back, named
        (["n1"], ["n1", "n3"], [], {"n1": "node host(s) n2 did not get through this deploy (n2: failed)"}),
    ],
)
def test_a_deploy_rolls_every_node_host_of_a_changed_instance_or_none(
    plans: dict[str, HostPlan], changed: list[str], serving: list[str], rolled: list[str], failed: dict[str, str]
) -> None:
    from fleet.deploy.runner import HostResult, _whole_instances

    results = {h: HostResult(h, "failed" if h not in serving else "changed") for h in ("n1", "n2", "n3")}
    steps: list[tuple[str, str]] = []
    got = _whole_instances(changed, serving, plans, results, lambda host, what: steps.append((host, what)))
    assert got == rolled
    for host, why in failed.items():
        assert results[host].status == "failed" and why in (results[host].error or ""), results[host]
        assert "instance spanning n1, n2 (leader n1) is rolled as one unit" in (results[host].error or "")
    assert {h for h, _ in steps} == set(failed)
