"""``fleet stage --fanout`` over 8 lab hosts (issue 22, part 5): a lab of its own, bare hosts (no
driver: staging needs none), every holder sending to one new host per round at the per-link limit.
The session's shared lab has 3 hosts, too few to show the tree's doubling; the tree's shape for any
host count is table-tested in tests/unit/test_fanout_tree.py."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fleetlab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .test_stage_lab import (
    LINK_MIB_S,
    MODEL,
    REPO,
    host_sums,
    make_checkpoint,
    on,
    service_users,
    stage_body,
    staging_inventory,
    sums_of,
)

pytestmark = pytest.mark.lab

HOSTS = 8


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("fanout8-lab")
    octet = free_octet(os.getpid() + 53, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pf{os.getpid()}", octet, HOSTS, ("rtx4090-2",)), bare=True)
    try:
        yield LabFleet(opts, bring_up(opts))
    finally:
        lab_ops.down(opts.name, opts.state_root)


def test_fanout_over_eight_hosts_doubles_the_holders_each_round(eight: LabFleet, tmp_path: Path) -> None:
    """From one source (this machine) to 8 hosts in ceil(log2(8 + 1)) = 4 rounds: in each round every
    holder (the source included) sends to at most one new host, so the holders at most double; every
    copy is verified on its host; every sender keeps to its egress limit; most copies go host to host
    (through the air gap's staging port), not from this machine."""
    top = make_checkpoint(tmp_path / "src")
    want = sums_of(top)
    size = sum((top / p).stat().st_size for p in want)
    limit = LINK_MIB_S * 1024 * 1024
    inventory = staging_inventory(eight, tmp_path / "inventory.py", tmp_path / "src",
                                  staging={"egress_mib_s": LINK_MIB_S})  # fmt: skip
    names = [h.name for h in eight.state.hosts]
    assert len(names) == HOSTS
    service_users(eight)
    rc, body, err = stage_body(inventory, "--fanout")
    assert rc == 0 and body["ok"], (body, err)
    hosts = {h["host"]: h for h in body["hosts"]}
    revision = str(hosts[names[0]]["revision"])
    bound = math.ceil(math.log2(HOSTS + 1))
    assert bound == 4
    assert body["bounds"] == [{"model": MODEL, "revision": revision, "hosts": HOSTS, "holders": 1, "rounds": bound}]
    assert len(body["rounds"]) == bound, body["rounds"]
    holders = {"(control)"}
    for n, sends in enumerate(body["rounds"], start=1):
        senders = [s["from"] for s in sends]
        assert len(senders) == len(set(senders)), sends  # one copy per sender per round
        assert set(senders) <= holders, (n, senders, holders)  # only hosts that already hold a copy send
        for s in sends:
            assert s["status"] == "staged" and s["to"] not in holders, s
            assert s["rate_limit"] == limit and s["sent_bytes"] == size, s
            assert s["sent_bytes"] / s["seconds"] <= limit * 1.05, s  # the sender kept to its limit
        holders |= {s["to"] for s in sends}
        assert len(holders) - 1 <= 2**n - 1, (n, holders)  # at most doubling (the source counted)
    assert holders == {"(control)", *names}
    from_hosts = [s for r in body["rounds"] for s in r if s["from"] != "(control)"]
    assert len(from_hosts) >= HOSTS - bound, body["rounds"]  # the source sends once per round at most
    for i in range(HOSTS):
        assert host_sums(eight, i, revision) == want, names[i]
        rc, out, _err = on(eight, i, f"sudo cat {REPO}/refs/main")
        assert rc == 0 and out.strip() == revision, (names[i], out)
