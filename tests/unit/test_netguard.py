"""The test run's network guard (``fleetlab/netguard.py``, ``tests/conftest.py``).

Pure parts as tables (the rules, reading nft's listing, this machine's package sources); then the
guard itself, live where root, nft and cgroup v2 are here: a connection to a documentation
address (RFC 5737 TEST-NET-2, RFC 3849) fails at once in-process and from subprocesses (Python,
OpenSSH, ``fleet plan``), the guard records it, loopback still works, and a test whose subprocess
swallowed the error still fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from pytest_socket import SocketConnectBlockedError

from fleetlab import netguard
from fleetlab.netguard import Allowance, Source

REPO = Path(__file__).resolve().parents[2]
#: RFC 5737 TEST-NET-2: documentation only, never a real host (TEST-NET-1 is this machine's own subnet on some CI).
ELSEWHERE = "198.51.100.1"
ELSEWHERE6 = "2001:db8::1"  # RFC 3849


# -- pure -----------------------------------------------------------------------------------------


def test_ruleset_matches_the_cgroup_and_refuses_all_but_loopback_and_the_allowed() -> None:
    allowed = [
        Allowance("10.255.255.53", 53, ("udp", "tcp"), "nameserver"),
        Allowance("203.0.113.80", 443, ("tcp",), "pip index-url https://mirror.example"),
        Allowance("2001:db8::80", 80, ("tcp",), "apt mirror"),
    ]
    text = netguard.ruleset("fleet_guard_42", "unified/user.slice/fleet-guard-42", 3, allowed)
    assert text.startswith("table inet fleet_guard_42\ndelete table inet fleet_guard_42\n")
    assert "type filter hook output priority -3; policy accept;" in text  # deeper guards see packets first
    assert 'socket cgroupv2 level 3 "unified/user.slice/fleet-guard-42" jump guard' in text
    chain = text[text.index("chain guard") :]
    rules = [line.split("#")[0].strip() for line in chain.splitlines()[1:] if line.strip() not in ("", "}")]
    assert rules == [
        "ip daddr 127.0.0.0/8 accept",
        "ip6 daddr ::1 accept",
        "ip daddr 10.255.255.53 meta l4proto { udp, tcp } th dport 53 accept",
        "ip daddr 203.0.113.80 tcp dport 443 accept",
        "ip6 daddr 2001:db8::80 tcp dport 80 accept",
        "meta nfproto ipv4 add @refused4 { ip daddr . meta l4proto . th dport counter }",
        "meta nfproto ipv6 add @refused6 { ip6 daddr . meta l4proto . th dport counter }",
        f'limit rate 10/second burst 20 packets log prefix "{netguard.LOG_PREFIX}" level warn',
        "counter reject with icmpx admin-prohibited",
    ]


#: What ``nft -j list table`` printed for a guard after two refused IPv4 and one IPv6 connects
#: (nftables 1.0.6; the accept rules left out).
LISTING = json.loads("""{"nftables": [
 {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}},
 {"set": {"family": "inet", "name": "refused4", "table": "fleet_guard_1",
          "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 3, "size": 65535,
          "elem": [{"elem": {"val": {"concat": ["198.51.100.1", "tcp", 22]},
                             "counter": {"packets": 2, "bytes": 120}}}],
          "stmt": [{"counter": null}]}},
 {"set": {"family": "inet", "name": "refused6", "table": "fleet_guard_1",
          "type": ["ipv6_addr", "inet_proto", "inet_service"], "handle": 4, "size": 65535,
          "elem": [{"elem": {"val": {"concat": ["2001:db8::1", "tcp", 443]},
                             "counter": {"packets": 2, "bytes": 160}}}],
          "stmt": [{"counter": null}]}},
 {"rule": {"family": "inet", "table": "fleet_guard_1", "chain": "guard", "handle": 10,
           "expr": [{"set": {"op": "add", "set": "@refused4", "elem": {"concat": [
               {"payload": {"protocol": "ip", "field": "daddr"}}, {"meta": {"key": "l4proto"}},
               {"payload": {"protocol": "th", "field": "dport"}}]}}}]}},
 {"rule": {"family": "inet", "table": "fleet_guard_1", "chain": "guard", "handle": 12,
           "expr": [{"limit": {"rate": 10, "burst": 20, "per": "second"}},
                    {"log": {"prefix": "fleet-guard refused: "}}]}},
 {"rule": {"family": "inet", "table": "fleet_guard_1", "chain": "guard", "handle": 13,
           "expr": [{"counter": {"packets": 4, "bytes": 280}},
                    {"reject": {"type": "icmpx", "expr": "admin-prohibited"}}]}}
]}""")


def test_parse_listing_reads_the_reject_counter_and_each_destination() -> None:
    total, refused = netguard.parse_listing(LISTING)
    assert total == 4
    assert refused == {("198.51.100.1", "tcp", 22): 2, ("2001:db8::1", "tcp", 443): 2}
    assert netguard.parse_listing({"nftables": []}) == (0, {})


@pytest.mark.parametrize(
    ("before", "now", "expected"),
    [
        ({}, {("198.51.100.1", "tcp", 22): 2}, ["198.51.100.1 tcp/22 (2 packets)"]),
        ({("198.51.100.1", "tcp", 22): 2}, {("198.51.100.1", "tcp", 22): 2}, []),  # nothing new
        ({("198.51.100.1", "tcp", 22): 2}, {("198.51.100.1", "tcp", 22): 3}, ["198.51.100.1 tcp/22 (1 packet)"]),
        ({}, {("2001:db8::1", "udp", 53): 1}, ["[2001:db8::1] udp/53 (1 packet)"]),
    ],
)
def test_news_are_destinations_new_or_refused_again(
    before: dict[tuple[str, str, int], int], now: dict[tuple[str, str, int], int], expected: list[str]
) -> None:
    assert [str(r) for r in netguard.news(before, now)] == expected


def test_pip_config_urls() -> None:
    listing = textwrap.dedent("""\
        :env:.find-links='/opt/wheels'
        :env:.index-url='https://mirror.example/simple'
        global.cert='/etc/ssl/certs/ca-certificates.crt'
        global.extra-index-url='file:///opt/pypi/simple https://other.example:8443/simple'
        global.proxy='proxy.example:3128'
        """)
    assert netguard.pip_config_urls(listing) == [
        ("find-links", "/opt/wheels"),
        ("index-url", "https://mirror.example/simple"),
        ("extra-index-url", "file:///opt/pypi/simple"),
        ("extra-index-url", "https://other.example:8443/simple"),
        ("proxy", "http://proxy.example:3128"),
    ]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://mirror.example/simple", ("mirror.example", 443)),
        ("http://deb.example/debian", ("deb.example", 80)),
        ("https://other.example:8443/simple", ("other.example", 8443)),
        ("http://[2001:db8::5]:8080/", ("2001:db8::5", 8080)),
        ("file:///opt/pypi/simple", None),
        ("/opt/wheels", None),
    ],
)
def test_url_source(url: str, expected: tuple[str, int] | None) -> None:
    source = netguard.url_source(url, "why")
    assert (None if source is None else (source.host, source.port)) == expected


def test_parse_nameservers() -> None:
    text = "# generated\nnameserver 10.255.255.53\nnameserver fe80::1%eth0\nsearch example\nnameserver bogus\n"
    assert netguard.parse_nameservers(text) == ["10.255.255.53", "fe80::1"]


def test_allowances_resolve_sources_and_skip_loopback() -> None:
    table = {"mirror.example": ["203.0.113.80", "2001:db8::80"], "files.example": ["203.0.113.80"]}

    def resolve(host: str, port: int) -> list[str]:
        if host == "nowhere.example":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table.get(host, ["127.0.0.53"])

    sources = [
        Source("mirror.example", 443, "pip index-url https://mirror.example"),
        Source("files.example", 443, "pip's default index https://files.example"),
        Source("localhost-proxy", 3128, "http_proxy"),  # resolves to loopback: allowed anyway
        Source("nowhere.example", 80, "apt mirror"),
    ]
    allowed, problems = netguard.allowances(sources, ["10.255.255.53", "127.0.0.53"], resolve)
    assert [str(a) for a in allowed] == [
        "10.255.255.53 udp,tcp/53 (nameserver)",
        "203.0.113.80 tcp/443 (pip index-url https://mirror.example, pip's default index https://files.example)",
        "[2001:db8::80] tcp/443 (pip index-url https://mirror.example)",
    ]
    assert problems == ["nowhere.example (apt mirror): [Errno -2] Name or service not known"]


def test_package_sources_come_from_this_machines_configuration() -> None:
    env = {"FLEET_LAB_MIRROR": "http://deb.example:8080/debian", "https_proxy": "p.example:3128"}
    sources = netguard.package_sources(env)
    by_why = {s.why.split(" http")[0]: (s.host, s.port) for s in sources}
    assert by_why["apt mirror for debootstrap"] == ("deb.example", 8080)
    assert by_why["https_proxy"] == ("p.example", 3128)
    assert any(s.why.startswith("pip") for s in sources)  # pip's configuration or its own default index


# -- live -----------------------------------------------------------------------------------------


def test_in_process_a_connect_outside_loopback_is_blocked_at_the_call() -> None:
    with pytest.raises(SocketConnectBlockedError, match=ELSEWHERE):
        socket.create_connection((ELSEWHERE, 22), timeout=30)
    with socket.socket() as listener:  # loopback works
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        socket.create_connection(listener.getsockname(), timeout=5).close()


CONNECT = """
import errno, socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.settimeout(30)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, exc))
"""


def _connect(address: str, port: int) -> str:
    command = [sys.executable, "-c", CONNECT, address, str(port)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_subprocess_is_refused_at_once_and_the_guard_records_it(net_guard: netguard.Guard) -> None:
    # refused, not dropped: a connect with a 30 s timeout ends with an error, not a timeout
    assert _connect(ELSEWHERE, 22) == "EHOSTUNREACH"
    assert _connect(ELSEWHERE6, 443) == "EACCES"
    udp = f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{ELSEWHERE}', 53))"
    sent = subprocess.run([sys.executable, "-c", udp], capture_output=True, text=True, timeout=60)
    assert sent.returncode == 1 and "PermissionError" in sent.stderr
    refused, packets = net_guard.news()
    assert {(r.address, r.protocol, r.port) for r in refused} == {
        (ELSEWHERE, "tcp", 22), (ELSEWHERE6, "tcp", 443), (ELSEWHERE, "udp", 53)
    }  # fmt: skip
    assert packets >= 3
    assert net_guard.news() == ([], 0)  # read: no longer this test's failure


def test_loopback_is_reachable_from_a_subprocess(net_guard: netguard.Guard) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.250.1", 0))
        listener.listen(1)
        assert _connect("127.0.250.1", listener.getsockname()[1]) == "connected"
    assert _connect("127.0.250.1", 1) == "ECONNREFUSED"  # nothing listens: the host's own refusal
    assert net_guard.news() == ([], 0)


def test_openssh_and_fleet_plan_are_refused(net_guard: netguard.Guard, tmp_path: Path) -> None:
    ssh = subprocess.run(
        ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "StrictHostKeyChecking=yes",
         "-o", f"UserKnownHostsFile={tmp_path / 'known_hosts'}", f"fleet@{ELSEWHERE}", "true"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ssh.returncode == 255 and "No route to host" in ssh.stderr, ssh.stderr
    inventory = tmp_path / "inventory.py"
    inventory.write_text(
        f"hosts = ([('gpu-01', {{'ssh_hostname': '{ELSEWHERE}'}})], "
        "{'model': 'meta-llama/Llama-3.1-8B-Instruct', 'gpu': {'sku': 'l40s-48gb', 'count': 4},\n"
        "  'workload': {'p95_input_tokens': 2048, 'p95_output_tokens': 512, 'prefix_reuse': 0.5,\n"
        "               'target_concurrency': 16}})\n"
    )
    plan = subprocess.run([sys.executable, "-m", "fleet.cli", "plan", str(inventory), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    not_probed = json.loads(plan.stdout)["not_probed"]
    assert not_probed["gpu-01"].startswith(f"not probed: cannot reach {ELSEWHERE}:22"), not_probed
    refused, _packets = net_guard.news()
    assert {(r.address, r.port) for r in refused} == {(ELSEWHERE, 22)}


INNER_TEST = f"""
import subprocess, sys

