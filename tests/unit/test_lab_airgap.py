"""The lab's air gap: the nft rules (pure) and, where nft and root are here, that nft takes them."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from fleetlab import airgap
from fleetlab.airgap import Endpoint, HostRule
from fleetlab.errors import LabError

HOSTS = [
    HostRule("lab-1", "127.0.120.11", "unified/fleet-lab/lab-1", 2),
    HostRule("lab-2", "127.0.120.12", "fleet-lab/lab-2", 2),
]
ALLOWED = [Endpoint("127.0.0.1", 35423)]


def test_ruleset_sends_each_hosts_packets_to_its_own_chain() -> None:
    text = airgap.ruleset("t-1", HOSTS, ALLOWED)
    assert text.startswith("table inet fleet_lab_t_1\ndelete table inet fleet_lab_t_1\n")
    assert 'socket cgroupv2 level 2 "unified/fleet-lab/lab-1" jump host_0' in text
    assert 'socket cgroupv2 level 2 "fleet-lab/lab-2" jump host_1' in text
    chain = text[text.index("chain host_0") : text.index("chain host_1")]
    rules = [line.strip() for line in chain.splitlines()[1:] if line.strip() not in ("", "}")]
    assert rules == [
        "ct state established,related accept",
        "ip daddr 127.0.120.11 accept",
        "ip daddr 127.0.0.1 tcp dport 35423 accept",
        "counter reject with icmpx admin-prohibited",
    ]


def test_ruleset_opens_only_the_peer_ports_between_the_labs_hosts() -> None:
    text = airgap.ruleset("t-1", [*HOSTS, HostRule("lab-3", "::1", "fleet-lab/lab-3", 2)], ALLOWED, (7470, 29501))
    chain = text[text.index("chain host_1") : text.index("chain host_2")]
    rules = [line.split("#")[0].strip() for line in chain.splitlines()[1:] if line.strip() not in ("", "}")]
    assert rules == [
        "ct state established,related accept",
        "ip daddr 127.0.120.12 accept",
        "ip daddr 127.0.0.1 tcp dport 35423 accept",
        "ip daddr { 127.0.120.11 } tcp dport { 7470, 29501 } accept",  # not itself, not another port
        "ip6 daddr { ::1 } tcp dport { 7470, 29501 } accept",
        "counter reject with icmpx admin-prohibited",
    ]
    assert "tcp dport {" not in airgap.ruleset("t-1", HOSTS, ALLOWED)  # no peer ports: nothing opened
    assert 7470 in airgap.PEER_PORTS  # fleet's staging port (DEFAULT_STAGING_PORT)


def test_hosts_of_a_lab_reach_each_other_only_on_the_peer_ports() -> None:
    """An instance spanning lab hosts: the rendezvous port (and any other listed), to the other
    hosts only; nothing of theirs else, and no peer rule without ports."""
    text = airgap.ruleset("t-1", HOSTS, ALLOWED, peer_ports=(29501, 7001, 29501))
    second = text[text.index("chain host_1") :]
    assert "ip daddr { 127.0.120.11 } tcp dport { 7001, 29501 } accept" in second
    assert "127.0.120.12 tcp dport" not in second  # its own address is allowed whole already
    assert "dport {" not in airgap.ruleset("t-1", HOSTS, ALLOWED, peer_ports=())
    assert 29501 in airgap.PEER_PORTS  # vLLM's default master_port


def test_ruleset_of_an_ipv6_index_and_no_hosts() -> None:
    text = airgap.ruleset("lab", [HostRule("h", "::1", "fleet-lab/h", 2)], [Endpoint("fd00::5", 8080)])
    assert "ip6 daddr ::1 accept" in text and "ip6 daddr fd00::5 tcp dport 8080 accept" in text
    empty = airgap.ruleset("lab", [], ALLOWED)
    assert "jump" not in empty and "type filter hook output" in empty


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://127.0.0.1:35423/simple/", "127.0.0.1:35423"),
        ("http://127.0.0.1:35423/apt/", "127.0.0.1:35423"),
        ("http://localhost:9000/simple/", "127.0.0.1:9000"),
        ("https://10.0.0.5/simple/", "10.0.0.5:443"),
        ("http://[fd00::5]:8080/simple/", "[fd00::5]:8080"),
    ],
)
def test_endpoint_of(url: str, endpoint: str) -> None:
    assert str(airgap.endpoint_of(url)) == endpoint
    assert Endpoint.parse(endpoint) == airgap.endpoint_of(url)


def test_an_index_by_name_cannot_be_allowed() -> None:
    with pytest.raises(LabError, match=r"allows addresses, not names.*--no-air-gap"):
        airgap.endpoint_of("https://index.internal/simple/")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_nft_accepts_the_rules(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``nft -c`` (check only, nothing loaded) on rules naming a real cgroup v2 directory."""
    root = airgap.cgroup2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy here")
    group = root / "fleet-lab-unit-test" / f"h{os.getpid()}"
    group.mkdir(parents=True)
    try:
        rule = airgap.host_rule("h", "127.0.120.11", group)
        assert rule.level == 2
        peer = airgap.HostRule("p", "127.0.120.12", rule.cgroup, rule.level)
        text = airgap.ruleset(f"unit-test-{os.getpid()}", [rule, peer], ALLOWED, airgap.PEER_PORTS)
        done = subprocess.run(["nft", "-c", "-f", "-"], input=text, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    finally:
        group.rmdir()
        group.parent.rmdir()
