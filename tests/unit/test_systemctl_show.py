"""The one ``systemctl show`` reader (``fleet.facts.systemctl_show``) and its three users: the units
fact, the unit-states fact and the rollout's SSH executor, over recorded output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fleet.facts.systemctl_show import ShownUnit, show_blocks, show_int, show_properties, show_unix, shown_unit
from fleet.facts.systemctl_show import started_unix as started
from fleet.facts.unit_states import UnitState, unit_states, unit_states_command
from fleet.facts.units import process_units
from fleet.rollout.gates import UnitState as GateUnitState
from fleet.rollout.ssh_executor import parse_unit

FIXTURES = Path(__file__).parents[1] / "fixtures" / "status"
#: ``systemctl show --timestamp=unix -p ...`` of two units on a lab host (Debian 12, systemd 252),
#: as the units fact prints it ("unit " before each line, "unit end" after each unit).
RECORDED = [
    line.removeprefix("unit ")
    for line in (FIXTURES / "lab-rtx4090-2-one-stopped.txt").read_text().splitlines()
    if line.startswith("unit ")
]
RECORDED_TEXT = "\n".join("" if line == "end" else line for line in RECORDED)

SYSTEMD = Path(__file__).parents[1] / "fixtures" / "systemd"
#: Recorded on a lab host (Debian 12, systemd 252.39): ``systemctl show -p Id,LoadState,ActiveState,
#: SubState,NRestarts,MainPID,ExecMainStartTimestamp,ActiveEnterTimestamp,ExecStart ssh.service
#: nonexistent.service`` (without ``--timestamp=unix``: local time), two blocks and an empty line.
SYSTEMD_252_TWO_UNITS = (SYSTEMD / "show-ssh-and-missing-252.txt").read_text()
#: Recorded on the same host: ``unit_states_command([("ssh.service", ["/etc/ssh/sshd_config"]),
#: ("nonexistent.service", ["/etc/hostname"])])``.
UNIT_STATES_252 = (SYSTEMD / "unit-states-252.txt").read_text().splitlines()


def test_recorded_blocks() -> None:
    blocks = show_blocks(RECORDED_TEXT.splitlines())
    assert [b["Id"] for b in blocks] == ["fleet-vllm-0.service", "fleet-vllm-1.service"]
    assert blocks[0]["ExecMainStartTimestamp"] == "@1795384969" and blocks[1]["MainPID"] == "0"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (RECORDED_TEXT, ShownUnit("fleet-vllm-0.service", "loaded", "active", "running", 0, 901, {})),
        (RECORDED_TEXT.split("\n\n", 1)[1],
         ShownUnit("fleet-vllm-1.service", "loaded", "inactive", "dead", 0, None, {})),
        (SYSTEMD_252_TWO_UNITS, ShownUnit("ssh.service", "loaded", "active", "running", 0, 33, {})),
        (SYSTEMD_252_TWO_UNITS.split("\n\n", 1)[1],
         ShownUnit("nonexistent.service", "not-found", "inactive", "dead", 0, None, {})),
        ("ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nMainPID=0\n",
         ShownUnit(None, None, "activating", "auto-restart", 3, None, {})),
        ("ActiveState=inactive\nSubState=dead\nNRestarts=\nMainPID=[not set]\n",
         ShownUnit(None, None, "inactive", "dead", None, None, {})),
        ("current=releases/a\n", None),
        ("", None),
        ("garbage without equals\n", None),
    ],
)  # fmt: skip
def test_shown_unit(text: str, want: ShownUnit | None) -> None:
    got = shown_unit(show_properties(text))
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.id, got.load_state, got.active_state, got.sub_state, got.n_restarts, got.main_pid) == (
        want.id, want.load_state, want.active_state, want.sub_state, want.n_restarts, want.main_pid
    )  # fmt: skip


def test_values_keep_their_equals_signs() -> None:
    props = show_properties(SYSTEMD_252_TWO_UNITS)
    assert props["ExecStart"].startswith("{ path=/usr/sbin/sshd ; argv[]=/usr/sbin/sshd -D $SSHD_OPTS")
    assert props["ExecStart"].endswith("pid=33 ; code=(null) ; status=0/0 }")


@pytest.mark.parametrize(
    ("value", "want"),
    [("4242", 4242), ("0", 0), ("", None), (None, None), ("[not set]", None), ("-1", None), (" 7 ", 7)],
)
def test_show_int(value: str | None, want: int | None) -> None:
    assert show_int(value) == want


@pytest.mark.parametrize(
    ("value", "want"),
    [("@1795384969", 1795384969.0), ("@x", None), ("", None), (None, None), ("n/a", None),
     ("Sun 2026-11-22 23:40:11 UTC", None)],
)  # fmt: skip
def test_show_unix(value: str | None, want: float | None) -> None:
    assert show_unix(value) == want


@pytest.mark.parametrize(
    ("props", "now", "want"),
    [
        ({"ActiveEnterTimestamp": "@900"}, (None, None), 900.0),
        # older systemd (no --timestamp=unix): the monotonic twin on the host's wall clock
        ({"ActiveEnterTimestamp": "Sun 2026-11-22 21:00:00 UTC", "ActiveEnterTimestampMonotonic": "40000000"},
         (1000.0, 50.0), 990.0),
        ({"ActiveEnterTimestamp": "", "ActiveEnterTimestampMonotonic": "0"}, (1000.0, 50.0), None),  # never
        ({"ActiveEnterTimestampMonotonic": "40000000"}, (None, 50.0), None),  # no wall clock to place it on
    ],
)  # fmt: skip
def test_started_unix(props: dict[str, str], now: tuple[float | None, float | None], want: float | None) -> None:
    assert started(props, "ActiveEnter", *now) == want


# -- the three users ------------------------------------------------------------------------------


def test_the_units_fact_reads_the_recording() -> None:
    units = process_units(["now 1795384974.12 4394.21", *(f"unit {line}" for line in RECORDED)])["units"]
    assert units["fleet-vllm-0.service"]["main_pid"] == 901 and units["fleet-vllm-1.service"]["main_pid"] is None


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        (RECORDED_TEXT, GateUnitState("active", "running", 0, 901)),
        (SYSTEMD_252_TWO_UNITS, GateUnitState("active", "running", 0, 33)),
        ("ActiveState=inactive\nSubState=dead\nNRestarts=\nMainPID=0\ncurrent=releases/a\nexe=/x\n",
         GateUnitState("inactive", "dead", 0, 0)),
        ("current=releases/a\n", None),
    ],
)  # fmt: skip
def test_the_ssh_executor_reads_the_recording(text: str, unit: GateUnitState | None) -> None:
    assert parse_unit(text) == unit


def _states(blocks: list[tuple[str, str, str]], now: str = "now 1795384974.12 4394.21") -> list[UnitState]:
    lines = [now]
    for unit, shown, mtime in blocks:
        lines += [f"begin {unit}", *shown.splitlines(), f"mtime {mtime}", "end"]
    return unit_states(lines)


@pytest.mark.parametrize(
    ("mtime", "stale"),
    [("1795384970", True), ("1795384969", False), ("1795384000", False), ("", False)],
)
def test_the_unit_states_fact_compares_file_times_with_the_start(mtime: str, stale: bool) -> None:
    first, second = RECORDED_TEXT.split("\n\n")
    got = _states([("fleet-vllm-0.service", first, mtime), ("fleet-vllm-1.service", second, "1795384999")])
    assert got == [UnitState("fleet-vllm-0.service", True, stale), UnitState("fleet-vllm-1.service", False, False)]


def test_the_unit_states_fact_reads_the_recording() -> None:
    # sshd_config is older than ssh.service's start; the missing unit is inactive
    assert unit_states(UNIT_STATES_252) == [
        UnitState("ssh.service", True, False), UnitState("nonexistent.service", False, False)
    ]  # fmt: skip
    touched = [line.replace("mtime 1777976816", "mtime 1795391601") for line in UNIT_STATES_252]
    assert unit_states(touched)[0] == UnitState("ssh.service", True, True)


def test_the_unit_states_fact_on_systemd_without_unix_timestamps() -> None:
    shown = "Id=u.service\nActiveState=active\nActiveEnterTimestamp=Sun 2026-11-22 21:00:00 UTC\n"
    mono = shown + "ActiveEnterTimestampMonotonic=40000000\n"  # entered at 40 s; now: 1000 s wall, 50 s mono
    assert _states([("u.service", mono, "991")], "now 1000 50") == [UnitState("u.service", True, True)]
    assert _states([("u.service", mono, "989")], "now 1000 50") == [UnitState("u.service", True, False)]
    assert _states([("u.service", shown, "991")], "now 1000 50") == [UnitState("u.service", True, False)]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["fleet-vllm-0.service maybe"], "unreadable line"),
        (["begin u.service", "ActiveState=active"], "cut short"),
        (["begin u.service", "mtime 5", "end"], "said nothing"),
    ],
)
def test_the_unit_states_fact_refuses_garbage(lines: list[str], message: str) -> None:
    from fleet.errors import FleetError

    with pytest.raises(FleetError, match=message):
        unit_states(lines)


def test_the_unit_states_command_is_valid_shell_and_quotes() -> None:
    command = unit_states_command([("u;reboot", ["/etc/a b", "/x"]), ("fleet-vllm-0.service", ["/y"])])
    assert "'u;reboot'" in command and "'/etc/a b'" in command and "; reboot" not in command
    assert subprocess.run(["bash", "-n"], input=command, text=True, check=False).returncode == 0


def _one_show(blocks: list[tuple[str, str, list[str]]], now: str = "now 1795384974.12 4394.21") -> list[str]:
    """The unit-states fact's output with one ``systemctl show`` for all units (its command today)."""
    lines = [now, "show"]
    for _unit, shown, _mtimes in blocks:
        lines += [*shown.splitlines(), ""]
    lines.append("end")
    for unit, _shown, mtimes in blocks:
        lines += [f"begin {unit}", *(f"mtime {m}" for m in mtimes), "end"]
    return lines