def test_swallows_a_refused_connect_in_a_subprocess():
    code = ("import socket\\ntry:\\n    socket.create_connection(('{ELSEWHERE}', 22), timeout=30)\\n"
            "except OSError:\\n    pass")
    subprocess.run([sys.executable, "-c", code], check=True)

def test_stays_on_loopback():
    subprocess.run([sys.executable, "-c", "import socket; socket.socket().connect_ex(('127.0.0.1', 1))"], check=True)
"""


def _outer_env() -> dict[str, str]:
    """This session's environment for a nested pytest session, less ``PYTEST_ADDOPTS``: the outer
    run's options (``--junitxml=REPORT`` for ``scripts/test-seconds``) are not the inner one's (a
    session run as nobody could not write that report)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}


def test_a_test_whose_subprocess_was_refused_fails(net_guard: netguard.Guard, tmp_path: Path) -> None:
    """A pytest session (nested in this one's guard) fails the test whose subprocess connected
    elsewhere, although the subprocess swallowed the error, and passes the other."""
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    env = {**_outer_env(), "PYTHONPATH": str(REPO)}
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-v",
         "--allow-hosts=127.0.0.0/8,::1,localhost", str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = inner.stdout + inner.stderr
    assert inner.returncode == 1, out
    assert "net guard, subprocesses: cgroup" in out, out  # the inner session's own guard, in its header
    assert "test_inner.py::test_stays_on_loopback PASSED" in out, out
    assert "ERROR at teardown of test_swallows_a_refused_connect_in_a_subprocess" in out, out
    assert f"refused: {ELSEWHERE} tcp/22" in out, out
    assert net_guard.news() == ([], 0)  # the inner guard saw it first; nothing reached this one's
    # the inner session's cgroup (nested in this guard's) is gone; other sessions' are not this test's business
    assert not list(net_guard.cgroup.glob(f"{netguard.CGROUP_PREFIX}*"))


