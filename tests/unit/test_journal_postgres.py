"""The shared journal on a real PostgreSQL server (issue 27): a private cluster of Debian's
``postgresql`` started for this module (``tests/postgres.py``), on a loopback port with password
authentication. Two control processes with their own HOMEs share it; the database goes away
mid-rollout; bad connection settings are clear errors before any host is touched.

The fleet behind the journal is the engine tests' simulated one (``SimFleet``): what is tested
here is the journal and the lock; the real hosts' side is ``tests/lab/test_rollout_lab.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.rollout.engine import RolloutStatus, new_rollout
from fleet.rollout.errors import JournalError, LockHeld
from fleet.rollout.journal import SCHEMA_VERSION, Journal, JournalLocation, RolloutJournal
from fleet.rollout.journals import open_journal
from fleet.rollout.runner import Runner, open_rollout, reopen_rollout
from fleet.secrets import SecretRef
from tests.lab.polling import wait_for
from tests.postgres import DATABASE, ROLE, PgCluster, private_cluster
from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    with private_cluster() as cluster:
        yield cluster


@pytest.fixture
def pgpass(pg: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test process's password, by reference: a ~/.pgpass of its own (PGPASSFILE)."""
    home = tmp_path / "home"
    home.mkdir()
    path = pg.pgpass(home)
    monkeypatch.setenv("PGPASSFILE", str(path))
    return path


@pytest.fixture
def fresh(pg: PgCluster, pgpass: Path) -> Iterator[PgCluster]:
    """The database emptied of fleet's tables before and after the test."""
    drop = "DROP TABLE IF EXISTS steps, rollouts, locks, schema_version CASCADE"
    pg.superuser(drop)
    yield pg
    if not pg.running():  # a test that took it away and failed before bringing it back
        pg.start()
    pg.superuser(drop)


def fleet_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "FLEET_JOURNAL"))}
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO,
        env={**full, "COLUMNS": "200", **env}, timeout=120,
    )  # fmt: skip


