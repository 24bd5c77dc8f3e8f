"""A balancer on this machine (``on: local``) as ``fleet deploy`` drives it, against a real HAProxy
(Debian's) on loopback in front of two real HTTP servers: the configuration is checked and written
once, a server the new configuration drops is taken out of traffic first (its open request
finishes, nothing new reaches it), and the reload keeps the runtime state of the servers that stay
(``ready`` although the configuration writes every server ``disabled``)."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fleet.inventory.spec import BalancerSpec
from fleet.lb import local
from fleet.lb.config import Backend, BalancerConfig, Server, reconfigure, render_config
from fleet.lb.runtime import AdminState
from fleet.lb.traffic import Balancer, retire
from fleet.lb.transport import LocalSocket

pytestmark = pytest.mark.lab


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/slow"):
            time.sleep(2.5)
        body = self.server.server_address[1].to_bytes(2, "big").hex().encode()  # which server answered
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def backends() -> Iterator[list[ThreadingHTTPServer]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield servers
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def _wait(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_a_dropped_server_leaves_traffic_first_and_a_reload_keeps_the_others_state(
    tmp_path: Path, backends: list[ThreadingHTTPServer]
) -> None:
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        if os.environ.get("FLEET_LAB_REQUIRED") == "1":
            pytest.fail("FLEET_LAB_REQUIRED=1 but haproxy is not installed", pytrace=False)
        pytest.skip("haproxy is not installed (scripts/install.sh installs it)")
    front = _free_port()
    spec = BalancerSpec("haproxy", "local", f"127.0.0.1:{front}", str(tmp_path / "admin.sock"),
                        str(tmp_path / "haproxy.cfg"), "chat", 5.0)  # fmt: skip
    a, b = (Server(h, "vllm-0", "127.0.0.1", s.server_address[1]) for h, s in zip("ab", backends, strict=True))
    both = BalancerConfig(spec, (Backend("chat", spec.bind, (a, b)),))
    assert local.write_config(both, render_config(both, "inv.py", written_by="fleet deploy"))
    assert not local.write_config(both, render_config(both, "inv.py", written_by="fleet deploy"))  # unchanged
    log = open(tmp_path / "haproxy.log", "wb")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen([local.haproxy_binary(), "-W", "-db", "-f", spec.config], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    balancer = Balancer(spec, LocalSocket(spec.admin_socket, 5.0))
    try:
        assert _wait(lambda: Path(spec.admin_socket).exists(), 15)
        views = balancer.snapshot(fresh=True)
        assert {v.admin for v in views.values()} == {AdminState.MAINT}  # written disabled
        balancer.set_state("chat", "b:vllm-0", AdminState.READY)
        assert _wait(lambda: balancer.snapshot(fresh=True)[("chat", "b:vllm-0")].view == "UP", 20)
        # a long request on b, then b is dropped: it leaves traffic, its request finishes
        answer: dict[str, tuple[int, str]] = {}
        slow = threading.Thread(target=lambda: answer.setdefault("slow", _get(front, "/slow")))
        slow.start()
        assert _wait(lambda: balancer.snapshot(fresh=True)[("chat", "b:vllm-0")].sessions == 1, 5)
        balancer.set_state("chat", "a:vllm-0", AdminState.READY)
        assert _wait(lambda: balancer.snapshot(fresh=True)[("chat", "a:vllm-0")].view == "UP", 20)
        only_a = BalancerConfig(spec, (Backend("chat", spec.bind, (a,)),))
        plan = reconfigure(only_a, balancer.servers_state(), {"a"})
        assert plan.retired == (("chat", "b:vllm-0"),) and plan.added == () and plan.kept == ()
        t0 = time.monotonic()
        assert retire(balancer, plan.retired, 20) == []
        waited = time.monotonic() - t0
        slow.join(10)
        assert answer["slow"][0] == 200  # the open request finished
        assert waited > 0.5, waited  # it waited for that session
        assert balancer.snapshot(fresh=True)[("chat", "b:vllm-0")].admin is AdminState.MAINT
        assert all(_get(front, "/")[1] == f"{a.port:04x}" for _ in range(5))  # nothing new reaches b
        # the configuration without b, reloaded: a stays ready (its runtime state), b is gone
        assert local.write_config(plan.config, render_config(plan.config, "inv.py", written_by="fleet deploy"))
        local.reload(plan.config)
        states = {(s.backend, s.server): s for s in balancer.servers_state()}
        assert list(states) == [("chat", "a:vllm-0")]
        assert states[("chat", "a:vllm-0")].admin is AdminState.READY, states
        assert _get(front, "/") == (200, f"{a.port:04x}")
        assert proc.poll() is None  # the same master: a reload, not a restart
    finally:
        balancer.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        log.close()
