"""The fan-out's host-to-host copy (``fleet.weights.peer``) run here on loopback: the receiver takes
only the planned sender's address and token, the stream lands byte for byte, the sender keeps to
its egress limit; and the ``staging`` key at the inventory boundary."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleet.deploy.staging import fanout_limits, split_fanout
from fleet.errors import InventoryError
from fleet.facts.sshlink import SshTarget
from fleet.inventory.schema import StagingData
from fleet.inventory.spec import host_spec
from fleet.weights.fanout import MIB
from fleet.weights.peer import RECEIVE, SEND
from fleet.weights.stage import StageJob

BASE: dict[str, Any] = {
    "model": "acme/tiny-7b",
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}
RECEIVER, SENDER, STRANGER = "127.0.0.1", "127.0.0.2", "127.0.0.3"


def problems(extra: dict[str, Any]) -> list[str]:
    with pytest.raises(InventoryError) as err:
        host_spec("inv.py", "gpu-1", (), {**BASE, **extra})
    return [str(p) for p in err.value.problems]


def test_staging_defaults() -> None:
    spec = host_spec("inv.py", "gpu-1", (), BASE)
    assert (spec.staging.port, spec.staging.egress_mib_s, spec.staging.concurrency) == (7470, None, 16)
    assert spec.staging.fanout is False  # `fleet deploy` sends from this machine unless asked
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "staging": {"port": 9000, "egress_mib_s": 12.5, "fanout": True}})
    assert (spec.staging.port, spec.staging.egress_mib_s, spec.staging.fanout) == (9000, 12.5, True)


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"staging": {"port": 8001}, "gpu": {"sku": "h100-sxm-80gb", "count": 2, "nvlink": True}},
         "staging.port=8001: the host's instances listen on ports 8000..8001"),
        ({"staging": {"port": 2222}, "ssh_port": 2222}, "staging.port=2222: it is the host's ssh_port (2222)"),
        ({"staging": {"port": 29501}, "multi_node": True}, "staging.port=29501: it is the multi-node rendezvous port"),
        ({"staging": {"port": 80}}, "staging.port"),
        ({"staging": {"port": "7470"}}, "staging.port"),
        ({"staging": {"egress_mib_s": 0}}, "staging.egress_mib_s"),
        ({"staging": {"concurrency": 0}}, "staging.concurrency"),
        ({"staging": {"fanout": "yes"}}, "staging.fanout"),
        ({"staging": {"fanout": 1}}, "staging.fanout"),
        ({"staging": {"prot": 7470}},
         "staging.prot=7470: unknown key; allowed: port, egress_mib_s, concurrency, fanout"),
    ],
)  # fmt: skip
def test_bad_staging_is_named(extra: dict[str, Any], want: str) -> None:
    assert any(want in p for p in problems(extra)), problems(extra)


@pytest.mark.parametrize(
    ("settings", "parallel", "want"),
    [
        ([StagingData()], None, (None, 16)),
        ([StagingData(egress_mib_s=40.0, concurrency=8), StagingData(egress_mib_s=25.0)], None, (25.0 * MIB, 8)),
        ([StagingData(egress_mib_s=40.0), StagingData()], 3, (40.0 * MIB, 3)),
        ([StagingData(concurrency=2)], 5, (None, 2)),
    ],
)  # fmt: skip
def test_fanout_limits(settings: list[StagingData], parallel: int | None, want: tuple[float | None, int]) -> None:
    """This machine sends at the smallest egress limit of the hosts, as many at once as the smallest
    concurrency (``fleet stage --fanout`` and the deploy's staging phase read the same)."""
    assert fanout_limits(settings, parallel) == want


def test_split_fanout_follows_each_hosts_staging_fanout() -> None:
    jobs = [StageJob(SshTarget(n, "127.0.0.1", 22), "acme/tiny-7b", "/srv/models") for n in ("a", "b", "c")]
    staging = {"a": StagingData(fanout=True), "b": StagingData(), "c": StagingData(fanout=True)}
    tree, direct = split_fanout(jobs, staging)
    assert ([j.target.name for j in tree], [j.target.name for j in direct]) == (["a", "c"], ["b"])
    assert split_fanout(jobs, dict.fromkeys("abc", StagingData())) == ([], jobs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((RECEIVER, 0))
        return int(s.getsockname()[1])


def receiver(incoming: Path, files: list[tuple[str, int]], port: int, token: str) -> subprocess.Popen[str]:
    job = {"bind": RECEIVER, "port": port, "peer": SENDER, "token": token, "incoming": str(incoming),
           "files": [list(f) for f in files], "total": sum(s for _n, s in files),
           "wait_s": 30, "idle_s": 10}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", RECEIVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.close()
    proc.stdin = None  # type: ignore[assignment]  # written and closed: communicate() must not flush it
    assert proc.stdout.readline().strip() == "listening"
    return proc


def sender(snapshot: Path, files: list[str], port: int, token: str, rate: float | None, bind: str = SENDER) -> Any:
    job = {"bind": bind, "to": RECEIVER, "port": port, "token": token, "snapshot": str(snapshot),
           "files": files, "rate": rate, "chunk": 1 << 16, "idle_s": 10}  # fmt: skip
    return subprocess.run([sys.executable, "-c", SEND], input=json.dumps(job) + "\n", capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_only_the_planned_sender_with_the_token_is_taken_and_the_bytes_land(tmp_path: Path) -> None:
    snapshot, incoming = tmp_path / "snap", tmp_path / "incoming"
    (snapshot / "sub").mkdir(parents=True)
    incoming.mkdir()
    data = {"config.json": b"{}", "sub/model.safetensors": os.urandom(300_000)}
    for rel, b in data.items():
        (snapshot / rel).write_bytes(b)
    token, port = "ab" * 32, free_port()
    files = [("000000.partial", 2), ("000001.partial", 300_000)]
    proc = receiver(incoming, files, port, token)
    try:
        stranger = sender(snapshot, list(data), port, token, None, bind=STRANGER)  # right token, wrong address
        assert stranger.returncode != 0
        wrong = sender(snapshot, list(data), port, "cd" * 32, None)  # right address, wrong token
        assert wrong.returncode != 0
        assert not any(incoming.iterdir())  # nothing was written for either
        right = sender(snapshot, list(data), port, token, None)
        assert right.returncode == 0, right.stderr
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"refused {STRANGER}" in out and f"refused {SENDER}" in out and out.strip().endswith("done")
    assert (incoming / "000000.partial").read_bytes() == b"{}"
    assert (incoming / "000001.partial").read_bytes() == data["sub/model.safetensors"]
    assert (incoming / "000001.partial").stat().st_mode & 0o777 == 0o600


def test_the_sender_keeps_to_its_egress_limit_and_a_short_stream_fails_the_receiver(tmp_path: Path) -> None:
    snapshot, incoming = tmp_path / "snap", tmp_path / "incoming"
    snapshot.mkdir()
    incoming.mkdir()
    (snapshot / "w").write_bytes(os.urandom(1 << 20))
    token, port = "ef" * 32, free_port()
    proc = receiver(incoming, [("000000.partial", 1 << 20)], port, token)
    t0 = time.monotonic()
    sent = sender(snapshot, ["w"], port, token, 2 * (1 << 20))  # 1 MiB at 2 MiB/s: at least 0.5 s
    took = time.monotonic() - t0
    assert sent.returncode == 0 and proc.wait(timeout=30) == 0, sent.stderr
    assert took >= 0.45, took  # a lower bound: contention only makes it slower

    (snapshot / "short").write_bytes(b"x" * 100)  # the receiver expects more than the sender has
    port = free_port()
    proc = receiver(tmp_path, [("short.partial", 1000)], port, token)
    sent = sender(snapshot, ["short"], port, token, None)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 5 and "the sender closed the connection after 100 of 1000 bytes" in err, err
    assert sent.returncode != 0  # no "ok" from the receiver


def test_the_receiver_ends_when_fleet_goes_away(tmp_path: Path) -> None:
    """fleet closes the receiver's channel when the sender cannot come: the receiver must not hold
    the staging port until its deadline (a retry from another sender binds it next round)."""
    port = free_port()
    proc = receiver(tmp_path, [("x.partial", 10)], port, "ab" * 32)
    assert proc.stdout is not None
    proc.stdout.close()  # what sshd does when fleet closes the channel
    assert proc.wait(timeout=10) != 0
    with socket.socket() as s:
        s.bind((RECEIVER, port))  # the port is free again
