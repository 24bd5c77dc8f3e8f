"""What the journal costs per rollout step: the embedded SQLite file against a shared PostgreSQL.

    .venv/bin/python benchmarks/journal_backends.py [--steps 300] [--instances 16]

A step is what the runner writes around every action it takes: ``intent`` (the step and the whole
engine state, committed before the action) and ``outcome`` (committed after). The state is a real
rollout's over ``--instances`` instances (its JSON is what every write carries). Measured, side by
side in one run, on this machine:

* **sqlite**: the default journal (WAL, ``synchronous=FULL``) on this machine's disk;
* **postgresql (tcp)**: a private PostgreSQL server (Debian's package, ``tests/postgres.py``: initdb
  with the defaults, ``fsync`` on) over TCP on 127.0.0.1 with scram authentication, as a team's
  journal is reached (but with no network between: a real one adds its round trip 4 times per
  write, 8 per step);
* the lock: ``acquire`` + ``release`` once per rollout, each backend;
* SQLite's ``quick_check`` that a writer runs on opening a journal, on the journal the run made.

Per step = (intent + outcome) wall time; median and p95 over ``--steps`` steps.

Measured on the 2-core development machine (16 instances, 300 steps; two runs, with other
sessions' lab tests running beside them, load average 4-6): SQLite median 6.78 / 8.38 ms per step
(p95 12.0 / 19.2 ms), PostgreSQL over loopback TCP 5.24 / 7.91 ms (p95 11.5 / 24.9 ms); lock
acquire + release 8.2 / 7.7 ms and 1.5 / 16.6 ms; the 3.0 MiB journal's quick_check 14.5 / 7.6 ms.
Both are an fsync per commit; what a shared database adds is the network: 8 round trips a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.rollout.batches import InstanceRef  # noqa: E402
from fleet.rollout.engine import Act, Action, Target, new_rollout  # noqa: E402
from fleet.rollout.journal import Journal, RolloutJournal  # noqa: E402
from fleet.rollout.journals import open_journal  # noqa: E402
from fleet.rollout.policy import RolloutPolicy  # noqa: E402
from tests.postgres import private_cluster  # noqa: E402


def per_step(journal: RolloutJournal, steps: int, instances: int, name: str) -> list[float]:
    refs = [InstanceRef(f"gpu{i // 8:03d}", f"vllm-{i % 8}") for i in range(instances)]
    targets = [Target(r, "20260101-abcdef", "meta-llama/Llama-3.1-8B-Instruct", 8000 + i) for i, r in enumerate(refs)]
    state = new_rollout(f"bench-{name}-{time.time_ns()}", "/inventory/prod.py", "rollout", targets,
                        RolloutPolicy(), time.time())  # fmt: skip
    journal.acquire(state.fleet, state.id)
    journal.begin(state)
    before = {"release": "20251201-012345", "revision": "abc123", "model": "m", "unit": "active/running"}
    out = []
    for n in range(steps):
        action = Action(Act.STOP, refs[n % len(refs)], "SIGTERM; vLLM drains for --shutdown-timeout")
        t0 = time.perf_counter()
        seq = journal.intent(state, action, before, time.time())
        journal.outcome(seq, state, True, "ok", time.time())
        out.append(time.perf_counter() - t0)
    journal.release(state.fleet, state.id)
    return out


def lock_cycle(journal: RolloutJournal, rounds: int = 50) -> float:
    t0 = time.perf_counter()
    for i in range(rounds):
        journal.acquire("/inventory/lock-bench.py", f"r{i}")
        journal.release("/inventory/lock-bench.py", f"r{i}")
    return (time.perf_counter() - t0) / rounds


def show(name: str, times: list[float]) -> None:
    ms = sorted(t * 1000 for t in times)
    p95 = ms[int(len(ms) * 0.95) - 1]
    med, mean = statistics.median(ms), statistics.mean(ms)
    print(f"{name:20s} per step: median {med:7.2f} ms  p95 {p95:7.2f} ms  mean {mean:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--instances", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.sqlite"
        with Journal(path) as journal:
            sqlite = per_step(journal, args.steps, args.instances, "sqlite")
            sqlite_lock = lock_cycle(journal)
        size = path.stat().st_size
        t0 = time.perf_counter()
        Journal(path).close()  # a writer's open: quick_check of the whole file
        check = time.perf_counter() - t0
        with private_cluster() as pg:
            os.environ["PGPASSFILE"] = str(pg.pgpass(Path(tmp)))
            with open_journal(pg.url) as journal:
                postgres = per_step(journal, args.steps, args.instances, "postgresql")
                postgres_lock = lock_cycle(journal)
    print(f"{args.steps} steps of a {args.instances}-instance rollout (intent + outcome, the whole state each)")
    show("sqlite", sqlite)
    show("postgresql (tcp)", postgres)
    print(f"lock acquire+release: sqlite {sqlite_lock * 1000:.2f} ms, postgresql {postgres_lock * 1000:.2f} ms")
    print(f"sqlite journal after the run: {size / 2**20:.1f} MiB; a writer's open (quick_check): {check * 1000:.1f} ms")
    print(
        f"difference per step: {(statistics.median(postgres) - statistics.median(sqlite)) * 1000:+.2f} ms median "
        "(each write is BEGIN, two statements, COMMIT: a remote database adds 8 network round trips per step)"
    )


if __name__ == "__main__":
    main()
