"""``vllm_extra_args`` (issue 23, part 4): any ``vllm serve`` flag, checked against the pinned vLLM's
real argument surface when the inventory is loaded, shown in the plan as set by you, escaped where
it lands (the unit's ``ExecStart=``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fleet.cli import main
from fleet.errors import InventoryError, PlanError
from fleet.gpus import HostGpus
from fleet.inventory.spec import load_inventory
from fleet.model.arch import load_model
from fleet.plan.extra_args import canonical, extra_args_problems, parse_extra_args
from fleet.plan.outcomes import load_for_planning
from fleet.plan.planner import SET_BY_YOU, plan_host
from fleet.plan.vllm_surface import parse_serve_argv
from fleet.render.units import exec_lines, unit_file
from tests.unit.conftest import spec

H100 = HostGpus.from_catalogue("h100-sxm-80gb", 1)


def verdicts(**extra: Any) -> list[str]:
    parsed = parse_extra_args(tuple(extra.items()), "0.33.0")
    return [why for _, _, why in parsed.problems]


def one(flag: str, value: Any) -> str:
    parsed = parse_extra_args(((flag, value),), "0.33.0")
    assert len(parsed.problems) == 1, parsed
    return parsed.problems[0][2]


@pytest.mark.parametrize(
    ("flag", "value", "argv"),
    [
        ("--enforce-eager", True, ["--enforce-eager"]),
        ("--enforce-eager", False, ["--no-enforce-eager"]),
        ("--disable-log-stats", True, ["--disable-log-stats"]),  # store_true
        ("enforce_eager", True, ["--enforce-eager"]),  # vLLM reads '_' as '-'; the '--' may be left out
        ("--max-num-queued-reqs", 512, ["--max-num-queued-reqs", "512"]),
        ("--enable-chunked-prefill", False, ["--no-enable-chunked-prefill"]),
        ("--enable-chunked-prefill", True, ["--enable-chunked-prefill"]),
        ("--compilation-config", '{"mode":3}', ["--compilation-config", '{"mode":3}']),
        ("--seed", -1, ["--seed", "-1"]),  # a negative number is a value, not a flag
        ("--middleware", ("a.b", "c.d"), ["--middleware", "a.b", "--middleware", "c.d"]),  # append: repeated
        ("--cudagraph-capture-sizes", (1, 2, 4), ["--cudagraph-capture-sizes", "1", "2", "4"]),  # nargs='+'
        ("--scheduling-policy", "priority", ["--scheduling-policy", "priority"]),
        ("--max-num-scheduled-tokens", "8k", ["--max-num-scheduled-tokens", "8k"]),  # vLLM's human_readable_int
    ],
)
def test_accepted_flags_become_argv(flag: str, value: Any, argv: list[str]) -> None:
    parsed = parse_extra_args(((flag, value),), "0.33.0")
    assert parsed.problems == ()
    assert parsed.argv() == argv
    parse_serve_argv(["m", *argv])  # and the surface parses the result


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--enforce-eagr", True, "not a flag of vLLM 0.33.0's `vllm serve`; did you mean '--enforce-eager'?"),
        ("--max-model-len", 4096, "planned by fleet: set workload.p95_input_tokens"),
        ("--port", 9000, "planned by fleet: set port instead"),
        ("--gpu-memory-utilization", 0.8, "set gpu_memory_utilization instead"),
        ("--device-memory-utilization", 0.8, "set gpu_memory_utilization instead"),  # an alias: same dest
        ("--disable-prefix-caching", True, "set prefix_caching instead"),
        ("--quantization", "fp8", "set weights instead"),
        ("--max-num-seqs", 64, "set serving_preset"),
        ("--api-key", "abc", "set api_key_ref"),
        ("--swap-space", 4, "removed in vLLM 0.18"),
        ("--speculative-model", "x/y", "in favour of --speculative-config"),
        ("--num-scheduler-steps", 8, "multi-step scheduling was removed"),
        ("--disable-log-requests", True, "deprecated no-op alias"),
        ("--log-config-file", "/etc/x.json", "use --logging-config"),
        ("--kv-cache-memory-bytes", "20G", "set gpu_memory_utilization instead"),
        ("--config", "/etc/vllm.yaml", "behind the plan's back"),
        ("--hf-token", "abc", "a secret in argv"),
        ("--enable-lora", True, "set lora_adapters"),
        ("--max-lora-rank", 64, "set max_lora_rank (with lora_adapters)"),
        ("--fully-sharded-loras", True, "counts unsharded"),
        ("--speculative-config", {"method": "ngram"}, "set speculative (fleet plans the draft"),
        ("--max-num-queued-reqs", "--enforce-eager", "starts with '-': vLLM would read it as another flag"),
        ("--tool-call-parser", ("a", "--x"), "takes one value, not a list"),
        ("--disable-log-stats", "yes", "a switch: true to give it"),
        ("--disable-log-stats", False, "false is vLLM's default"),
        ("--enforce-eager", "yes", "an enable/disable switch"),
        ("--enable-chunked-prefill", "on", "an enable/disable switch"),
        ("--no-enable-chunked-prefill", True, "write it as --enable-chunked-prefill: true or false"),
        ("--seed", True, "takes a value"),
        ("--seed", "x", "vLLM 0.33.0 refuses it: argument --seed: invalid int value: 'x'"),
        ("--scheduling-policy", "lifo", "invalid choice: 'lifo' (choose from 'fcfs', 'priority')"),
        ("--cudagraph-capture-sizes", ("1", "-2x"), "starts with '-'"),
    ],
)
def test_refused_flags_say_why_and_the_way_out(flag: str, value: Any, expected: str) -> None:
    assert expected in one(flag, value)


def test_the_same_setting_twice_is_refused() -> None:
    found = verdicts(**{"--enforce-eager": True, "enforce_eager": True})
    assert found == ["--enforce-eager is the same vLLM setting as '--enforce-eager': give it once"]


def test_canonical_spelling() -> None:
    assert canonical("max_num_seqs") == canonical("--max-num-seqs") == "--max-num-seqs"


# -- at the inventory boundary ---------------------------------------------------------------------


def write(tmp_path: Path, extra_args: Any, name: str = "inv.py") -> Path:
    path = tmp_path / name
    data = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
        "gpu": {"sku": "h100-sxm-80gb", "count": 1},
        "vllm_extra_args": extra_args,
    }
    path.write_text(f"nan = float('nan')\nhosts = ([('gpu-1', {{}})], {data!r})\n")
    return path


def test_load_for_planning_reports_every_refused_flag_with_file_host_field_value(tmp_path: Path) -> None:
    path = write(tmp_path, {"--enforce-eagr": True, "--max-model-len": 4096, "--seed": 3})
    with pytest.raises(InventoryError) as err:
        load_for_planning(path)
    shown = [str(p) for p in err.value.problems]
    assert shown == [
        f"{path}: host gpu-1: vllm_extra_args.--enforce-eagr=True: --enforce-eagr is not a flag of vLLM 0.33.0's "
        "`vllm serve`; did you mean '--enforce-eager'?",
        f"{path}: host gpu-1: vllm_extra_args.--max-model-len=4096: --max-model-len is planned by fleet: set "
        "workload.p95_input_tokens and workload.p95_output_tokens (fleet derives --max-model-len) instead",
    ]


@pytest.mark.parametrize(
    ("extra_args", "field", "expected"),
    [
        ({"-sc": "{}"}, "vllm_extra_args.-sc", "long name"),
        ({"--max-num-seqs=8 --enforce-eager": True}, "vllm_extra_args.--max-num-seqs=8 --enforce-eager", "long name"),
        ({"--chat-template": "a\n--x"}, "vllm_extra_args.--chat-template", "one line"),
        ({"--seed": float("nan")}, "vllm_extra_args.--seed", "finite number"),
        ({"--seed": None}, "vllm_extra_args.--seed", "true (a switch"),
        ({"--seed": [[1]]}, "vllm_extra_args.--seed", "true (a switch"),
        (["--enforce-eager"], "vllm_extra_args", "dict"),
    ],
)
def test_the_shape_is_checked_by_the_schema(tmp_path: Path, extra_args: Any, field: str, expected: str) -> None:
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, extra_args))
    (problem,) = err.value.problems
    assert problem.field == field
    assert expected in problem.allowed


def test_a_secret_shaped_value_is_refused_and_never_shown(tmp_path: Path) -> None:
    token = "hf_" + "a1B2c3D4e5F6g7H8i9J0kLmNoPqRsTuV"
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, {"--tokenizer": token}))
    assert token not in str(err.value)


def test_plan_host_refuses_what_the_load_refuses() -> None:
    s = spec(vllm_extra_args={"--max-model-len": 4096})
    assert extra_args_problems(s)
    with pytest.raises(PlanError, match="--max-model-len is planned by fleet"):
        plan_host(s, H100, load_model(s.model))


# -- in the plan, the unit and --json ---------------------------------------------------------------

HOSTILE = "/etc/x y;$HOME %n \"q\" 'r' `id`.jinja"


def test_extra_flags_come_after_fleets_marked_set_by_you_and_the_argv_parses() -> None:
    s = spec(vllm_extra_args={"--enforce-eager": True, "--max-num-queued-reqs": 512, "--chat-template": HOSTILE})
    plan = plan_host(s, H100, load_model(s.model))
    inst = plan.instances[0]
    mine = [f for f in inst.flags if f.set_by == SET_BY_YOU]
    assert [(f.option, f.value) for f in mine] == [
        ("--enforce-eager", None),
        ("--max-num-queued-reqs", "512"),
        ("--chat-template", HOSTILE),
    ]
    assert inst.flags[-3:] == tuple(mine)
    assert all(f.reason == "set by you (vllm_extra_args)" for f in mine)
    parsed = parse_serve_argv(inst.argv)
    assert parsed.enforce_eager is True and parsed.chat_template == HOSTILE and parsed.max_num_queued_reqs == "512"


def test_a_hostile_value_is_one_quoted_word_in_exec_start() -> None:
    s = spec(vllm_extra_args={"--chat-template": HOSTILE})
    plan = plan_host(s, H100, load_model(s.model))
    line = exec_lines(plan.instances[0])[-1]
    assert line == '--chat-template "/etc/x y;$$HOME %%n \\"q\\" \'r\' `id`.jinja"'
    # systemd's unquoting of a double-quoted word is C-style, like the shell's for these characters
    words = shlex.split(line.replace("$$", "$").replace("%%", "%"))  # shlex expands nothing
    assert words == ["--chat-template", HOSTILE]
    unit = unit_file(plan, plan.instances[0]).content
    assert unit.count("\nExecStart=") == 1


def test_without_the_key_the_plan_has_no_set_by(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["plan", "inventory/prod.py", "--offline", "--json"])
    assert result.exit_code == 0, result.output
    assert '"set_by"' not in result.output


def test_plan_json_and_table_show_set_by_you(tmp_path: Path) -> None:
    path = write(tmp_path, {"--cudagraph-capture-sizes": [1, 2, 4], "--enforce-eager": True})
    result = CliRunner().invoke(main, ["plan", str(path), "--offline", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    hosts = data["hosts"] if isinstance(data, dict) else data
    flags = hosts[0]["instances"][0]["flags"]
    assert flags[-2:] == [
        {
            "option": "--cudagraph-capture-sizes",
            "value": "1",
            "values": ["1", "2", "4"],
            "reason": "set by you (vllm_extra_args)",
            "set_by": "you",
        },
        {"option": "--enforce-eager", "value": None, "reason": "set by you (vllm_extra_args)", "set_by": "you"},
    ]
    assert hosts[0]["instances"][0]["argv"][-5:] == ["--cudagraph-capture-sizes", "1", "2", "4", "--enforce-eager"]
    table = CliRunner().invoke(main, ["plan", str(path), "--offline"], env={"COLUMNS": "120"})
    assert table.exit_code == 0, table.output
    assert "1 2 4" in table.output and "set by you (vllm_extra_args)" in table.output


def test_a_refused_flag_exits_2_before_any_host_is_touched(tmp_path: Path) -> None:
    path = write(tmp_path, {"--swap-space": 4})
    result = CliRunner().invoke(main, ["plan", str(path)])  # not --offline: it would probe, after loading
    assert result.exit_code == 2
    assert "vllm_extra_args.--swap-space=4: --swap-space: removed in vLLM 0.18" in result.output
