"""A balancer host's operations against recorded facts (packages, configuration checked before it
replaces the live one, the state-saving drop-in, a hitless reload), and the pure merge of a deploy's
plans with what HAProxy runs (``fleet.lb.config.reconfigure``)."""

from __future__ import annotations

import base64
import hashlib
import shlex

import pytest
from pyinfra.facts.files import Sha1File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from fleet.facts.packages import DebPackageStates
from fleet.inventory.spec import BalancerSpec
from fleet.lb.config import SYSTEMD_DROPIN, Backend, BalancerConfig, Server, reconfigure, render_config, systemd_dropin
from fleet.lb.runtime import ServerState
from fleet.operations import balancer

from .opharness import Value, key, run_op

SPEC = BalancerSpec("haproxy", "lb-01", "0.0.0.0:8080", "/run/haproxy/admin.sock", "/etc/haproxy/haproxy.cfg", "chat")
CONFIG = BalancerConfig(SPEC, (Backend("chat", "0.0.0.0:8080", (Server("gpu-1", "vllm-0", "10.0.0.1", 8000),)),))
TEXT = render_config(CONFIG, "inventory/prod.py", written_by="fleet deploy")
DROPIN = systemd_dropin(SPEC.admin_socket, CONFIG.state_file, SPEC.config)
SVC = "haproxy.service"


def _sha(text: str, path: str) -> list[str]:
    return [f"{hashlib.sha1(text.encode()).hexdigest()}  {path}"]


def facts(config: str | None, dropin: str | None, running: bool, enabled: bool) -> dict:
    return {
        key(Sha1File, path=SPEC.config): _sha(config, SPEC.config) if config is not None else [],
        key(Sha1File, path=SYSTEMD_DROPIN): _sha(dropin, SYSTEMD_DROPIN) if dropin is not None else [],
        key(SystemdStatus, services=[SVC]): Value({SVC: running}),
        key(SystemdEnabled, services=[SVC]): Value({SVC: enabled}),
    }


def _configure(f: dict) -> list[str]:
    return run_op(balancer.configuration, f, path=SPEC.config, text=TEXT, dropin=DROPIN).texts


def test_packages_from_the_hosts_own_sources_once() -> None:
    run = run_op(balancer.packages, {key(DebPackageStates): ["bash\t5.2-1\tinstall ok installed"]})
    assert run.texts[0] == "apt-get update"  # no source of fleet's: the host's own mirror
    assert shlex.split(run.texts[1])[-2:] == ["haproxy", "socat"]
    assert "DEBIAN_FRONTEND=noninteractive" in run.texts[1] and "--no-install-recommends" in run.texts[1]
    rows = ["haproxy\t2.6.12-1+deb12u4\tinstall ok installed", "socat\t1.7.4.4-2\tinstall ok installed"]
    again = run_op(balancer.packages, {key(DebPackageStates): rows})
    assert again.texts == [] and again.noops == ["haproxy and socat are installed"]
    one = run_op(balancer.packages, {key(DebPackageStates): rows[:1]})
    assert shlex.split(one.texts[1])[-1] == "socat"


def test_a_fresh_host_gets_the_dropin_the_checked_configuration_and_a_restart() -> None:
    run = run_op(balancer.configuration, facts(None, None, False, False), path=SPEC.config, text=TEXT, dropin=DROPIN)
    texts = run.texts
    assert shlex.split(texts[0])[3:] == ["fleet-write", "/etc/systemd/system/haproxy.service.d",
                                         "fleet-server-state.conf", "root:root", "644"]  # fmt: skip
    assert base64.b64decode(run.commands[0].stdin or "").decode() == DROPIN
    assert texts[1] == "systemctl daemon-reload"
    assert shlex.split(texts[2])[3:] == ["fleet-write", "/etc/haproxy", "haproxy.cfg.fleet-new", "root:root", "644"]
    assert base64.b64decode(run.commands[2].stdin or "").decode() == TEXT
    # HAProxy checks it before it replaces the live one
    assert texts[3:] == [
        "haproxy -c -q -f /etc/haproxy/haproxy.cfg.fleet-new",
        "mv -fT -- /etc/haproxy/haproxy.cfg.fleet-new /etc/haproxy/haproxy.cfg",
        "systemctl enable haproxy.service",
        "systemctl restart haproxy.service",  # Debian started it with its own configuration
    ]


def test_up_to_date_and_running_changes_nothing() -> None:
    run = run_op(balancer.configuration, facts(TEXT, DROPIN, True, True), path=SPEC.config, text=TEXT, dropin=DROPIN)
    assert run.texts == [] and run.noops == ["HAProxy's configuration is up to date and it runs"]