def test_schema_is_created_versioned_and_the_journal_works_as_sqlite_does(fresh: PgCluster, tmp_path: Path) -> None:
    """The same run through both backends gives the same history, steps and final state."""
    results = {}
    for name, where in (("sqlite", str(tmp_path / "j.sqlite")), ("postgresql", fresh.url)):
        with open_journal(where) as journal:
            clock = Clock()
            sim = SimFleet(clock, [2, 1])
            state = new_rollout("r1", "lab", "rollout", targets(sim), POLICY, clock.now)
            open_rollout(journal, state)
            final = Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
            journal.release("lab", "r1")
            results[name] = (
                final,
                [(r.id, r.kind, r.status, r.steps) for r in journal.history()],
                [(s.seq, s.instance, s.action, s.before, s.outcome) for s in journal.steps("r1")],
                journal.latest_state("r1"),
                journal.lock_owner("lab"),
            )
    assert results["sqlite"] == results["postgresql"]
    assert results["postgresql"][0].status is RolloutStatus.DONE
    assert fresh.superuser("SELECT version FROM schema_version") == str(SCHEMA_VERSION)
    # timestamps keep their sub-second part (DOUBLE PRECISION, not PostgreSQL's 4-byte REAL)
    assert fresh.superuser("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                           "attrelid = 'steps'::regclass AND attname = 'at'") == "double precision"  # fmt: skip


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from fleet.rollout.engine import new_rollout
    from fleet.rollout.journals import open_journal
    from fleet.rollout.runner import Runner, open_rollout
    from tests.unit.test_rollout_engine import POLICY, Clock, SimFleet, targets

    marker = Path(sys.argv[1])
    journal = open_journal()  # where this HOME's configuration says
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    state = new_rollout("crash-1", "lab", "rollout", targets(sim), POLICY, clock.now)
    open_rollout(journal, state)

    def stop_forever(ref):
        marker.write_text(str(ref))  # the step is journaled; the process dies in the middle of it
        time.sleep(600)

    sim.stop_unit = stop_forever
    Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
    """
)

SECOND = textwrap.dedent(
    """
    import json, sys
    from fleet.rollout.errors import LockHeld
    from fleet.rollout.journals import open_journal
    from fleet.rollout.runner import Runner, reopen_rollout
    from tests.unit.test_rollout_engine import Clock, SimFleet

    journal = open_journal()
    try:
        journal.acquire("lab", "second")
        print(json.dumps({"acquired": True}))
    except LockHeld as exc:
        print(json.dumps({"refused": str(exc)}))
    if sys.argv[1] == "resume":
        clock = Clock()
        state = reopen_rollout(journal, "crash-1", clock.now, takeover=True)
        sim = SimFleet(clock, [1, 1])
        final = Runner(sim, journal, clock=clock, sleep=clock.sleep).run(state)
        journal.release("lab", "crash-1")
        print(json.dumps({"status": final.status.value, "log": sim.log}))
    """
)


def _homes(pg: PgCluster, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Two operators' environments: one with FLEET_JOURNAL and ~/.pgpass, one with the journal
    config file and its password by reference (env:)."""
    a, b = tmp_path / "alice", tmp_path / "bob"
    for home in (a, b):
        home.mkdir()
    pg.pgpass(a)
    (b / ".config" / "fleet").mkdir(parents=True)
    (b / ".config" / "fleet" / "journal.toml").write_text(f'url = "{pg.url}"\npassword_ref = "env:FLEET_DB_PW"\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "FLEET_JOURNAL", "XDG_"))}
    base["PYTHONPATH"] = str(REPO)
    env_a = {**base, "HOME": str(a), "FLEET_JOURNAL": pg.url}
    env_b = {**base, "HOME": str(b), "FLEET_DB_PW": pg.password}
    return env_a, env_b


def test_two_control_machines_share_it_the_second_is_refused_then_resumes_when_the_first_dies(
    fresh: PgCluster, tmp_path: Path
) -> None:
    env_a, env_b = _homes(fresh, tmp_path)
    marker = tmp_path / "marker"
    first = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], cwd=REPO, env=env_a)
    try:
        assert wait_for(marker.exists, timeout=60), "the first never reached its stop"
        second = subprocess.run([sys.executable, "-c", SECOND, "try"], cwd=REPO, env=env_b, capture_output=True,
                                text=True, timeout=60, check=True)  # fmt: skip
        refused = json.loads(second.stdout)["refused"]
        assert f"fleet lab is locked by rollout crash-1 by {os.environ.get('USER', 'root')}" in refused or (
            "fleet lab is locked by rollout crash-1 by " in refused
        )
        assert f"(pid {first.pid})" in refused and "its database session is open" in refused
        listed = fleet_cli("history", "--json", env={"HOME": env_b["HOME"], "FLEET_DB_PW": fresh.password})
        assert [(r["id"], r["status"]) for r in json.loads(listed.stdout)["rollouts"]] == [("crash-1", "running")]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    # The first's session ended with its process: its lock is stale everywhere, at once.
    listed = fleet_cli("history", "--json", env={"HOME": env_b["HOME"], "FLEET_DB_PW": fresh.password})
    assert [(r["id"], r["status"]) for r in json.loads(listed.stdout)["rollouts"]] == [("crash-1", "interrupted")]
    resumed = subprocess.run([sys.executable, "-c", SECOND, "resume"], cwd=REPO, env=env_b, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    lines = [json.loads(line) for line in resumed.stdout.splitlines()]
    assert "stale lock: rollout crash-1" in lines[0]["refused"]  # a stale lock is not taken without asking
    assert lines[1]["status"] == "done"
    assert lines[1]["log"][:3] == ["stop h0/i0", "flip v2 h0/i0", "start h0/i0"]  # the journaled stop, sent again
    with open_journal(fresh.url) as journal:
        assert journal.history()[0].status == "done" and journal.lock_owner("lab") is None


def test_the_database_going_away_mid_rollout_stops_it_naming_what_was_left(fresh: PgCluster) -> None:
    journal = open_journal(fresh.url)
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    state = new_rollout("r-gone", "lab", "rollout", targets(sim), POLICY, clock.now)
    open_rollout(journal, state)
    events: list[str] = []

    def event(line: str) -> None:
        events.append(line)
        if line.startswith("stop h0/i0"):  # journaled; now the database dies before its outcome
            fresh.stop()

    stopped = Runner(sim, journal, clock=clock, sleep=clock.sleep, on_event=event).run(state)
    assert stopped.status is RolloutStatus.RUNNING
    assert stopped.reason.startswith(f"the journal could not be written (journal {fresh.url}: the database went away")
    # the step journaled before it was taken ran; nothing after it
    assert sim.log == ["hook lb disable h0/i0", "stop h0/i0"]
    assert events[-2:] == [
        f"interrupted: {stopped.reason}",
        "left mid-way: h0/i0: being stopped, release v2",  # its stop's outcome never reached the journal
    ]
    journal.close()
    fresh.start()
    with open_journal(fresh.url) as again:
        record = again.history()[0]
        assert (record.id, record.status) == ("r-gone", "interrupted")
        resumed = reopen_rollout(again, "r-gone", clock.now, takeover=True)
        final = Runner(sim, again, clock=clock, sleep=clock.sleep).run(resumed)
        again.release("lab", "r-gone")
    assert final.status is RolloutStatus.DONE
    assert sum(line.startswith("stop") for line in sim.log) == 2  # each instance stopped once


def test_a_failover_between_two_writes_reconnects_and_keeps_the_lock(fresh: PgCluster) -> None:
    journal = open_journal(fresh.url)
    clock = Clock()
    sim = SimFleet(clock, [1, 1])
    state = new_rollout("r-failover", "lab", "rollout", targets(sim), POLICY, clock.now)
    open_rollout(journal, state)

    def event(line: str) -> None:
        if line.startswith("flip v2 h0/i0"):
            fresh.stop()
            fresh.start()  # the server is back (a standby took over the address) before the next write

    final = Runner(sim, journal, clock=clock, sleep=clock.sleep, on_event=event).run(state)
    assert final.status is RolloutStatus.DONE, final.reason
    owner = journal.lock_owner("lab")
    assert owner is not None and owner.session is True  # taken again on the new session
    journal.release("lab", "r-failover")
    journal.close()


def test_bad_connection_settings_are_clear_errors_before_any_host_is_touched(fresh: PgCluster, tmp_path: Path) -> None:
    """Each through ``fleet restart`` of a one-host inventory whose SSH port is a listener that
    counts connections: nothing may reach it. The password never appears in any output."""
    seen: list[object] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ssh_port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                seen.append(listener.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    wl = '{"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 4}'
    inventory = tmp_path / "inv.py"
    inventory.write_text(
        f'g = [("h1", {{"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": {wl}, "gpu": {{"sku": "a10-24gb"}}, '
        f'"ssh_hostname": "127.0.0.1", "ssh_port": {ssh_port}}})]\n'
    )
    home = tmp_path / "op"
    home.mkdir()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    wrong = home / "wrong.pgpass"
    wrong.write_text(f"127.0.0.1:{fresh.port}:{DATABASE}:{ROLE}:not-the-password-{fresh.password[:4]}\n")
    wrong.chmod(0o600)
    cases = [
        (f"postgresql://{ROLE}@127.0.0.1:{dead_port}/{DATABASE}", {}, "cannot reach the database"),
        (fresh.url, {"PGPASSFILE": str(wrong)}, "the database refused the credentials"),
        (f"postgresql://{ROLE}:{fresh.password}@127.0.0.1:{fresh.port}/{DATABASE}", {},
         "a password in the journal URL is refused"),
        (f"postgresql://{ROLE}@127.0.0.1:{fresh.port}/{DATABASE}?password={fresh.password}", {},
         "a password in the journal URL is refused"),
        (f"postgresql://{ROLE}@127.0.0.1:{fresh.port}/nosuchdb", {"PGPASSFILE": str(fresh.pgpass(home))},
         'database "nosuchdb" does not exist'),
    ]  # fmt: skip
    for url, env, expected in cases:
        # by the environment; and, for a URL with a password, in argv too (where `ps` would show it)
        for via in ({"FLEET_JOURNAL": url}, {"__arg": url}) if "refused" in expected else ({"FLEET_JOURNAL": url},):
            args = ["restart", str(inventory), "--json"]
            if "__arg" in via:
                args += ["--journal", via["__arg"]]
            out = fleet_cli(*args, env={"HOME": str(home), **env, **{k: v for k, v in via.items() if k != "__arg"}})
            assert out.returncode == 2, (url, out)
            error = json.loads(out.stdout)["error"]
            assert expected in error, (url, error)
            assert fresh.password not in out.stdout + out.stderr and "Traceback" not in out.stderr
    # A schema from a newer fleet: refused, named, and left as it is.
    with open_journal(fresh.url):
        pass
    fresh.superuser("UPDATE schema_version SET version = 99")
    out = fleet_cli("restart", str(inventory), "--json", env={"HOME": str(home), "FLEET_JOURNAL": fresh.url,
                                                             "PGPASSFILE": str(fresh.pgpass(home))})  # fmt: skip
    assert out.returncode == 2, out
    assert "its schema is version 99, written by a newer fleet (this one knows up to version 2)" in out.stdout
    assert fresh.superuser("SELECT version FROM schema_version") == "99"
    listener.close()
    assert seen == []  # no host was touched


def test_a_lock_held_from_another_machine_is_known_dead_once_its_session_ends(fresh: PgCluster) -> None:
    """SQLite cannot tell whether a lock held from another machine lives; the shared journal can."""
    with open_journal(fresh.url) as writer:
        writer._query(
            'INSERT INTO locks (fleet, rollout_id, pid, pid_start, host, "user", started_at) '
            "VALUES ('lab', 'r-laptop', 4242, '1', 'laptop-of-alice', 'alice', 0)"
        )
    with open_journal(fresh.url) as journal:
        owner = journal.lock_owner("lab")
        assert owner is not None and owner.host == "laptop-of-alice" and owner.alive() is False
        with pytest.raises(LockHeld, match="stale lock: rollout r-laptop by alice@laptop-of-alice"):
            journal.acquire("lab", "r-mine")
        journal.acquire("lab", "r-mine", takeover=True)
        with open_journal(fresh.url) as other, pytest.raises(LockHeld, match="its database session is open"):
            other.acquire("lab", "r-theirs", takeover=True)  # a live owner is never taken over
        journal.release("lab", "r-mine")


def test_a_read_only_role_reads_history_and_cannot_write(
    fresh: PgCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_journal(fresh.url) as journal:
        journal.begin(new_rollout("r1", "lab", "restart", [], POLICY, 0.0))
    fresh.superuser("DROP ROLE IF EXISTS viewer; CREATE ROLE viewer LOGIN PASSWORD 'viewer-pw'; "
                    "GRANT SELECT ON ALL TABLES IN SCHEMA public TO viewer")  # fmt: skip
    url = f"postgresql://viewer@127.0.0.1:{fresh.port}/{DATABASE}"
    env = {"HOME": str(tmp_path), "FLEET_JOURNAL": url, "FLEET_VIEW_PW": "viewer-pw"}
    (tmp_path / ".config" / "fleet").mkdir(parents=True)
    (tmp_path / ".config" / "fleet" / "journal.toml").write_text(f'url = "{url}"\npassword_ref = "env:FLEET_VIEW_PW"\n')
    env.pop("FLEET_JOURNAL")
    listed = fleet_cli("history", "--json", env=env)
    assert listed.returncode == 0, listed
    assert [r["id"] for r in json.loads(listed.stdout)["rollouts"]] == ["r1"]
    monkeypatch.setenv("FLEET_VIEW_PW", "viewer-pw")
    journal: RolloutJournal = open_journal(
        JournalLocation("postgresql", "test", url=url, password_ref=SecretRef("env", "FLEET_VIEW_PW"))
    )
    with pytest.raises(JournalError, match="this database user may not write the journal"):
        journal.begin(new_rollout("r2", "lab", "restart", [], POLICY, 0.0))
    journal.close()
    fresh.superuser("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM viewer; DROP ROLE viewer")


def test_an_unversioned_sqlite_journal_is_migrated_and_keeps_its_records(tmp_path: Path) -> None:
    """A journal from before the version table (schema 1) is stamped and indexed, rows kept."""
    import sqlite3

    from fleet.rollout.journal import SCHEMA

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA.format(seq="INTEGER PRIMARY KEY AUTOINCREMENT").replace(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);", ""))  # fmt: skip
    db.execute("INSERT INTO rollouts VALUES ('old', 'lab', 'restart', 1.5, 2.5, 'done', '', 'u', 'h', '{}')")
    db.commit()
    db.close()
    with Journal(path) as journal:
        assert [(r.id, r.status) for r in journal.history()] == [("old", "done")]
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'rollouts_by_fleet'").fetchall()


def test_a_gpu_clear_is_journaled_in_postgresql_as_in_sqlite(fresh: PgCluster, tmp_path: Path) -> None:
    """``fleet gpu clear``'s entry (``fleet.rollout.gpu_clear``) through both backends: the same
    history, the same step, read back from a second connection."""
    if os.geteuid() != 0:
        pytest.skip("the watcher record's commands run as root")
    from fleet.rollout.gpu_clear import clear_journaled
    from tests.unit.test_gpu_clear_journaled import TARGET, local, make_record

    results = {}
    for name, where in (("sqlite", str(tmp_path / "j.sqlite")), ("postgresql", fresh.url)):
        state_dir = tmp_path / name
        state_dir.mkdir(mode=0o700)
        make_record(state_dir)
        read, write = local(state_dir)
        done = clear_journaled("lab", TARGET, 1, "ops@ctl", "reseated", journal_path=where, now=2000.0, read=read,
                               write=write)  # fmt: skip
        with open_journal(where, write=False) as journal:
            results[name] = (
                [(r.fleet, r.kind, r.status, r.reason, r.steps) for r in journal.history()],
                [(s.instance, s.action, s.detail, s.outcome) for s in journal.steps(done.rollout_id)],
            )
    assert results["sqlite"] == results["postgresql"]
    ((fleet, kind, status, _reason, steps),) = results["postgresql"][0]
    assert (fleet, kind, status, steps) == ("lab", "gpu-clear", "done", 1)
