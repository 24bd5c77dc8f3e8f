"""``fleet status`` for people: the state column, short model names, and a view that fits 80
columns (with every other column behind ``--wide``), read back from rich's own console at 80,
120 and 200 columns and from a real terminal (tmux)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from fleet.cli.status_view import pack, short_model, short_models, status_view
from fleet.monitor.histograms import Quantile
from fleet.monitor.intervals import IntervalStats
from fleet.monitor.status import Health, InstanceStatus, State, UnitFacts, problems_of, state_of, status_data
from fleet.monitor.targets import Target
from fleet.monitor.thresholds import Thresholds
from tests.terminal import Terminal, table_rows

REPO = Path(__file__).resolve().parents[2]


def unit(state: str, uptime: float | None = 3723.0, restarts: int | None = 0) -> UnitFacts:
    release = "vllm-0.33.0-py3.11.2-0123456789ab"
    return UnitFacts(
        state, uptime, restarts, f"/opt/fleet/vllm/releases/{release}", 41 * 2**30, release, "0.33.0", 4242
    )


UNREACHABLE = UnitFacts("unreachable", None, None, None, None, detail="cannot reach the host over SSH: timed out")


@pytest.mark.parametrize(
    ("health", "unit_state", "state"),
    [
        (Health.READY, "active/running", State.READY),
        (Health.READY, None, State.READY),
        (Health.READY, "unreachable", State.READY),  # vLLM serves; the SSH problem is a note
        (Health.READY, "deactivating/stop-sigterm", State.STOPPING),  # /health stays 200 while it drains
        (Health.NOT_LISTENING, "active/running", State.LOADING),  # vLLM listens only once loaded
        (Health.NOT_LISTENING, "activating/start", State.LOADING),
        (Health.NOT_LISTENING, "activating/auto-restart", State.RESTARTING),
        (Health.NOT_LISTENING, "inactive/dead", State.STOPPED),
        (Health.UNREACHABLE, "inactive/dead", State.STOPPED),  # the unit says why
        (Health.NOT_LISTENING, "failed/failed", State.FAILED),
        (Health.NOT_LISTENING, "not installed", State.NO_UNIT),
        (Health.NOT_LISTENING, "deactivating/stop-sigterm", State.STOPPING),
        (Health.NOT_LISTENING, None, State.NOT_LISTENING),  # --no-ssh: nothing says why
        (Health.NOT_LISTENING, "unreachable", State.NOT_LISTENING),
        (Health.UNREACHABLE, None, State.UNREACHABLE),
        (Health.UNREACHABLE, "unreachable", State.UNREACHABLE),
        (Health.UNREACHABLE, "active/running", State.UNREACHABLE),  # runs, but HTTP does not get there
        (Health.ENGINE_DEAD, "active/running", State.ENGINE_DEAD),
        (Health.ERROR, "active/running", State.ERROR),
    ],
)
def test_state_of(health: Health, unit_state: str | None, state: State) -> None:
    facts = None if unit_state is None else (UNREACHABLE if unit_state == "unreachable" else unit(unit_state))
    assert state_of(health, facts) is state
    row = InstanceStatus(Target("h", "g", "m", 0, "127.0.0.1", 8000, "0.33.0"), health, unit=facts)
    assert row.state is state and status_data(row)["state"] == state.value


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct"),
        ("Qwen/Qwen3-30B-A3B-FP8", "Qwen3-30B-A3B-FP8"),
        ("/srv/models/llama-70b-awq/", "llama-70b-awq"),
        ("/srv/models/llama-70b-awq", "llama-70b-awq"),
        ("chat-prod", "chat-prod"),  # a served_model_name
        ("/", "/"),  # nothing after the slash: as it is, never empty
    ],
)
def test_short_model(name: str, short: str) -> None:
    assert short_model(name) == short


def test_short_models_keep_names_that_would_read_the_same_in_full() -> None:
    names = ["meta-llama/Llama-3.1-8B-Instruct", "acme/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-72B-Instruct"]
    assert short_models(names * 2) == {
        "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct",
        "acme/Llama-3.1-8B-Instruct": "acme/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-72B-Instruct": "Qwen2.5-72B-Instruct",
    }


@pytest.mark.parametrize(
    ("first", "rest", "extra", "width", "parts"),
    [
        (40, 20, [5, 5], 80, [[0, 1]]),  # all beside the default columns
        (40, 20, [], 80, [[]]),
        (78, 20, [5, 5], 80, [[], [0, 1]]),  # none fits beside them: a second table
        (60, 30, [10, 10, 10, 10], 80, [[0], [1, 2, 3]]),  # 60+2+10=72; 72+12 > 80
        (60, 30, [10, 10, 10, 10, 10, 10], 80, [[0], [1, 2, 3, 4], [5]]),  # 30+4*12=78
        (60, 30, [100, 5], 80, [[], [0], [1]]),  # too wide for any table: one of its own
        (10, 10, [68], 80, [[0]]),  # exactly 80
    ],
)
def test_pack(first: int, rest: int, extra: list[int], width: int, parts: list[list[int]]) -> None:
    assert pack(first, rest, extra, width) == parts


# -- the views, read back as text ---------------------------------------------------------------------

MODELS = {
    "gpu-node-017.iad2.example": "meta-llama/Llama-3.1-70B-Instruct",
    "gpu-node-018.iad2.example": "/srv/models/mistral-7b-instruct-v0.3-awq",
    "l40s-a": "Qwen/Qwen2.5-72B-Instruct",
}
SHORT = {
    "meta-llama/Llama-3.1-70B-Instruct": "Llama-3.1-70B-Instruct",
    "/srv/models/mistral-7b-instruct-v0.3-awq": "mistral-7b-instruct-v0.3-awq",
    "Qwen/Qwen2.5-72B-Instruct": "Qwen2.5-72B-Instruct",
}


def fleet_rows() -> list[InstanceStatus]:
    """A fleet in every state, with long host and model names and problems."""

    def t(host: str, i: int) -> Target:
        return Target(host, "g", MODELS[host], i, "127.0.0.1", 8000 + i, "0.33.0")

    ttft = Quantile(0.5, 0.21, 0.1, 0.25, 40)
    iv = IntervalStats(
        2.0, 40, 0, 1800, ttft, ttft, Quantile(0.5, 1.2, 1.0, 2.5, 40), Quantile(0.99, 3.4, 2.5, 5.0, 40)
    )
    refused = "connection refused (loading, stopped or crashed)"
    h1, h2, h3 = MODELS
    rows = [
        InstanceStatus(t(h1, 0), Health.READY, "", "0.33.0", 0.42, 12, 0, iv, unit("active/running")),
        InstanceStatus(t(h1, 1), Health.READY, "", "0.33.0", 0.97, 64, 31, iv, unit("active/running")),
        InstanceStatus(t(h2, 0), Health.NOT_LISTENING, refused, unit=unit("active/running", 20)),
        InstanceStatus(t(h2, 1), Health.NOT_LISTENING, refused, unit=unit("inactive/dead", None)),
        InstanceStatus(t(h3, 0), Health.UNREACHABLE, "timed out", unit=UNREACHABLE),
        InstanceStatus(t(h3, 1), Health.READY, "", "0.33.0", 0.1, 1, 0, iv, unit("deactivating/stop-sigterm")),
    ]
    return [replace(r, problems=problems_of(r, Thresholds())) for r in rows]


def render(rows: list[InstanceStatus], width: int, wide: bool = False) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    console.print(status_view(rows, 2.0, wide))
    console.file.close()
    return console.export_text()


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every table on the screen (each starts with a header line beginning with "host")."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("host "):
            out.append(table_rows("\n".join(lines[i:])))
    return out


def assert_every_row_readable(text: str, rows: list[InstanceStatus], width: int) -> list[dict[str, str]]:
    """No line is wider than the terminal; the first table has one row per instance with its
    host, instance, state and model (short form) in full."""
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, text
    seen = tables(text)[0]
    assert len(seen) == len(rows), text
    for row, cells in zip(rows, seen, strict=True):
        t = row.target
        assert (cells["host"], cells["inst"], cells["state"]) == (t.host, str(t.index), row.state.value), text
        assert cells["model"] == SHORT[t.model], text
    return seen


@pytest.mark.parametrize("width", [80, 120, 200])
def test_default_view_fits_and_keeps_host_instance_state_model(width: int) -> None:
    rows = fleet_rows()
    text = render(rows, width)
    seen = assert_every_row_readable(text, rows, width)
    assert [c["run/wait"] for c in seen] == ["12/0", "64/31", "-", "-", "-", "1/0"], text
    assert len(tables(text)) == 1 and "release" not in text and "GiB" not in text  # the rest is --wide's
    assert [r.state.value for r in rows] == ["ready", "ready", "loading", "stopped", "unreachable", "stopping"]
    # every reason and broken threshold, under the table, one instance per line, in full
    notes = " ".join(text.split("\n\n", 2)[-1].split())
    for row in rows[1:]:
        assert f"{row.target.instance}:" in notes, text
        for problem in row.problems:
            assert " ".join(problem.split()) in notes, (problem, text)
    assert "connection refused" in notes and "timed out" in notes
    assert f"{rows[0].target.instance}:" not in notes  # nothing to say about a fine instance


@pytest.mark.parametrize("width", [80, 120, 200])
def test_wide_view_shows_every_value_at_any_width(width: int) -> None:
    rows = fleet_rows()
    text = render(rows, width, wide=True)
    assert_every_row_readable(text, rows, width)
    found = tables(text)
    assert len(found) > 1, text  # what does not fit beside the default columns goes into more tables
    merged: list[dict[str, str]] = [{} for _ in rows]
    for table in found:
        for row, cells in zip(rows, table, strict=True):
            # each further table is led by the same host, instance and state
            assert (cells["host"], cells["inst"], cells["state"]) == (row.target.host, str(row.target.index),
                                                                      row.state.value), text  # fmt: skip
            for k, v in cells.items():
                merged[rows.index(row)][k] = v
    first = merged[0]
    assert first["vLLM"] == "0.33.0" and first["KV"] == "42%" and first["req/s"] == "20.0", text
    assert first["unit"] == "active/running 1h02m" and first["restarts"] == "0", text
    assert first["release"] == "vllm-0.33.0-py3.11.2-0123456789ab" and first["GPU mem"] == "41.0 GiB", text
    assert merged[4]["unit"] == "unreachable" and merged[4]["GPU mem"] == "n/a", text


def test_wide_view_of_a_lab_fleet_is_one_table_at_200_columns() -> None:
    rows = [replace(r, target=replace(r.target, host=f"lab-h{i // 2 + 1}")) for i, r in enumerate(fleet_rows()[:4])]
    text = render(rows, 200, wide=True)
    assert len(tables(text)) == 1 and "GPU mem" in text and "release" in text, text


def test_a_host_name_too_long_for_the_terminal_wraps_and_is_never_cut() -> None:
    rows = fleet_rows()[:1]
    host = "h" * 70 + ".example"
    text = render([replace(rows[0], target=replace(rows[0].target, host=host))], 80)
    assert all(len(line) <= 80 for line in text.splitlines()) and "…" not in text, text
    body = text.split("─" * 10, 1)[1].strip("─\n").splitlines()
    assert "".join(line.split()[0] for line in body if line.strip()).startswith(host), text
    assert "ready" in text and "0" in body[0].split()


# -- through the real command line ---------------------------------------------------------------------


HOSTS = (("gpu-node-017.iad2.example", "meta-llama/Llama-3.1-8B-Instruct"),
         ("gpu-node-018.iad2.example", "mistralai/Mistral-7B-Instruct-v0.3"))  # fmt: skip


@contextlib.contextmanager
def refused_inventory(tmp_path: Path) -> Iterator[Path]:
    """An inventory of two one-GPU hosts on loopback ports that are bound but never listen (so
    every connection is refused, and no one else can take the port meanwhile)."""
    wl = {"p95_input_tokens": 1000, "p95_output_tokens": 100, "prefix_reuse": 0.0, "target_concurrency": 4}
    with socket.socket() as a, socket.socket() as b:
        hosts = []
        for sock, (name, model) in zip((a, b), HOSTS, strict=True):
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            hosts.append((name, {"ssh_hostname": "127.0.0.1", "port": port, "model": model,
                                 "gpu": {"sku": "a10-24gb"}, "workload": wl}))  # fmt: skip
        inv = tmp_path / "inv.py"
        inv.write_text(f"edge = {hosts!r}\n")
        yield inv


def test_json_keeps_every_field_and_adds_state(tmp_path: Path) -> None:
    with refused_inventory(tmp_path) as inv:
        proc = subprocess.run(
            [sys.executable, "-m", "fleet.cli", "status", str(inv), "--interval", "0.2", "--no-ssh", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    (row, _other) = json.loads(proc.stdout)["instances"]
    before = {"host", "group", "instance", "url", "model", "pinned_vllm_version", "vllm_version", "health",
              "detail", "kv_cache_usage", "requests_running", "requests_waiting", "interval", "unit", "problems",
              "ok"}  # fmt: skip
    # drained, balancer, quarantine: fleet drain, fleet.lb, the GPU watcher; expected_vllm_version:
    # the release the host must report (vllm_cpu.version on a lab host of vLLM's CPU build)
    assert set(row) == before | {"state", "drained", "balancer", "quarantine", "expected_vllm_version"}
    assert row["expected_vllm_version"] == row["pinned_vllm_version"]
    assert row["drained"] is None and row["balancer"] is None and row["quarantine"] == []
    assert (row["state"], row["health"]) == ("not listening", "not listening")


EXPECTED = [(host, "0", "not listening", model.partition("/")[2]) for host, model in HOSTS]


@pytest.mark.parametrize(("columns", "wide"), [(80, False), (120, False), (200, False), (120, True), (200, True)])
def test_in_a_real_terminal_every_row_shows_host_instance_state_and_model(
    tmp_path: Path, columns: int, wide: bool
) -> None:
    with refused_inventory(tmp_path) as inv, Terminal(tmp_path, columns, 50) as term:
        argv = [sys.executable, "-m", "fleet.cli", "status", str(inv), "--interval", "0.2", "--no-ssh"]
        term.start([*argv, *(["--wide"] if wide else [])], os.environ, REPO)
        rc, screen = term.wait_exit(timeout=60)
    assert rc == 1, screen
    assert "Traceback" not in screen
    assert all(len(line) <= columns for line in screen.splitlines()), screen
    rows = tables(screen)[0]
    assert [(r["host"], r["inst"], r["state"], r["model"]) for r in rows] == EXPECTED, screen
    assert "gpu-node-018.iad2.example/vllm-0: connection refused" in " ".join(screen.split()), screen
    if wide:
        assert "GPU mem" in screen and "release" in screen and "n/a without SSH facts" in screen, screen


def test_watch_in_a_real_terminal_redraws_in_place_until_ctrl_c(tmp_path: Path) -> None:
    with refused_inventory(tmp_path) as inv, Terminal(tmp_path, 80, 40) as term:
        argv = [sys.executable, "-m", "fleet.cli", "status", str(inv), "--interval", "0.3", "--no-ssh", "--watch"]
        term.start(argv, os.environ, REPO)
        term.wait_for("Ctrl-C to stop", timeout=60)
        time.sleep(1)  # a few more refreshes
        screen = term.screen()
        term.send_keys("C-c")
        rc, after = term.wait_exit(timeout=30)
    assert screen.count("fleet status:") == 1 and screen.count("Ctrl-C to stop") == 1, screen  # redrawn in place
    rows = tables(screen)[0]
    assert [(r["host"], r["inst"], r["state"], r["model"]) for r in rows] == EXPECTED, screen
    assert rc == 0 and "Traceback" not in after, after
