"""The pure parts of the SSH executor and the rollout CLI: parsing what hosts answer, options → policy."""

from __future__ import annotations

import pytest

from fleet.cli.rollout import overrides_of
from fleet.facts.releases import release_from_exe, release_of
from fleet.rollout.gates import UnitState
from fleet.rollout.policy import parse_policy
from fleet.rollout.ssh_executor import parse_unit


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("ActiveState=active\nSubState=running\nNRestarts=0\nMainPID=4242\n", UnitState("active", "running", 0, 4242)),
        ("ActiveState=activating\nSubState=auto-restart\nNRestarts=3\nMainPID=0\n",
         UnitState("activating", "auto-restart", 3, 0)),
        ("ActiveState=inactive\nSubState=dead\nNRestarts=\nMainPID=0\n", UnitState("inactive", "dead", 0, 0)),
        ("current=releases/a\n", None),
    ],
)  # fmt: skip
def test_parse_unit(text: str, unit: UnitState | None) -> None:
    assert parse_unit(text) == unit


@pytest.mark.parametrize(
    ("target", "release"),
    [("releases/vllm-0.33.0-abc", "vllm-0.33.0-abc"), ("releases/x/", "x"), ("", None), ("  \n", None)],
)
def test_release_of_link(target: str, release: str | None) -> None:
    assert release_of(target) == release


@pytest.mark.parametrize(
    ("exe", "release"),
    [
        ("/opt/fleet/vllm/releases/r1/bin/python", "r1"),
        ("/opt/fleet/vllm/current/bin/python", None),  # not resolved: cannot tell
        ("/usr/bin/python3", None),
        ("/opt/fleet/vllm/releasesX/r1/bin/python", None),
        ("", None),
    ],
)
def test_release_from_the_process_interpreter(exe: str, release: str | None) -> None:
    assert release_from_exe(exe, "/opt/fleet/vllm/") == release


def test_command_line_overrides_become_a_valid_policy() -> None:
    opts = {"batches": "1, 2,25%,-1", "max_unavailable": "2", "soak_s": 5.0, "on_failure": "halt",
            "health_timeout": 600.0, "canary_bake_s": None, "probe_interval_s": None}  # fmt: skip
    over = overrides_of(opts)
    assert over == {"batches": [1, 2, "25%", -1], "max_unavailable": 2, "soak_s": 5.0, "on_failure": "halt",
                    "timeouts.health": 600.0}  # fmt: skip
    policy = parse_policy(None, source="inv.py", where="group all", overrides=over)
    assert policy.batches == (1, 2, "25%", -1) and policy.timeouts.health == 600.0


def test_a_bad_override_names_the_command_line() -> None:
    from fleet.rollout.errors import PolicyError

    with pytest.raises(PolicyError, match="command line"):
        parse_policy(None, source="inv.py", where="group all", overrides=overrides_of({"batches": "0"}))


def _state(status: str = "running") -> object:
    from dataclasses import replace

    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.engine import RolloutStatus, Target, new_rollout
    from fleet.rollout.policy import RolloutPolicy

    refs = [InstanceRef("h0", "vllm-0"), InstanceRef("h1", "vllm-0")]
    s = new_rollout("R1", "/inv.py", "rollout", [Target(r, "b", "m") for r in refs], RolloutPolicy(batches=(1, -1)), 0)
    s = replace(s, current=(refs[0],), status=RolloutStatus(status), reason="why")
    return s


def test_live_view_shows_batch_instance_step_and_time_waited() -> None:
    from io import StringIO

    from rich.console import Console

    from fleet.cli.rollout import _view

    out = StringIO()
    Console(file=out, width=200).print(_view(_state(), 12.0))  # type: ignore[arg-type]
    text = out.getvalue()
    assert "fleet rollout R1: batch 1/2" in text and "h0" in text and "pending" in text and "12s" in text
    assert "h1" not in text  # only the batch in progress


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ("running", "resume with: fleet rollout --resume R1"),
        ("done", "to undo it: fleet rollback R1"),
        ("halted", "halted: why"),
    ],
)
def test_next_steps_tell_the_on_call_what_to_do(status: str, expected: str) -> None:
    from fleet.cli.rollout import next_steps

    assert any(expected in line for line in next_steps(_state(status)))  # type: ignore[arg-type]


def test_a_hook_on_the_host_is_its_argv_under_timeout_and_quoted_for_the_remote_shell() -> None:
    import shlex

    from fleet.rollout.ssh_executor import host_hook_command

    argv = ["sh", "-c", 'echo "disable server be/vllm-0" | socat stdio /run/haproxy.sock', "a b; rm -rf / $(x)"]
    command = host_hook_command(argv, 30)
    assert shlex.split(command) == ["timeout", "-k", "5", "30", *argv]  # the remote shell sees exactly the argv
    assert host_hook_command(["lb"], 2.5).startswith("timeout -k 5 2.5 lb")


