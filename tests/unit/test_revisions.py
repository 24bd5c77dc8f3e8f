"""Configuration revisions: the id (here and on the host alike), the fact, and the operation that
stores them, against recorded fact output."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from fleet.errors import FleetError
from fleet.facts.revisions import InstanceRevisions, fact_instances, parse_revisions, revisions_command
from fleet.operations import revisions
from fleet.render.revision import LIVE_ID_SH, ROOT, Revision, revision_id, revisions_of
from fleet.render.units import RenderedFile

from .opharness import key, run_op, written

UNIT = RenderedFile("/etc/systemd/system/fleet-vllm-0.service", "[Service]\nExecStart=/x serve m\n", 0o644)
ENV = RenderedFile("/etc/fleet/vllm-0.env", "# no key\n", 0o600)
REV = Revision("vllm-0", UNIT, ENV, "m")


def test_the_id_is_what_the_host_computes_from_the_live_files(tmp_path: Path) -> None:
    unit, env = tmp_path / "u", tmp_path / "e"
    unit.write_text(UNIT.content)
    env.write_text(ENV.content)
    out = subprocess.run(["sh", "-c", f"U={unit}; E={env}; {LIVE_ID_SH}"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == REV.id == revision_id(UNIT.content.encode(), ENV.content.encode())
    assert REV.id == hashlib.sha256((UNIT.content + ENV.content).encode()).hexdigest()[:16]


def test_any_change_to_either_file_is_a_new_revision() -> None:
    assert Revision("vllm-0", UNIT, RenderedFile(ENV.path, "VLLM_API_KEY=k2\n", 0o600), "m").id != REV.id
    flags = RenderedFile(UNIT.path, UNIT.content.replace("serve m", "serve m --max-model-len 4096"), 0o644)
    assert Revision("vllm-0", flags, ENV, "m").id != REV.id


def test_revisions_pair_each_unit_with_its_env_file() -> None:
    files = [
        UNIT,
        ENV,
        RenderedFile("/etc/systemd/system/fleet-vllm-1.service", "u1", 0o644),
        RenderedFile("/etc/fleet/vllm-1.env", "e1", 0o600),
    ]
    revs = revisions_of(files, "served")
    assert [(r.instance, r.unit.path, r.env.path, r.served_model) for r in revs] == [
        ("vllm-0", UNIT.path, ENV.path, "served"),
        ("vllm-1", "/etc/systemd/system/fleet-vllm-1.service", "/etc/fleet/vllm-1.env", "served"),
    ]
    assert REV.directory() == f"{ROOT}/vllm-0/{REV.id}"
    assert '"served_model": "m"' in REV.meta() and REV.meta().count("\n") == 1


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], {}),
        (
            ["state vllm-0 active", "runs vllm-0 /opt/fleet/vllm/releases/r1/bin/python", "live vllm-0 aaaa",
             "stored vllm-0 20 bbbb", "stored vllm-0 10 aaaa"],
            {"vllm-0": {"state": "active", "live": "aaaa", "stored": [{"id": "aaaa", "mtime": 10},
                                                                       {"id": "bbbb", "mtime": 20}],
                        "exe": "/opt/fleet/vllm/releases/r1/bin/python"}},
        ),
        (["state vllm-1 inactive", "runs vllm-1 "], {"vllm-1": {"state": "inactive", "live": None, "stored": [],
                                                                "exe": None}}),
        (["state vllm-1"], {"vllm-1": {"state": "unknown", "live": None, "stored": [], "exe": None}}),
        # an interpreter path with a space is kept whole
        (["runs vllm-2 /opt/my fleet/releases/r/bin/python"],
         {"vllm-2": {"state": "unknown", "live": None, "stored": [], "exe": "/opt/my fleet/releases/r/bin/python"}}),
    ],
)  # fmt: skip
def test_parse_revisions(lines: list[str], expected: dict[str, object]) -> None:
    assert parse_revisions(lines) == expected


#: ``systemctl show -p Id,ActiveState,MainPID`` of two units (from a lab host's recorded blocks,
#: tests/fixtures/status/lab-rtx4090-2-one-stopped.txt)
SHOWN = ["MainPID=901", "Id=fleet-vllm-0.service", "ActiveState=active", "",
         "MainPID=0", "Id=fleet-vllm-1.service", "ActiveState=inactive"]  # fmt: skip
EXE = "/opt/fleet/vllm/releases/r1/bin/python"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        # one systemctl show for both units, the interpreter of each main process by its pid
        (["show vllm-0 vllm-1", *SHOWN, "end", f"exe 901 {EXE}", "live vllm-0 aaaa", "stored vllm-0 10 aaaa"],
         {"vllm-0": {"state": "active", "live": "aaaa", "stored": [{"id": "aaaa", "mtime": 10}], "exe": EXE},
          "vllm-1": {"state": "inactive", "live": None, "stored": [], "exe": None}}),
        # the main process is gone by the time its command line is read
        (["show vllm-0", *SHOWN[:3], "end", "exe 901 "],
         {"vllm-0": {"state": "active", "live": None, "stored": [], "exe": None}}),
        # systemctl said nothing (or not one block per unit): as `systemctl is-active` printing nothing
        (["show vllm-0 vllm-1", "", "end"],
         {"vllm-0": {"state": "unknown", "live": None, "stored": [], "exe": None},
          "vllm-1": {"state": "unknown", "live": None, "stored": [], "exe": None}}),
        (["show vllm-0 vllm-1", *SHOWN[:3], "end", f"exe 901 {EXE}"],
         {"vllm-0": {"state": "unknown", "live": None, "stored": [], "exe": None},
          "vllm-1": {"state": "unknown", "live": None, "stored": [], "exe": None}}),
    ],
)  # fmt: skip
def test_parse_revisions_with_one_systemctl_show(lines: list[str], expected: dict[str, object]) -> None:
    assert parse_revisions(lines) == expected


def test_the_fact_command_asks_systemd_once_for_every_unit() -> None:
    command = revisions_command(
        [("vllm-0", "fleet-vllm-0.service", "/u0", "/e0"), ("vllm-1", "fleet-vllm-1.service", "/u1", "/e1")]
    )
    assert command.count("systemctl") == 1 and "fleet-vllm-0.service fleet-vllm-1.service" in command
    assert "is-active" not in command


def test_an_unreadable_line_is_an_error_not_a_guess() -> None:
    with pytest.raises(FleetError, match="unreadable"):
        parse_revisions(["stored vllm-0 notanumber aaaa"])
    with pytest.raises(FleetError, match="cut short"):
        parse_revisions(["show vllm-0", "ActiveState=active"])


def test_the_fact_command_quotes_every_path() -> None:
    command = revisions_command([("vllm-0", "fleet-vllm-0.service", "/etc/a b;reboot", "/etc/e")])
    assert "'/etc/a b;reboot'" in command and "; reboot" not in command


def _facts(stored: list[str], live: str | None, state: str = "active") -> dict[object, object]:
    lines = [f"state vllm-0 {state}"] + ([f"live vllm-0 {live}"] if live else [])
    lines += [f"stored vllm-0 {i} {rid}" for i, rid in enumerate(stored)]
    # nothing else is recorded: a revision not stored is written whole, its files' facts unread
    return {key(InstanceRevisions, instances=fact_instances([REV]), root=ROOT): lines}


def test_a_new_revision_is_stored_root_only_its_meta_last_in_one_command() -> None:
    run = run_op(revisions.stored, _facts(["old1"], "old1"), revisions=[REV])  # type: ignore[arg-type]
    assert len(run.texts) == 1  # before: install -d, then per file a read and a write (7 round trips)
    make, _write = run.texts[0].split(" && ")
    assert make == f"install -d -m 0700 -- {ROOT} {ROOT}/vllm-0 {REV.directory()}"
    files = written(run.commands[0])
    assert list(files) == [f"{REV.directory()}/{n}" for n in ("unit", "env", "revision.json")]
    assert all(owner == "root:root" and mode == "600" for _data, owner, mode in files.values())
    assert files[f"{REV.directory()}/env"][0] == ENV.content.encode()
    assert run.late_reads == [] and run.round_trips == 2  # the InstanceRevisions fact, the command


def test_two_new_revisions_and_the_pruning_are_one_command() -> None:
    rev1 = Revision("vllm-1", RenderedFile("/etc/systemd/system/fleet-vllm-1.service", "[Service]\n", 0o644), ENV, "m")
    lines = ["state vllm-0 inactive", "state vllm-1 inactive", "live vllm-0 old2"]
    lines += [f"stored vllm-0 {i} {rid}" for i, rid in enumerate(["old0", "old1", "old2"])]
    facts = {key(InstanceRevisions, instances=fact_instances([REV, rev1]), root=ROOT): lines}
    run = run_op(revisions.stored, facts, revisions=[REV, rev1], keep=2)  # type: ignore[arg-type]
    assert len(run.texts) == 1
    make, _write, prune = run.texts[0].split(" && ")
    assert make == (f"install -d -m 0700 -- {ROOT} {ROOT}/vllm-0 {REV.directory()} {ROOT}/vllm-1 {rev1.directory()}")
    assert [p.rsplit("/", 1)[1] for p in written(run.commands[0])] == ["unit", "env", "revision.json"] * 2
    assert prune == f"rm -rf -- {ROOT}/vllm-0/old0 {ROOT}/vllm-0/old1"


def test_a_stored_revision_is_not_written_again() -> None:
    run = run_op(revisions.stored, _facts(["old1", REV.id], REV.id), revisions=[REV])  # type: ignore[arg-type]
    assert run.texts == [] and run.noops


def test_old_revisions_are_pruned_but_never_the_live_one() -> None:
    run = run_op(revisions.stored, _facts(["live0", "old1", "old2"], "live0"), revisions=[REV], keep=2)  # type: ignore[arg-type]
    assert run.texts[-1].split(" && ")[-1] == f"rm -rf -- {ROOT}/vllm-0/old1 {ROOT}/vllm-0/old2"


def test_the_fact_command_run_by_a_real_shell_lists_complete_revisions_only(tmp_path: Path) -> None:
    root = tmp_path / "revisions"
    (root / "vllm-0" / "aaaa").mkdir(parents=True)
    (root / "vllm-0" / "aaaa" / "revision.json").write_text("{}\n")
    (root / "vllm-0" / "half").mkdir()  # no revision.json: a store interrupted half-way
    unit, env = tmp_path / "u", tmp_path / "e"
    unit.write_text(UNIT.content)
    env.write_text(ENV.content)
    command = revisions_command([("vllm-0", "fleet-test-none.service", str(unit), str(env))], str(root))
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    found = parse_revisions(out.splitlines())["vllm-0"]
    assert [s["id"] for s in found["stored"]] == ["aaaa"]
    assert found["live"] == REV.id
    assert found["exe"] is None  # no such unit: no main process
