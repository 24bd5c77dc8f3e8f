"""``fleet gpu clear`` in fleet's own journal (``fleet.rollout.gpu_clear``), and the clear's bad
inputs: a record that is corrupt or another machine's, a ``clears.json`` that is corrupt.

The host side is real: records the watcher's own ``Record`` class wrote in a root-only
directory, read by the fact's own command and written by the clear's own command, run here as
root (the same commands ``fleet gpu clear`` sends over SSH); the journal is the real SQLite
file (and PostgreSQL in ``test_journal_postgres.py``), read back by ``fleet history``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError
from fleet.facts.runner import SshTarget
from fleet.gpuwatch.clear import ClearRefused, clear_entry, write_command
from fleet.gpuwatch.state import WatchState, parse_watch_state, watch_command
from fleet.gpuwatch.watcher import CLEARS, Record, read_machine_id
from fleet.rollout.errors import JournalError
from fleet.rollout.gpu_clear import KIND, NOT_CONFIRMED, STEP, clear_journaled
from fleet.rollout.journal import Journal

REPO = Path(__file__).resolve().parents[2]
UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(2)]
TARGET = SshTarget("gpu-3", "127.0.250.3")
FLEET = "/srv/fleet/prod.py"


def make_record(state_dir: Path, machine_id: str | None = None) -> None:
    r = Record(str(state_dir), machine_id or read_machine_id(), "gpu-3", 1000.0)
    for i, uuid in enumerate(UUIDS):
        r.gpu(uuid, i, f"00000000:{0x18 + i:02X}:00.0", "NVIDIA H100 80GB HBM3", "nvml")
    r.add(UUIDS[1], "xid", 79, 1001.0, "nvml")
    r.save(1002.0)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the fact's command and the write run as root")
    d = tmp_path / "gpu-watch"
    d.mkdir(mode=0o700)
    make_record(d)
    return d


def read_state(state_dir: Path) -> WatchState:
    out = subprocess.run(["sh", "-c", watch_command(str(state_dir))], capture_output=True, text=True, check=True)
    return parse_watch_state(out.stdout.splitlines())


def local(state_dir: Path) -> tuple[Any, Any]:
    """``read_clear``/``write_clear`` with the same commands run here, as root, on ``state_dir``."""

    def read(target: SshTarget, gpu: int, by: str, why: str, now: float) -> tuple[dict[str, Any], str]:
        return clear_entry(read_state(state_dir), target.name, gpu, by, why, now)

    def write(target: SshTarget, clears: dict[str, Any], text: str) -> None:
        argv = shlex.split(write_command(clears, text, str(state_dir)))
        assert argv[:2] == ["sudo", "-n"]
        subprocess.run(argv[2:], check=True, capture_output=True)

    return read, write


def fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_JOURNAL")}
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**env, "COLUMNS": "200"}, timeout=120)  # fmt: skip


def test_a_clear_is_journaled_beside_the_rollouts_with_who_what_and_why(state_dir: Path, tmp_path: Path) -> None:
    journal = tmp_path / "j.sqlite"
    read, write = local(state_dir)
    done = clear_journaled(FLEET, TARGET, 1, "ops@ctl", "reseated the riser", journal_path=journal, now=2000.0,
                           read=read, write=write)  # fmt: skip
    assert read_state(state_dir).quarantined() == {}
    with Journal(journal, write=False) as j:
        (entry,) = j.history()
        (step,) = j.steps(done.rollout_id)
        state = j.latest_state(done.rollout_id)
    assert (entry.id, entry.fleet, entry.kind, entry.status) == (done.rollout_id, FLEET, KIND, "done")
    assert entry.started_at == 2000.0 and entry.ended_at is not None and entry.steps == 1
    assert (step.instance, step.action, step.outcome) == ("gpu-3", STEP, "ok")
    assert step.detail == f"host gpu-3: {done.text}" == entry.reason
    assert step.detail.startswith(f"host gpu-3: GPU 1 ({UUIDS[1]}) cleared of XID 79 (reboot)")
    assert step.detail.endswith("by ops@ctl: reseated the riser")
    assert state.instances == {} and state.kind == KIND
    # `fleet history` lists it with the rollouts, `fleet history ID` shows its step
    listed = fleet_cli("history", "--journal", str(journal), "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["rollouts"]
    assert (row["kind"], row["status"], row["user"]) == (KIND, "done", entry.user)
    shown = fleet_cli("history", done.rollout_id, "--journal", str(journal))
    assert shown.returncode == 0, shown.stderr
    assert "gpu-3" in shown.stdout and "reseated the riser" in shown.stdout and f"({FLEET}): done" in shown.stdout


def test_the_entry_is_written_before_the_host_is_and_a_failed_write_leaves_it_halted_with_why(
    state_dir: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.sqlite"
    read, _write = local(state_dir)
    seen: dict[str, Any] = {}

    def failing_write(target: SshTarget, clears: dict[str, Any], text: str) -> None:
        with Journal(journal, write=False) as j:  # what a crash here would leave
            (entry,) = j.history()
            seen["entry"], seen["steps"] = entry, j.steps(entry.id)
        raise FleetError("host gpu-3: writing clears.json exited 1: No space left on device")

    with pytest.raises(FleetError, match="No space left on device"):
        clear_journaled(FLEET, TARGET, 1, "ops@ctl", "reseated", journal_path=journal, now=2000.0,
                        read=read, write=failing_write)  # fmt: skip
    # before the host was written: the entry says the outcome is not known yet, never `running`
    assert (seen["entry"].status, seen["entry"].reason) == ("halted", NOT_CONFIRMED)
    (pending,) = seen["steps"]
    assert pending.action == STEP and pending.outcome is None and "cleared of XID 79" in pending.detail
    with Journal(journal, write=False) as j:
        (entry,) = j.history()
        (step,) = j.steps(entry.id)
        assert j.last_unfinished(FLEET) is None  # nothing for `fleet rollout --resume` to pick up
    assert entry.status == "halted" and entry.reason.startswith("the clear was not written: host gpu-3: writing")
    assert step.outcome == "failed" and "No space left on device" in (step.outcome_detail or "")
    assert set(read_state(state_dir).quarantined()) == {1}  # still quarantined: nothing was written


def test_a_journal_that_cannot_be_written_stops_the_clear_before_the_host_is_read(
    state_dir: Path, tmp_path: Path
) -> None:
    read, write = local(state_dir)
    touched: list[str] = []

    def reading(*args: Any) -> tuple[dict[str, Any], str]:
        touched.append("read")
        result: tuple[dict[str, Any], str] = read(*args)
        return result

    with pytest.raises(JournalError, match="is a directory, not a journal file"):
        clear_journaled(FLEET, TARGET, 1, "ops@ctl", "x", journal_path=tmp_path, read=reading, write=write)
    assert touched == [] and set(read_state(state_dir).quarantined()) == {1}


@pytest.mark.parametrize(("gpu", "words"), [(7, "GPU 7 is not in the watcher's record"), (0, "is not quarantined")])
def test_a_refused_clear_journals_nothing(state_dir: Path, tmp_path: Path, gpu: int, words: str) -> None:
    journal = tmp_path / "j.sqlite"
    read, write = local(state_dir)
    with pytest.raises(ClearRefused, match=words):
        clear_journaled(FLEET, TARGET, gpu, "ops@ctl", "x", journal_path=journal, read=read, write=write)
    with Journal(journal, write=False) as j:
        assert j.history() == []


# ---- bad input: a record that is corrupt or another machine's, a corrupt clears.json -------------


def test_a_record_from_another_machine_is_refused_with_the_way_out(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the fact's command runs as root")
    make_record(tmp_path, machine_id="0123456789abcdef0123456789abcdef")
    state = read_state(tmp_path)
    assert state.status == "foreign"
    with pytest.raises(FleetError) as caught:
        clear_entry(state, "gpu-3", 1, "ops@ctl", "x", 2000.0)
    message = str(caught.value)
    assert not isinstance(caught.value, ClearRefused)  # the host's state, not the operator's input: exit 1
    assert message.startswith("host gpu-3: the GPU watcher's record cannot be read (foreign: record.json was "
                              "written on machine '0123456789abcdef0123456789abcdef'")  # fmt: skip
    assert "nothing was cleared" in message and "systemctl restart fleet-gpu-watch" in message
    assert not (tmp_path / CLEARS).exists()


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ("{not json", "record.json is not JSON"),
        (json.dumps({"schema": 1, "record_id": "r", "machine_id": "m", "seq": 1, "gpus": []}), "gpus=[] is not a dict"),
        (json.dumps([1, 2]), "not a JSON object"),
    ],
)
def test_a_corrupt_record_is_refused_with_the_way_out(tmp_path: Path, record: str, why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("the fact's command runs as root")
    (tmp_path / "record.json").write_text(record)
    state = read_state(tmp_path)
    assert state.status == "bad-record", state
    with pytest.raises(FleetError, match="Way out: restart the watcher") as caught:
        clear_entry(state, "gpu-3", 1, "ops@ctl", "x", 2000.0)
    assert why in str(caught.value) and "nothing was cleared" in str(caught.value)


@pytest.mark.parametrize(
    "clears",
    [
        "{half",
        json.dumps({"schema": 1, "gpus": []}),
        json.dumps({"schema": 1, "gpus": {UUIDS[1]: "cleared"}}),
        json.dumps(["not", "clears"]),
    ],
)
def test_a_corrupt_clears_file_is_never_written_over(state_dir: Path, clears: str) -> None:
    """``clears.json`` keeps who cleared which GPU before: a corrupt one refuses the clear (the
    host's state: exit 1), with the way out, and is left as it is; the GPU stays quarantined."""
    (state_dir / CLEARS).write_text(clears)
    state = read_state(state_dir)  # before the fix, a "gpus" that is not an object raised here
    assert state.ok and set(state.quarantined()) == {1}
    assert state.clears_problem is not None and CLEARS in state.clears_problem
    with pytest.raises(FleetError) as caught:
        clear_entry(state, "gpu-3", 1, "ops@ctl", "reseated", 2000.0)
    assert not isinstance(caught.value, ClearRefused)
    assert str(caught.value).startswith(f"host gpu-3: {CLEARS}")
    assert "fleet does not write over it; nothing was cleared" in str(caught.value)
    assert f"sudo cat /var/lib/fleet/gpu-watch/{CLEARS}" in str(caught.value)
    assert (state_dir / CLEARS).read_text() == clears


def test_a_secret_shaped_why_is_refused_without_being_shown(tmp_path: Path) -> None:
    rows = [("h1", {"model": "meta-llama/Llama-3.1-8B-Instruct", "ssh_hostname": "127.0.250.3",
                    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5,
                                 "target_concurrency": 8}})]  # fmt: skip
    inventory = tmp_path / "fleet.py"
    inventory.write_text(f"gpus = {rows!r}\n")
    secret = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bD1fH3"
    result = fleet_cli("gpu", "clear", str(inventory), "h1", "0", "--why", f"token {secret}", "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    assert secret not in result.stdout + result.stderr
    assert "not a secret" in json.loads(result.stdout)["error"]


def test_a_bad_journal_is_refused_before_any_host_is_touched(tmp_path: Path) -> None:
    rows = [("h1", {"model": "meta-llama/Llama-3.1-8B-Instruct", "ssh_hostname": "127.0.250.3",
                    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5,
                                 "target_concurrency": 8}})]  # fmt: skip
    inventory = tmp_path / "fleet.py"
    inventory.write_text(f"gpus = {rows!r}\n")
    result = fleet_cli("gpu", "clear", str(inventory), "h1", "0", "--why", "x", "--journal", "mysql://db/x", "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--journal='mysql://db/x'" in json.loads(result.stdout)["error"]
