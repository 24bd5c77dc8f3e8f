"""Pruning models (issue 22, part 2): the verdicts (table tests), and the host-side listing and
removal scripts run here on real directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.weights.prune import (
    LIST_SCRIPT,
    REMOVE_SCRIPT,
    HubListing,
    HubRepo,
    Keep,
    decide,
    folder_of,
    parse_listing,
    to_remove,
)

LLAMA, QWEN, DRAFT = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.2-1B"


def listing(*folders: str, named: tuple[str, ...] = (), staging: tuple[str, ...] = ()) -> HubListing:
    return HubListing(tuple(HubRepo(f, 100, f in staging) for f in folders), frozenset(named))


@pytest.mark.parametrize(
    ("held", "planned", "named", "staging", "expected"),
    [
        ((folder_of(LLAMA),), (LLAMA,), (), (), [Keep.PLANNED]),
        ((folder_of(LLAMA), folder_of(QWEN)), (LLAMA,), (), (), [Keep.PLANNED, Keep.PRUNE]),
        # a stored revision (what a rollback puts back) still serves Qwen: kept
        ((folder_of(LLAMA), folder_of(QWEN)), (LLAMA,), (QWEN,), (), [Keep.PLANNED, Keep.REVISION]),
        ((folder_of(QWEN),), (LLAMA,), (), (folder_of(QWEN),), [Keep.STAGING]),  # being copied into
        (
            (folder_of(DRAFT), "models--fleet-lora--sql"),
            (LLAMA, DRAFT, "fleet-lora/sql"),
            (),
            (),
            [Keep.PLANNED, Keep.PLANNED],
        ),
        (("models--fleet-lora--old",), (LLAMA,), ("fleet-lora/sql",), (), [Keep.PRUNE]),
        (("models--.hidden",), (), (), (), [Keep.FOREIGN]),
        ((), (LLAMA,), (), (), []),
    ],
)
def test_a_model_is_pruned_only_when_nothing_planned_or_kept_names_it(
    held: tuple[str, ...], planned: tuple[str, ...], named: tuple[str, ...], staging: tuple[str, ...],
    expected: list[Keep],
) -> None:  # fmt: skip
    verdicts = decide(listing(*held, named=named, staging=staging), planned)
    assert [v.keep for v in verdicts] == expected
    assert to_remove(verdicts) == [v.folder for v in verdicts if v.keep is Keep.PRUNE]


def test_folder_names_are_huggingface_hubs() -> None:
    assert folder_of(LLAMA) == "models--meta-llama--Llama-3.1-8B-Instruct"
    assert folder_of("fleet-lora/sql") == "models--fleet-lora--sql"


def test_the_listing_script_on_a_real_cache(tmp_path: Path) -> None:
    hub, revisions, units = tmp_path / "hub", tmp_path / "revisions", tmp_path / "units"
    for folder, size in ((folder_of(LLAMA), 1000), (folder_of(QWEN), 300), ("models--fleet-lora--sql", 10)):
        snap = hub / folder / "snapshots" / "r1"
        snap.mkdir(parents=True)
        (snap / "model.safetensors").write_bytes(b"x" * size)
    (hub / folder_of(QWEN) / ".fleet-incoming").mkdir()
    (hub / "version.txt").write_text("1")  # not a repository
    stored = revisions / "vllm-0" / "abc"
    stored.mkdir(parents=True)
    (stored / "unit").write_text(
        "ExecStart=/opt/fleet/vllm/current/bin/vllm serve meta-llama/Llama-3.1-8B-Instruct \\\n"
        '    --lora-modules sql=fleet-lora/sql --speculative-config {"method":"draft_model","model":"org/draft"}\n'
    )
    units.mkdir()
    (units / "fleet-vllm-1.service").write_text("ExecStart=/x serve Qwen/Qwen2.5-7B-Instruct\n")
    (units / "other.service").write_text("ExecStart=/x serve not/counted\n")
    proc = subprocess.run(
        [sys.executable, "-", str(hub), str(revisions), str(units)], input=LIST_SCRIPT, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    got = parse_listing(proc.stdout.strip())
    assert {(r.folder, r.bytes, r.staging) for r in got.repos} == {
        (folder_of(LLAMA), 1000, False), (folder_of(QWEN), 300, True), ("models--fleet-lora--sql", 10, False),
    }  # fmt: skip
    assert {LLAMA, QWEN, "fleet-lora/sql", "org/draft"} <= got.named and "not/counted" not in got.named


def test_the_removal_script_removes_only_model_folders(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    (hub / "models--a--b" / "snapshots").mkdir(parents=True)
    (hub / "models--c--d").mkdir()

    def remove(names: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", REMOVE_SCRIPT, str(hub)], input=json.dumps(names), capture_output=True, text=True,
            check=False,
        )  # fmt: skip

    done = remove(["models--a--b"])
    assert done.returncode == 0 and done.stdout.split() == ["models--a--b"]
    assert sorted(p.name for p in hub.iterdir()) == ["models--c--d"]
    for bad in ("../etc", "models--x/../../y", ".fleet-pruning-models--c--d", "models--"):
        refused = remove([bad])
        assert refused.returncode != 0 and "not a model folder name" in refused.stderr, bad
    assert (hub / "models--c--d").is_dir()


def test_an_unreadable_listing_is_an_error() -> None:
    from fleet.errors import FleetError

    with pytest.raises(FleetError, match="unreadable answer"):
        parse_listing("{}")