@pytest.mark.parametrize(
    ("rc", "out", "err", "expected"),
    [
        (0, "drained\n", "", "drained\n"),
        (124, "", "", "host gpu01: hook lbctl timed out after 30s (hooks.timeout_s) and was ended on the host"),
        (137, "", "", "host gpu01: hook lbctl timed out after 30s (hooks.timeout_s) and was ended on the host"),
        (127, "", "timeout: failed to run command 'lbctl': No such file or directory",
         "host gpu01: hook lbctl: command not found on the host (timeout: failed to run command 'lbctl': No such "
         "file or directory); install it there"),
        (126, "", "timeout: failed to run command 'lbctl': Permission denied",
         "host gpu01: hook lbctl: not executable on the host (timeout: failed to run command 'lbctl': Permission "
         "denied)"),
        (3, "", "backend be/vllm-0 not found\n", "host gpu01: hook lbctl exited 3: backend be/vllm-0 not found"),
    ],
)  # fmt: skip
def test_what_a_hook_on_the_host_answered(rc: int, out: str, err: str, expected: str) -> None:
    from fleet.rollout.executor import ExecutorError
    from fleet.rollout.ssh_executor import host_hook_result

    argv = ["lbctl", "disable", "be/vllm-0"]
    if rc == 0:
        assert host_hook_result("gpu01", argv, 30, rc, out, err) == expected
        return
    with pytest.raises(ExecutorError) as exc:
        host_hook_result("gpu01", argv, 30, rc, out, err)
    assert str(exc.value) == expected


def test_next_steps_for_an_instance_whose_host_is_down_say_to_bring_it_back() -> None:
    from dataclasses import replace

    from fleet.cli.rollout import next_steps
    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.engine import Phase

    state = _state("halted")
    ref = InstanceRef("h0", "vllm-0")
    down = replace(
        state.inst(ref),  # type: ignore[attr-defined]
        phase=Phase.ROLLBACK_FAILED,
        rolling_back=True,
        rollback_failure="host unreachable during drain: host h0: SSH failed: [Errno 111] Connection refused",
    )
    lines = next_steps(replace(state, instances={**state.instances, ref: down}))  # type: ignore[type-var, attr-defined]
    assert any(
        line.startswith("h0/vllm-0 is not serving: host h0 cannot be reached (host unreachable during drain")
        and "Bring h0 back" in line
        and "fleet rollback R1" in line
        for line in lines
    ), lines
    assert not any("journalctl" in line for line in lines)


# ---- one line per failure (issue 25.8) -------------------------------------------------------------


def test_a_script_is_named_in_errors_by_its_name_never_by_its_text() -> None:
    from fleet.rollout.ssh_executor import command_label

    assert command_label(["sh", "-c", "set -e; " + "x" * 1200, "fleet-switch", "/opt/fleet/vllm"]) == (
        "the fleet-switch script"
    )
    assert command_label(["systemctl", "stop", "--", "fleet-vllm-0.service"]) == (
        "`systemctl stop -- fleet-vllm-0.service`"
    )
    assert len(command_label(["echo", "y" * 500])) <= 102


def test_a_failed_switch_says_what_failed_in_one_short_line() -> None:
    """Before: the whole ~1,200-character switch script, 2-3 times over in the error."""
    from fleet.facts.runner import SshTarget
    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.executor import ExecutorError
    from fleet.rollout.ssh_executor import InstanceSpec, SshExecutor

    ref = InstanceRef("h0", "vllm-0")
    spec = InstanceSpec(ref, "fleet-vllm-0.service", "http://127.0.0.1:8000", 8000, (0,), "m")
    executor = SshExecutor({"h0": SshTarget("h0", "127.0.0.1")}, {ref: spec})
    sent: list[tuple[str, str]] = []

    def run(command: str, timeout: float, stdin: bytes = b"", *, resend: bool = True, label: str = "") -> object:
        sent.append((command, label))
        return 3, "", "release bad is not installed (no /opt/fleet/vllm/releases/bad/.fleet-release.json)\n"

    executor._conns["h0"].run = run  # type: ignore[method-assign]
    with pytest.raises(ExecutorError) as exc:
        executor.flip_release(ref, "bad")
    assert str(exc.value) == (
        "host h0: the fleet-switch script exited 3: release bad is not installed "
        "(no /opt/fleet/vllm/releases/bad/.fleet-release.json)"
    )
    assert len(sent[0][0]) > 1000 and sent[0][1] == "the fleet-switch script"  # the script went, not into errors


def test_next_steps_name_every_instance_the_rollout_stopped_that_is_not_back() -> None:
    from dataclasses import replace

    from fleet.rollout.advice import left_down, next_steps
    from fleet.rollout.batches import InstanceRef
    from fleet.rollout.engine import Phase

    state = _state("halted")
    ref = InstanceRef("h0", "vllm-0")
    failed = replace(
        state.inst(ref),  # type: ignore[attr-defined]
        phase=Phase.FAILED,
        changed=True,
        failure="stop failed: host h0: SSH failed: unreachable: no answer to SSH keepalives for 12s",
    )
    halted = replace(state, instances={**state.instances, ref: failed})  # type: ignore[type-var, attr-defined]
    assert [i.ref for i in left_down(halted)] == [ref]  # type: ignore[arg-type]
    lines = next_steps(halted)  # type: ignore[arg-type]
    assert (
        "h0/vllm-0 is not serving: this rollout stopped it and it is not back (stop failed: host h0: SSH failed: "
        "unreachable: no answer to SSH keepalives for 12s). Bring h0 back, then run the rollout again (`--limit h0`)"
    ) in lines, lines
    stopped = next_steps(replace(halted, status=_state("running").status, reason=""))  # type: ignore[type-var, attr-defined]
    assert stopped[-1] == "stopped between steps; resume with: fleet rollout --resume R1"
    assert any(
        line.startswith("h0/vllm-0 is not serving: this rollout stopped it and it is not back") for line in stopped
    )