def test_one_show_for_all_units_reads_as_one_show_per_unit() -> None:
    """The recording's blocks, as one ``systemctl show u0 u1`` prints them: the same states as the
    format of one ``systemctl show`` per unit; each file's mtime on its own line, the newest counts."""
    first, second = RECORDED_TEXT.split("\n\n")
    for mtimes, stale in ((["1795384000", "1795384970"], True), (["1795384969"], False), ([], False)):
        got = unit_states(_one_show([("fleet-vllm-0.service", first, mtimes), ("fleet-vllm-1.service", second, [])]))
        old = _states([("fleet-vllm-0.service", first, max(mtimes, default="")), ("fleet-vllm-1.service", second, "")])
        assert (
            got
            == old
            == [UnitState("fleet-vllm-0.service", True, stale), UnitState("fleet-vllm-1.service", False, False)]
        )
    recorded = [line for line in UNIT_STATES_252 if line.startswith(("now", "begin", "mtime", "end"))]
    shown = [line for line in UNIT_STATES_252 if "=" in line]
    one = [recorded[0], "show", *shown[:4], "", *shown[4:], "end", *recorded[1:]]
    assert unit_states(one) == unit_states(UNIT_STATES_252)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["show", "Id=u.service", "ActiveState=active"], "cut short"),
        (["show", "end", "begin u.service", "end"], "said nothing"),
        (["show", "Id=a.service", "ActiveState=active", "", "Id=b.service", "ActiveState=active", "end",
          "begin a.service", "end"], "answered for 2 of 1 units"),
    ],
)  # fmt: skip
def test_one_show_that_does_not_match_the_units_is_an_error(lines: list[str], message: str) -> None:
    from fleet.errors import FleetError

    with pytest.raises(FleetError, match=message):
        unit_states(lines)


def test_the_unit_states_command_runs_one_systemctl_and_one_stat_per_unit() -> None:
    command = unit_states_command([("a.service", ["/a", "/b"]), ("b.service", ["/c"])])
    assert command.count("systemctl show --timestamp=unix") == 1 and "a.service b.service" in command
    assert command.count("stat -c") == 2 and "sort" not in command and "cut" not in command
    # the clocks are read only where systemd cannot print unix timestamps
    assert command.index("date") > command.index("||") > command.index("--timestamp=unix")
    empty = subprocess.run(["sh", "-c", unit_states_command([])], capture_output=True, text=True, check=True)
    assert empty.stdout.splitlines() == ["show", "end"] and unit_states(empty.stdout.splitlines()) == []
