"""Preflight decisions (pure): which planned instance would not start, and why."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fleet.deploy.preflight import refusals
from fleet.deploy.runner import _over
from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts, parse_probe
from fleet.facts.serve_check import InstanceCheck, ServeCheck, ServeCheckResult, serve_check_command
from fleet.plan.planner import Flag

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"


def probe(procs: dict[int, list[dict[str, Any]]] | None = None) -> HostFacts:
    d: dict[str, Any] = json.loads(json.loads((FIXTURES / "a100-sxm-8.json").read_text())["output"][-1])
    for g in d["gpus"]:
        g["processes"] = (procs or {}).get(g["index"], [])
    return parse_probe(d)


FLAGS = (
    Flag("--port", "8000", "base port 8000 + instance 0"),
    Flag("--no-enable-prefix-caching", None, "inventory turns prefix caching off"),
)


def plan() -> Any:
    inst = [
        SimpleNamespace(unit_name=f"vllm-{i}", gpus=(2 * i, 2 * i + 1), model="org/m", flags=FLAGS) for i in range(2)
    ]
    return SimpleNamespace(host="h1", vllm_version="0.33.0", instances=inst)


def ok(unit: str) -> InstanceCheck:
    return InstanceCheck(unit, None, True, "/var/lib/vllm/hf/hub/models--org--m")


UNITS = ("fleet-vllm-0.service", "fleet-vllm-1.service")
GOOD = ServeCheckResult(None, tuple(ok(u) for u in UNITS))
FOREIGN = {"pid": 4242, "used_memory": 1 << 30, "comm": "python3", "unit": "session-3.scope"}
OURS = {"pid": 77, "used_memory": 1 << 30, "comm": "vllm", "unit": "fleet-vllm-1.service"}


@pytest.mark.parametrize(
    ("check", "procs", "expected"),
    [
        (GOOD, {}, []),
        (GOOD, {3: [OURS], 0: [OURS]}, []),  # held by our own units: released by the restart
        (GOOD, {1: [FOREIGN]}, [("fleet-vllm-0.service", "gpus", "pid 4242")]),
        (GOOD, {5: [FOREIGN]}, []),  # a GPU no instance uses
        (
            ServeCheckResult(
                None,
                (InstanceCheck(UNITS[0], "vllm serve: error: unrecognized arguments: --x", True, ""), ok(UNITS[1])),
            ),
            {},
            [("fleet-vllm-0.service", "flags", "unrecognized arguments: --x")],
        ),
        (
            ServeCheckResult(None, (ok(UNITS[0]), InstanceCheck(UNITS[1], None, False, "/hub/models--org--m"))),
            {},
            [("fleet-vllm-1.service", "model", "not found on the host")],
        ),
        (ServeCheckResult("ModuleNotFoundError: No module named 'vllm'", ()), {}, [("*", "vllm", "No module named")]),
    ],
)
def test_refusals(check: ServeCheckResult, procs: Any, expected: list[tuple[str, str, str]]) -> None:
    got = refusals(plan(), check, probe(procs))
    assert [(r.instance, r.check) for r in got] == [(u, c) for u, c, _ in expected]
    for r, (_u, _c, text) in zip(got, expected, strict=True):
        assert text in r.reason and r.host == "h1" and r.way_out
        assert str(r).startswith("host h1, ")


@pytest.mark.parametrize(
    ("error", "way_out"),
    [
        ("vllm serve: error: unrecognized arguments: --no-enable-prefix-caching",
         "fleet planned --no-enable-prefix-caching: inventory turns prefix caching off; install a vLLM that takes "
         "it: fleet planned for vLLM 0.33.0 (vllm_version), from the index the inventory names (pip_index_url), "
         "or change that inventory setting so the flag is not planned"),
        ("vllm serve: error: argument --port: invalid int value: '8000x'", "fleet planned --port: base port 8000"),
        ("vllm serve: error: unrecognized arguments: --x", "or change the inventory setting behind the refused flag"),
    ],
)  # fmt: skip
def test_a_flag_refusal_names_the_flag_why_it_was_planned_and_the_way_out(error: str, way_out: str) -> None:
    check = ServeCheckResult(None, (InstanceCheck(UNITS[0], error, True, ""), ok(UNITS[1])))
    (refusal,) = refusals(plan(), check, probe())
    assert way_out in refusal.way_out and "vllm_args" not in refusal.way_out
    assert str(refusal).startswith(f"host h1, fleet-vllm-0.service: preflight flags: the host's vLLM refuses the "
                                   f"command line: {error}; ")  # fmt: skip


def test_no_probe_refuses_the_gpu_check() -> None:
    got = refusals(plan(), GOOD, None)
    assert {r.check for r in got} == {"gpus"} and len(got) == 2


@pytest.mark.parametrize(
    ("failed", "total", "percent", "over"),
    [(0, 3, 0, False), (1, 3, 0, True), (1, 3, 33, True), (1, 3, 34, False), (3, 3, 100, False), (1, 0, 0, False)],
)
def test_fail_percent(failed: int, total: int, percent: int, over: bool) -> None:
    assert _over(failed, total, percent) is over


def test_serve_check_command_quotes_the_argv_and_reads_the_answer() -> None:
    command = serve_check_command("/opt/x/bin/python", "vllm", "/var/lib/vllm/hf", [("u", ["m", "--a", "$(rm -rf /)"])])
    assert "sudo -n -u vllm -- env HF_HOME=/var/lib/vllm/hf HF_HUB_OFFLINE=1 /opt/x/bin/python -" in command
    assert '\'[{"unit": "u", "argv": ["m", "--a", "$(rm -rf /)"]}]\'' in command
    out = ServeCheck().process(
        ['{"error": null, "instances": [{"unit": "u", "parse": null, "model_found": true, "model_where": "/m"}]}']
    )
    assert out == ServeCheckResult(None, (InstanceCheck("u", None, True, "/m"),))


def test_unit_states_reads_its_lines_and_refuses_garbage() -> None:
    from fleet.facts.unit_states import UnitState, UnitStates

    got = UnitStates().process(
        ["now 1000.5 50.0", "begin fleet-vllm-0.service", "Id=fleet-vllm-0.service", "ActiveState=active",
         "ActiveEnterTimestamp=@900", "mtime 950", "end", "", "begin fleet-vllm-1.service", "ActiveState=inactive",
         "ActiveEnterTimestamp=", "mtime 950", "end"]
    )  # fmt: skip
    assert got == [UnitState("fleet-vllm-0.service", True, True), UnitState("fleet-vllm-1.service", False, False)]
    with pytest.raises(FleetError, match="unreadable line"):
        UnitStates().process(["fleet-vllm-0.service maybe"])


def test_unit_states_command_quotes_unit_and_paths() -> None:
    from fleet.facts.unit_states import unit_states_command

    command = unit_states_command([("u;reboot", ["/etc/a b", "/x"])])
    assert "'u;reboot'" in command and "'/etc/a b'" in command and "; reboot" not in command
