"""Several files in one command (``fleet.operations.files``): the write script run by this
machine's own ``sh`` and coreutils, and what the operations decide from recorded facts."""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import subprocess
from pathlib import Path

import pytest
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import Directory

from fleet.operations import files
from fleet.operations.files import Wanted, WantedDir

from .opharness import Command, Value, key, run_op, written


def _me() -> tuple[str, str]:
    return pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name


def _run(command: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, text=True, check=False)


def test_one_command_writes_every_file_with_its_own_mode_and_the_exact_bytes(tmp_path: Path) -> None:
    user, group = _me()
    big = os.urandom(200_000)  # larger than any pipe buffer: head -c must stop at each file's end
    wanted = [
        Wanted(str(tmp_path / "new" / "dir" / "a.bin"), big, 0o640, user, group),
        Wanted(str(tmp_path / "empty"), b"", 0o600, user, group),
        Wanted(str(tmp_path / "b.env"), "KEY=two words\nno newline at the end", 0o600, user, group),
        Wanted(str(tmp_path / "c.txt"), "\n\n", 0o644, user, group),
    ]
    (tmp_path / "b.env").write_text("old content, replaced")
    command = files.write_many_command(wanted)
    done = _run(command.get_raw_value(), str(command.connector_arguments["_stdin"]) + "\n")  # pyinfra's newline
    assert done.returncode == 0, done.stderr
    for w in wanted:
        p = Path(w.path)
        assert p.read_bytes() == w.data and (p.stat().st_mode & 0o777) == w.mode
    assert sorted(p.name for p in tmp_path.rglob(".*fleet-tmp")) == []
    assert "KEY=two" not in command.get_raw_value()  # contents never on argv


def test_a_cut_stdin_renames_nothing_half_written(tmp_path: Path) -> None:
    user, group = _me()
    wanted = [Wanted(str(tmp_path / "a"), "first\n", 0o644, user, group), Wanted(str(tmp_path / "b"), "x" * 999)]
    (tmp_path / "b").write_text("old\n")
    command = files.write_many_command([wanted[0], Wanted(wanted[1].path, wanted[1].content, 0o644, user, group)])
    stdin = str(command.connector_arguments["_stdin"])
    done = _run(command.get_raw_value(), stdin[:-100])
    assert done.returncode != 0 and "input cut short" in done.stderr
    assert (tmp_path / "a").read_text() == "first\n"  # written whole before the cut
    assert (tmp_path / "b").read_text() == "old\n"  # the old file stays; no temporary file left
    assert not list(tmp_path.glob(".*fleet-tmp"))


def test_the_harness_reads_back_what_the_command_writes() -> None:
    wanted = [Wanted("/etc/a", "one\n", 0o600), Wanted("/etc/b b", b"\x00\xff", 0o644)]
    command = files.write_many_command(wanted)
    stdin = command.connector_arguments["_stdin"]
    assert written(Command(command.get_raw_value(), str(stdin))) == {
        "/etc/a": (b"one\n", "root:root", "600"),
        "/etc/b b": (b"\x00\xff", "root:root", "644"),
    }


@pytest.mark.parametrize(
    ("dirs", "found", "expected"),
    [
        ([WantedDir("/var/lib/w", 0o700), WantedDir("/var/lib/t")], [None, None],
         ["mkdir -p -m 700 -- /var/lib/w", "chown root:root -- /var/lib/w", "mkdir -p -- /var/lib/t"]),
        ([WantedDir("/var/lib/w", 0o700), WantedDir("/var/lib/t")],
         [{"mode": 700, "user": "root", "group": "root"}, {"mode": 755, "user": "x", "group": "x"}], []),
        ([WantedDir("/var/lib/w", 0o700)], [{"mode": 755, "user": "root", "group": "adm"}],
         ["chown root:root -- /var/lib/w", "chmod 700 -- /var/lib/w"]),
    ],
)  # fmt: skip
def test_directories_plan(dirs: list[WantedDir], found: list[object], expected: list[str]) -> None:
    assert files.directories_plan(dirs, found) == expected


def test_a_file_where_a_directory_should_be_is_refused_with_the_way_out() -> None:
    with pytest.raises(OperationError, match="/var/lib/w exists and is not a directory; move it away"):
        files.directories_plan([WantedDir("/var/lib/w", 0o700)], [False])


def test_directories_are_one_command_their_facts_read_before_it() -> None:
    dirs = [WantedDir("/var/lib/w", 0o700), WantedDir("/var/lib/t")]
    facts = {key(Directory, path=d.path): Value(None) for d in dirs}
    run = run_op(files.directories, facts, dirs=dirs)
    assert run.texts == [" && ".join(files.directories_plan(dirs, [None, None]))]
    assert run.round_trips == 2 and run.late_reads == []
    done = {key(Directory, path=d.path): Value({"mode": 700, "user": "root", "group": "root"}) for d in dirs}
    assert run_op(files.directories, done, dirs=dirs).texts == []


def test_the_write_script_quotes_paths_and_owners_as_arguments() -> None:
    command = files.write_many_command([Wanted("/etc/a b/x;$(id)'z", "a", 0o600)])
    argv = shlex.split(command.get_raw_value())
    assert argv[3:] == ["fleet-write", "/etc/a b", "x;$(id)'z", "root:root", "600"]
