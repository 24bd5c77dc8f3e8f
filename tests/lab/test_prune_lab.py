"""``fleet prune`` on a real lab host (issue 22, part 2): a model no planned instance and no kept
revision uses is listed, then removed with ``--yes``; the planned model, one a stored
configuration revision names (a rollback would serve it) and one being staged into are kept.
Shares the session's ``lab_fleet``; removes what it made."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .conftest import LabFleet
from .deploying import REPO_ROOT
from .test_stage_lab import CONFIG, FLEET, MODEL, on, staging_inventory

pytestmark = pytest.mark.lab

HUB = "/var/lib/vllm/hf/hub"
OLD, ROLLBACK, STAGING = "fleet-test/old-model", "fleet-test/rollback-model", "fleet-test/incoming-model"
STORED = "/etc/fleet/revisions/vllm-fleet-test/0123456789abcdef"


def folder(model: str) -> str:
    return "models--" + model.replace("/", "--")


def prune(inventory: Path, *args: str) -> tuple[int, dict[str, object], str]:
    proc = subprocess.run(
        [str(FLEET), "prune", str(inventory), "--json", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, {}, proc.stdout + proc.stderr


def test_prune_removes_only_what_nothing_planned_or_kept_uses(lab_fleet: LabFleet, tmp_path: Path) -> None:
    (tmp_path / "src" / MODEL).mkdir(parents=True)
    (tmp_path / "src" / MODEL / "config.json").write_text(CONFIG.read_text())
    inventory = staging_inventory(lab_fleet, tmp_path / "inventory.py", tmp_path / "src")
    host = lab_fleet.state.hosts[0].name
    made = [folder(m) for m in (MODEL, OLD, ROLLBACK, STAGING)]
    # the first of the cache's directories this test creates (so it leaves none behind: a root-owned
    # /var/lib/vllm would be the service user's home, unwritable, for a later test that creates it)
    missing = [d for d in ("/var/lib/vllm", "/var/lib/vllm/hf", HUB) if on(lab_fleet, 0, f"sudo test -e {d}")[0] != 0]
    try:
        fill = [f"sudo mkdir -p {HUB}/{f}/snapshots/r1 && sudo dd if=/dev/zero of={HUB}/{f}/snapshots/r1/w bs=1k "
                "count=64 status=none" for f in made]  # fmt: skip
        unit = f"ExecStart=/x serve {ROLLBACK} --max-model-len 4096"
        marks = [f"sudo mkdir -p {HUB}/{folder(STAGING)}/.fleet-incoming {STORED}",
                 f"echo '{unit}' | sudo tee {STORED}/unit >/dev/null"]  # fmt: skip
        script = " && ".join(fill + marks)
        rc, _out, err = on(lab_fleet, 0, script)
        assert rc == 0, err

        rc, body, err = prune(inventory, "--limit", host)
        assert rc == 0 and body["applied"] is False, (body, err)
        (result,) = body["hosts"]  # type: ignore[attr-defined]
        keep = {r["folder"]: r["keep"] for r in result["repos"] if r["folder"] in made}
        assert keep == {folder(MODEL): "planned", folder(OLD): "prune", folder(ROLLBACK): "revision",
                        folder(STAGING): "staging"}, result  # fmt: skip
        assert result["removed"] == []
        rc, out, _err = on(lab_fleet, 0, f"sudo ls {HUB}")
        assert set(made) <= set(out.split()), out  # a listing removes nothing

        rc, body, err = prune(inventory, "--limit", host, "--yes")
        assert rc == 0 and body["applied"] is True, (body, err)
        (result,) = body["hosts"]  # type: ignore[attr-defined]
        assert folder(OLD) in result["removed"] and result["freed_bytes"] >= 64 * 1024, result
        assert not set(result["removed"]) & {folder(MODEL), folder(ROLLBACK), folder(STAGING)}
        rc, out, _err = on(lab_fleet, 0, f"sudo ls -A {HUB}")
        present = set(out.split())
        assert folder(OLD) not in present and not any(p.startswith(".fleet-pruning-") for p in present), out
        assert {folder(MODEL), folder(ROLLBACK), folder(STAGING)} <= present, out
    finally:
        created = missing[0] if missing else " ".join(f"{HUB}/{f}" for f in made)
        on(lab_fleet, 0, f"sudo rm -rf {created} {STORED} $(dirname {STORED})")