INNER_IN_PROCESS = f"""
import socket
import pytest
from pytest_socket import SocketConnectBlockedError

def test_in_process_guard_still_refuses():
    with pytest.raises(SocketConnectBlockedError):
        socket.create_connection(("{ELSEWHERE}", 22), timeout=30)
"""


def _without_nft_on_path() -> dict[str, str]:
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "nft").exists()]
    return {**_outer_env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), *path])}


@pytest.mark.parametrize("how", ["no nft", "not root"])
def test_without_nft_or_root_the_guard_is_in_process_only_and_says_so(how: str) -> None:
    """Where the subprocess guard cannot go up, the session still runs, with pytest-socket, and the
    header says why."""
    env = {**_without_nft_on_path(), "PYTHONPATH": str(REPO)}
    prefix: list[str] = []
    if how == "not root":
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            pytest.skip("needs root and setpriv to run a session as nobody")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        env = {**_outer_env(), "PYTHONPATH": str(REPO), "HOME": "/tmp"}
    work = Path(tempfile.mkdtemp(prefix="netguard-inner-"))  # readable by nobody, unlike tmp_path
    try:
        work.chmod(0o755)
        (work / "test_inner.py").write_text(INNER_IN_PROCESS)
        (work / "test_inner.py").chmod(0o644)
        inner = subprocess.run(
            [*prefix, sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-v",
             "--basetemp", str(work / "tmp"), "--allow-hosts=127.0.0.0/8,::1,localhost", str(work / "test_inner.py")],
            capture_output=True, text=True, timeout=300, cwd=work, env=env,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = inner.stdout + inner.stderr
    assert inner.returncode == 0, out
    why = "not root" if how == "not root" or os.geteuid() != 0 else "nft is not installed"
    assert f"net guard, subprocesses: OFF, in-process guard only: {why}" in out, out
    assert "net guard, in-process: socket.connect() only to 127.0.0.0/8,::1,localhost (pytest-socket)" in out, out
    assert "test_in_process_guard_still_refuses PASSED" in out, out


def test_nft_accepts_the_rules_and_the_guard_goes_away(net_guard: netguard.Guard) -> None:
    """The session's own table is loaded with the rules ``ruleset`` writes; a guard put up and taken
    down again (in a child process) leaves no table and no cgroup."""
    listed = subprocess.run(["nft", "list", "table", "inet", net_guard.table], capture_output=True, text=True)
    assert listed.returncode == 0 and "jump guard" in listed.stdout, listed.stderr
    code = (
        "import json; from fleetlab import netguard; g = netguard.up(); "
        "print(json.dumps([g.table, str(g.cgroup)])); g.down()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    table, cgroup = json.loads(done.stdout)
    assert not Path(cgroup).exists()
    assert subprocess.run(["nft", "list", "table", "inet", table], capture_output=True).returncode != 0


def test_a_gevent_patched_session_is_refused_at_collection(tmp_path: Path) -> None:
    """pyinfra_cli monkey-patches the interpreter with gevent on import; a test module that imports
    it would turn the session's threads into greenlets (and hang the first server thread that
    blocks), so the session stops after collection and says why."""
    (tmp_path / "test_imports_pyinfra_cli.py").write_text(
        "from pyinfra_cli.util import parse_cli_arg\n\ndef test_x():\n    assert parse_cli_arg('1') == 1\n"
    )
    env = {**_outer_env(), "PYTHONPATH": str(REPO)}
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--allow-hosts=127.0.0.0/8,::1,localhost", str(tmp_path / "test_imports_pyinfra_cli.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = inner.stdout + inner.stderr
    assert inner.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "after collecting the tests, the interpreter is gevent-patched" in out, out
