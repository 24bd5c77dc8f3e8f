"""``fleet status`` shows which models each host holds (issue 22, part 4): the cache listing in the
status probe's one command (run here through bash on real directories), its answer read back
(answers in the form hosts print them, written here: a listing, a refused ``sudo``, a cut-off
answer; tests/lab/test_status_lab.py reads the real ones), each host's models (pure), the
``--json`` shape and the lines under the table (table tests, and rich's console at 80 columns)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from fleet.cli.status_view import model_lines, status_view
from fleet.facts.hoststatus import HUB_EXIT, HUB_SEPARATOR, SEPARATOR, HostStatusProbe, read_listing
from fleet.facts.hub import folder_of, hub_dir, model_of
from fleet.facts.runner import HostUnreachable
from fleet.monitor.hoststate import host_models
from fleet.monitor.status import HeldModel, HostModels

from .test_units_fact import RECORDED, UNITS_PART

LLAMA, QWEN = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct"
SNAP = "0e9e39f249a16976918f6564b8830bc894c89659"

#: The listing part of ``HostStatusProbe().command(hub=...)``'s answer on a lab host whose cache
#: holds the lab's model (``refs/main`` names ``main``; its config.json, 451 bytes, and that ref, 5).
LAB_LISTING = [
    HUB_SEPARATOR,
    '{"repos": [["models--meta-llama--Llama-3.1-8B-Instruct", 456, false, "main"]], "named": []}',
    HUB_EXIT + "0",
]
#: The same where the SSH user may not ``sudo`` without a password.
REFUSED = [HUB_SEPARATOR, "sudo: a password is required", HUB_EXIT + "1"]


@pytest.mark.parametrize(
    ("model", "folder"),
    [
        (LLAMA, "models--meta-llama--Llama-3.1-8B-Instruct"),
        ("fleet-lora/sql", "models--fleet-lora--sql"),
        ("gpt2", "models--gpt2"),  # an id without an organisation
    ],
)
def test_model_ids_and_cache_folders_map_both_ways(model: str, folder: str) -> None:
    assert folder_of(model) == folder and model_of(folder) == model


def test_the_probe_lists_the_cache_only_when_asked_after_nvml() -> None:
    plain, listed = HostStatusProbe().command(), HostStatusProbe().command(hub=hub_dir())
    assert HUB_SEPARATOR not in plain and listed.startswith(plain)
    assert listed.index("FLEET_NVML_PROBE_EOF") < listed.index(HUB_SEPARATOR) < listed.index(HUB_EXIT)
    assert "sudo -n -- python3 - /var/lib/vllm/hf/hub '' '' 2>&1 <<" in listed  # no unit/revision words
    assert subprocess.run(["bash", "-n"], input=listed, text=True, check=False).returncode == 0


def _hub(tmp_path: Path) -> Path:
    hub = tmp_path / "hub"
    llama = hub / folder_of(LLAMA)
    (llama / "blobs").mkdir(parents=True)
    (llama / "refs").mkdir()
    (llama / "snapshots" / SNAP).mkdir(parents=True)
    (llama / "blobs" / "aa").write_bytes(b"x" * 5000)
    (llama / "snapshots" / SNAP / "model.safetensors").symlink_to("../../blobs/aa")  # counted once
    (llama / "refs" / "main").write_text(SNAP + "\n")
    qwen = hub / folder_of(QWEN) / ".fleet-incoming"
    qwen.mkdir(parents=True)
    (qwen / "part").write_bytes(b"y" * 300)
    (hub / "version.txt").write_text("1")  # not a repository
    return hub


def test_the_combined_command_runs_through_bash_and_reads_back(tmp_path: Path) -> None:
    """The whole command through bash, ``sudo -n --`` swapped for ``env --`` (no sudo here)."""
    hub = _hub(tmp_path)
    command = HostStatusProbe().command(hub=str(hub)).replace("sudo -n --", "env --")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    got = HostStatusProbe().process(proc.stdout.splitlines())
    assert got.models_error is None and got.models is not None
    assert [(r.model, r.bytes, r.snapshot, r.staging) for r in got.models.repos] == [
        (QWEN, 300, None, True),
        (LLAMA, 5000 + len(SNAP) + 1, SNAP, False),
    ]
    # a listing that fails (here: no such interpreter) is an error beside the units; the command exits 0
    proc = subprocess.run(
        ["bash", "-c", command.replace("env -- python3 -", "env -- no-such-python3 -")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = HostStatusProbe().process(proc.stdout.splitlines())
    assert got.models is None and got.models_error is not None
    assert got.models_error.startswith("listing the model cache exited 127: ") and "no-such-python3" in got.models_error


def test_recorded_answers() -> None:
    got = HostStatusProbe().process([*RECORDED, *LAB_LISTING])
    assert got.gpus is not None and got.gpu_error is None  # the NVML part is read as before
    assert got.units["units"]["fleet-vllm-0.service"]["active_state"] == "active"
    assert got.models is not None and [(r.model, r.bytes, r.snapshot, r.staging) for r in got.models.repos] == [
        (LLAMA, 456, "main", False)
    ]
    refused = HostStatusProbe().process([*RECORDED, *REFUSED])
    assert refused.models is None and refused.gpus is not None
    assert refused.models_error == "listing the model cache exited 1: sudo: a password is required"
    not_asked = HostStatusProbe().process(RECORDED)
    assert not_asked.models is None and not_asked.models_error is None
    # the NVML probe printed nothing, the listing still answered
    alone = HostStatusProbe().process([*UNITS_PART, SEPARATOR, *LAB_LISTING])
    assert alone.gpu_error == "the NVML probe printed nothing" and alone.models is not None


@pytest.mark.parametrize(
    ("part", "why"),
    [
        ([HUB_SEPARATOR, '{"repos": [["models--a--b", 1, false'], "was cut off"),  # the connection dropped
        ([HUB_SEPARATOR], "was cut off: no answer"),
        ([HUB_SEPARATOR, "garbage", HUB_EXIT + "0"], "hub listing: unreadable answer 'garbage'"),
        ([HUB_SEPARATOR, HUB_EXIT + "0"], "hub listing: unreadable answer ''"),
        ([HUB_SEPARATOR, HUB_EXIT + "141"], "exited 141: no output"),
    ],
)
def test_an_unreadable_listing_says_why(part: list[str], why: str) -> None:
    listing, error = read_listing(part[1:])
    assert listing is None and error is not None and why in error, error


def test_each_hosts_models() -> None:
    answers = {
        "h1": HostStatusProbe().process([*RECORDED, *LAB_LISTING]),
        "h2": HostUnreachable("h2", "unreachable: 127.0.9.2:22 refused the connection (no sshd listening)"),
        "h3": HostStatusProbe().process([*RECORDED, *REFUSED]),
        "h4": HostStatusProbe().process(RECORDED),
    }
    got = host_models(answers)
    assert list(got) == ["h1", "h2", "h3", "h4"]
    assert got["h1"] == HostModels("h1", (HeldModel(LLAMA, 456, "main", False),))
    assert got["h2"].models == () and got["h2"].error.startswith("host unreachable over SSH: unreachable: ")
    assert got["h3"].error == "listing the model cache exited 1: sudo: a password is required"
    assert got["h4"].error == "the model cache was not listed"
    assert got["h1"].data() == {
        "host": "h1",
        "models": [{"model": LLAMA, "bytes": 456, "snapshot": "main", "staging": False}],
        "models_error": None,
    }
    assert got["h3"].data()["models"] == [] and got["h3"].data()["models_error"].startswith("listing")


L8 = HeldModel(LLAMA, 16_060_000_000, SNAP, False)
Q7 = HeldModel(QWEN, 15_230_000_000, "a" * 40, True)


@pytest.mark.parametrize(
    ("held", "wide", "lines"),
    [
        ({"h1": (L8,), "h2": (L8,)}, False, [(f"h1, h2 hold {LLAMA}@0e9e39f249a1 (15.0 GiB)", False)]),
        (
            {"h1": (L8,), "h2": (L8,)},
            True,
            [(f"{h} holds {LLAMA}@0e9e39f249a1 (15.0 GiB)", False) for h in ("h1", "h2")],
        ),
        # five alike hosts: three named; the one that differs (a copy being staged) on its own line
        (
            {"h1": (L8,), "h2": (L8,), "h3": (L8, Q7), "h4": (L8,), "h5": (L8,), "h6": (L8,)},
            False,
            [
                (f"h1, h2, h4 and 2 more hold {LLAMA}@0e9e39f249a1 (15.0 GiB)", False),
                (f"h3 holds {LLAMA}@0e9e39f249a1 (15.0 GiB), {QWEN}@aaaaaaaaaaaa (14.2 GiB, being staged)", False),
            ],
        ),
        ({"h1": ()}, False, [("h1 holds no model", False)]),
        ({"h1": (HeldModel(LLAMA, 900, None, False),)}, False, [(f"h1 holds {LLAMA} (900 B)", False)]),
        # a host whose cache could not be listed: its own line, after the others
        (
            {"h1": "listing the model cache exited 1: sudo: a password is required", "h2": (L8,)},
            False,
            [
                (f"h2 holds {LLAMA}@0e9e39f249a1 (15.0 GiB)", False),
                ("h1: model cache not listed: listing the model cache exited 1: sudo: a password is required", True),
            ],
        ),
        ({}, False, []),  # --no-ssh: no lines
    ],
)
def test_the_lines_under_the_table(
    held: dict[str, tuple[HeldModel, ...] | str], wide: bool, lines: list[tuple[str, bool]]
) -> None:
    models = {
        h: HostModels(h, error=v) if isinstance(v, str) else HostModels(h, v) for h, v in held.items()
    }  # fmt: skip
    assert model_lines(models, wide) == lines


def test_the_view_at_80_columns_keeps_the_table_and_wraps_the_lines() -> None:
    from .test_status_view import fleet_rows

    many = {f"gpu-node-{i:03d}": HostModels(f"gpu-node-{i:03d}", (L8, Q7)) for i in range(40)}
    many["gpu-node-007"] = HostModels("gpu-node-007", error="host unreachable over SSH: timed out")
    console = Console(width=80, record=True, file=open(os.devnull, "w"), color_system=None)  # noqa: SIM115
    console.print(status_view(fleet_rows(), 2.0, False, many))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    flat = " ".join(text.split())
    assert "gpu-node-000, gpu-node-001, gpu-node-002 and 36 more hold meta-llama/Llama-3.1-8B-Instruct@" in flat
    assert "gpu-node-007: model cache not listed: host unreachable over SSH: timed out" in flat
    assert text.index("host") < text.index("gpu-node-000, ")  # under the table


def test_the_cli_says_which_hosts_caches_it_could_not_list(tmp_path: Path) -> None:
    """Through ``fleet status`` itself: hosts whose SSH port refuses are a ``hosts`` entry and a line
    saying why (the JSON's existing keys unchanged), never a traceback."""
    import json
    import sys

    from .test_status_view import HOSTS, refused_inventory

    with refused_inventory(tmp_path) as inv:
        out = {}
        for args in (["--json"], []):
            out[bool(args)] = subprocess.run(
                [sys.executable, "-m", "fleet.cli", "status", str(inv), "--interval", "0.2", *args],
                capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "COLUMNS": "80"},
            )  # fmt: skip
    proc = out[True]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) == {"instances", "hosts_without_plan", "hosts"}
    assert [h["host"] for h in data["hosts"]] == [name for name, _model in HOSTS]
    for h in data["hosts"]:
        assert h["models"] == [] and h["models_error"].startswith("host unreachable over SSH: "), h
    proc = out[False]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    flat = " ".join(proc.stdout.split())
    assert all(f"{name}: model cache not listed: host unreachable over SSH: " in flat for name, _m in HOSTS), flat