def test_a_new_configuration_on_a_running_balancer_is_a_reload() -> None:
    texts = _configure(facts("old text", DROPIN, True, True))
    assert texts[-3:] == [
        "haproxy -c -q -f /etc/haproxy/haproxy.cfg.fleet-new",
        "mv -fT -- /etc/haproxy/haproxy.cfg.fleet-new /etc/haproxy/haproxy.cfg",
        "systemctl reload haproxy.service",  # the drop-in saves the servers' state first
    ]
    assert not any("restart" in t for t in texts)


def test_a_new_dropin_alone_needs_no_reload() -> None:
    texts = _configure(facts(TEXT, "old drop-in", True, True))
    assert texts[1:] == ["systemctl daemon-reload"]
    assert "fleet-server-state.conf" in texts[0]


def test_a_stopped_balancer_is_started() -> None:
    assert _configure(facts(TEXT, DROPIN, False, True)) == ["systemctl restart haproxy.service"]


# ---- reconfigure: the plans against what HAProxy runs ----------------------------------------------


def st(server: str, port: int = 8000, backend: str = "chat", address: str = "10.0.0.9") -> ServerState:
    return ServerState(backend, server, address, 2, 0, port)


def planned(*servers: tuple[str, str, int]) -> BalancerConfig:
    return BalancerConfig(
        SPEC, (Backend("chat", "0.0.0.0:8080", tuple(Server(h, i, "10.0.0.1", p) for h, i, p in servers)),)
    )


@pytest.mark.parametrize(
    ("plans", "running", "inventory", "servers", "added", "kept", "retired"),
    [
        # a first install: everything planned is new
        ([("a", "vllm-0", 8000)], [], {"a"}, ["a:vllm-0"], ["a:vllm-0"], [], []),
        # a host added to the inventory: new, the other stays as planned
        ([("a", "vllm-0", 8000), ("b", "vllm-0", 8000)], [st("a:vllm-0")], {"a", "b"},
         ["a:vllm-0", "b:vllm-0"], ["b:vllm-0"], [], []),
        # a host removed from the inventory: retired (taken out of traffic before the reload)
        ([("a", "vllm-0", 8000)], [st("a:vllm-0"), st("gone:vllm-0"), st("gone:vllm-1", 8001)], {"a"},
         ["a:vllm-0"], [], [], ["gone:vllm-0", "gone:vllm-1"]),
        # a host this deploy did not plan (--limit, drained): kept with HAProxy's address and port
        ([("a", "vllm-0", 8000)], [st("a:vllm-0"), st("b:vllm-0", 8100), st("b:vllm-1", 8101)], {"a", "b"},
         ["a:vllm-0", "b:vllm-0", "b:vllm-1"], [], ["b:vllm-0", "b:vllm-1"], []),
        # a planned host with one instance fewer: that server is retired
        ([("a", "vllm-0", 8000)], [st("a:vllm-0"), st("a:vllm-1", 8001)], {"a"}, ["a:vllm-0"], [], [], ["a:vllm-1"]),
        # a server in a backend the configuration no longer has (the model was renamed): retired
        ([("a", "vllm-0", 8000)], [st("a:vllm-0", backend="old"), st("b:vllm-0", backend="old")], {"a", "b"},
         ["a:vllm-0"], ["a:vllm-0"], [], ["a:vllm-0", "b:vllm-0"]),
        # a server fleet did not name (no host:instance): retired, since the configuration is fleet's
        ([("a", "vllm-0", 8000)], [st("a:vllm-0"), st("web1")], {"a"}, ["a:vllm-0"], [], [], ["web1"]),
    ],
)  # fmt: skip
def test_reconfigure(
    plans: list[tuple[str, str, int]], running: list[ServerState], inventory: set[str], servers: list[str],
    added: list[str], kept: list[str], retired: list[str],
) -> None:  # fmt: skip
    r = reconfigure(planned(*plans), running, inventory)
    assert [s.name for b in r.config.backends for s in b.servers] == servers
    assert [s for _b, s in r.added] == added
    assert [s for _b, s in r.kept] == kept
    assert [s for _b, s in r.retired] == retired


def test_a_kept_server_keeps_its_address_and_port() -> None:
    r = reconfigure(planned(("a", "vllm-0", 8000)), [st("b:vllm-1", 8101, address="10.0.0.2")], {"a", "b"})
    kept = r.config.backends[0].servers[-1]
    assert (kept.host, kept.instance, kept.address, kept.port) == ("b", "vllm-1", "10.0.0.2", 8101)
    assert "server b:vllm-1 10.0.0.2:8101 disabled" in render_config(r.config, "inv.py")
