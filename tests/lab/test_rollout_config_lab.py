"""``fleet rollout INVENTORY`` / ``--model`` and ``fleet deploy`` on a serving fleet: a change of the
serving settings rolls out through the engine, as a configuration revision per instance; LoRA
adapters and a speculative config (issue 23) are deployed and rolled out the same way.

Four lab hosts (one A10 each, one vLLM stand-in instance per host) serving Llama 3.1 8B after
``fleet deploy``; Mistral 7B's config is staged beside it. Every test asserts the end state of
every instance: unit active, the model it serves over HTTP, whether its process was restarted,
and the revision (unit + env file) live on the host.
"""

from __future__ import annotations

import ast
import json
import os
import pprint
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleet.rollout.fleet_inventory import RolloutFleet, load_fleet
from fleet.rollout.journal import Journal
from fleet.rollout.probe import InstanceProber
from fleetlab import lab as lab_ops
from fleetlab.inventory_writer import GROUP
from fleetlab.models import staging_command

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT
from .test_rollout_lab import FLEET, instance_state, must
from .test_stage_lab import make_checkpoint

pytestmark = pytest.mark.lab

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
MISTRAL = "mistralai/Mistral-7B-Instruct-v0.3"
FAST = ["--batches", "1,-1", "--soak", "1", "--probe-interval", "0.5", "--health-timeout", "60", "--json"]
HOSTS = 4


def fleet_cli(lab: LabFleet, *args: str, journal: Path) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "FLEET_JOURNAL": str(journal)}
    proc = subprocess.run(
        [str(FLEET), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False, env=env
    )
    try:
        data = json.loads(proc.stdout) if proc.stdout.strip() else {}
    except ValueError:
        data = {}
    return proc.returncode, data, proc.stdout + proc.stderr


def set_faults(lab: LabFleet, faults: dict[str, Any]) -> None:
    text = json.dumps({"load_seconds": 2, **faults})
    for i in range(HOSTS):
        must(lab, i, f"echo '{text}' | sudo tee /etc/fleet-lab/vllm-faults.json >/dev/null")


def live_revisions(lab: LabFleet, fleet: RolloutFleet) -> dict[str, str]:
    out = {}
    for i, host in enumerate(fleet.hosts):
        for ref in fleet.instances:
            if ref.host == host:
                files = f"/etc/systemd/system/fleet-{ref.instance}.service /etc/fleet/{ref.instance}.env"
                out[str(ref)] = must(lab, i, f"sudo cat {files} | sha256sum | cut -c1-16").strip()
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabFleet, RolloutFleet, Path]]:
    require_lab()
    root = tmp_path_factory.mktemp("rollout-config-lab")
    octet = free_octet(os.getpid() + 41, avoid=frozenset({TEST_OCTET}))
    name = f"pc{os.getpid()}"
    opts = replace(test_lab_options(root, name, octet, HOSTS, ("a10-1",)), stage_model=True)
    try:
        lab = LabFleet(opts, bring_up(opts))
        # the fleet's own rollout policy (what `fleet deploy` uses): quick, for the lab
        group_data = opts.inventory.parent / "group_data"
        group_data.mkdir(exist_ok=True)
        (group_data / "all.py").write_text(
            'rollout = {"batches": [1, -1], "soak_s": 1, "probe_interval_s": 0.5, "canary_bake_s": 0}\n'
        )
        for i in range(HOSTS):
            must(lab, i, staging_command(MISTRAL) + " && sudo mkdir -p /etc/fleet-lab")
        set_faults(lab, {})
        journal = root / "journal.sqlite"
        rc, _data, out = fleet_cli(lab, "deploy", str(opts.inventory), "--json", journal=journal)
        assert rc == 0, out
        fleet = load_fleet(str(opts.inventory))
        assert len(fleet.instances) == HOSTS
        yield lab, fleet, journal
    finally:
        lab_ops.down(name, root / "state")


def serves(state: dict[str, dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    return {ref: tuple(s["serves"]) for ref, s in state.items()}


def test_model_rollout_over_four_hosts_then_deploy_puts_the_inventory_back(
    llama: tuple[LabFleet, RolloutFleet, Path],
) -> None:
    lab, fleet, journal = llama
    inventory = str(lab.opts.inventory)
    before = instance_state(lab, fleet)
    revs_before = live_revisions(lab, fleet)
    assert set(serves(before).values()) == {(LLAMA,)}, before

    rc, data, out = fleet_cli(lab, "rollout", inventory, "--model", MISTRAL, *FAST, journal=journal)
    assert rc == 0, out
    after = instance_state(lab, fleet)
    assert set(serves(after).values()) == {(MISTRAL,)}, after
    assert all(after[r]["unit"] == "active/running" and after[r]["pid"] != before[r]["pid"] for r in after)
    assert all(after[r]["runs"] == before[r]["runs"] for r in after)  # the release did not change
    revs_after = live_revisions(lab, fleet)
    assert all(revs_after[r] != revs_before[r] for r in revs_after)
    rolled = [op for h in data["hosts"] for op in h["operations"] if op.startswith("rolled out")]
    assert len(rolled) == HOSTS, data
    # the old revision is still stored beside the new one (what a rollback puts back)
    first = next(iter(fleet.instances))
    stored = f"/etc/fleet/revisions/{first.instance}/{revs_before[str(first)]}/revision.json"
    must(lab, 0, f"sudo test -f {stored}")

    # The inventory still says Llama: `fleet deploy` rolls the fleet back to it through the engine.
    rc, data, out = fleet_cli(lab, "deploy", inventory, "--json", journal=journal)
    assert rc == 0, out
    back = instance_state(lab, fleet)
    assert set(serves(back).values()) == {(LLAMA,)}, back
    assert live_revisions(lab, fleet) == revs_before
    assert all(h["restarted"] for h in data["hosts"]), json.dumps(data, indent=1)

    # Nothing changed since: a third run changes nothing and restarts nothing.
    rc, data, out = fleet_cli(lab, "deploy", inventory, "--json", journal=journal)
    assert rc == 0, out
    summary = [(h["host"], h["status"], h["operations"], h["restarted"]) for h in data["hosts"]]
    assert all(h["status"] == "unchanged" and not h["restarted"] for h in data["hosts"]), summary
    assert {r: s["pid"] for r, s in instance_state(lab, fleet).items()} == {r: s["pid"] for r, s in back.items()}


def test_a_model_that_fails_to_load_on_the_canary_is_rolled_back_to_the_old_files(
    llama: tuple[LabFleet, RolloutFleet, Path],
) -> None:
    lab, fleet, journal = llama
    inventory = str(lab.opts.inventory)
    set_faults(lab, {"fail_load": [MISTRAL]})
    try:
        before = instance_state(lab, fleet)
        revs_before = live_revisions(lab, fleet)
        rc, data, out = fleet_cli(lab, "rollout", inventory, "--model", MISTRAL, *FAST, journal=journal)
        assert rc == 1, out
        after = instance_state(lab, fleet)
        assert set(serves(after).values()) == {(LLAMA,)}, after
        assert live_revisions(lab, fleet) == revs_before
        restarted = {r for r in after if after[r]["pid"] != before[r]["pid"]}
        assert len(restarted) == 1, (before, after)  # the canary: stopped, tried, back on the old files
        failed = [h for h in data["hosts"] if h["status"] == "failed"]
        assert len(failed) == 1 and "rollout" in (data["error"] or ""), data
        assert all(after[r]["unit"] == "active/running" for r in after)
    finally:
        set_faults(lab, {})


def test_rollback_of_a_model_rollout_puts_the_old_files_back(llama: tuple[LabFleet, RolloutFleet, Path]) -> None:
    lab, fleet, journal = llama
    inventory = str(lab.opts.inventory)
    revs_before = live_revisions(lab, fleet)
    rc, data, out = fleet_cli(lab, "rollout", inventory, "--model", MISTRAL, *FAST, journal=journal)
    assert rc == 0, out
    rollout_id = next(op.rsplit(" ", 1)[1].rstrip(")") for op in data["hosts"][0]["operations"] if "rollout" in op)
    assert set(serves(instance_state(lab, fleet)).values()) == {(MISTRAL,)}
    rc, data, out = fleet_cli(lab, "rollback", rollout_id, *FAST, journal=journal)
    assert rc == 0 and data["kind"] == "rollback", out
    after = instance_state(lab, fleet)
    assert set(serves(after).values()) == {(LLAMA,)}, after
    assert all(s["unit"] == "active/running" for s in after.values())
    assert live_revisions(lab, fleet) == revs_before


def lora_inventory(lab: LabFleet, adapters: dict[str, Path]) -> Path:
    """The lab's inventory with LoRA adapters and an n-gram speculative config on every host, written
    beside it (so its group_data, the quick rollout policy, applies)."""
    inventory = lab.opts.inventory
    assert inventory is not None
    hosts = ast.literal_eval(inventory.read_text().split(f"\n{GROUP} = ", 1)[1])
    for _name, data in hosts:
        data["lora_adapters"] = {n: {"kind": "dir", "path": str(p)} for n, p in adapters.items()}
        data["speculative"] = {"method": "ngram", "num_speculative_tokens": 3}
    path = inventory.with_name("lora.py")
    path.write_text(f"{GROUP} = {pprint.pformat(hosts, width=100, sort_dicts=False)}\n")
    return path


def peft_adapter(where: Path, r: int) -> Path:
    """A PEFT LoRA adapter directory for Llama 3.1 8B (its config and a small weights file)."""
    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "bias": "none", "base_model_name_or_path": LLAMA,
         "target_modules": ["q_proj", "v_proj"]}
    ))  # fmt: skip
    (where / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    return where


def test_lora_adapters_and_ngram_speculation_deploy_then_an_adapter_change_rolls_out_behind_the_gate(
    llama: tuple[LabFleet, RolloutFleet, Path], tmp_path: Path
) -> None:
    """Issue 23 parts 1 and 7 on one host (``--limit``): deploy with one adapter and an n-gram
    speculative config → ``/v1/models`` lists the adapter (parent: the model) → a completion with
    the adapter → a second adapter rolls out through the engine, whose models gate checks the set."""
    lab, fleet, journal = llama
    host = fleet.hosts[0]
    (ref, spec), *_ = [(r, s) for r, s in fleet.instances.items() if r.host == host]
    sql, chat = peft_adapter(tmp_path / "sql", 8), peft_adapter(tmp_path / "chat", 16)
    inventory = str(lora_inventory(lab, {"sql": sql}))
    before = instance_state(lab, fleet)[str(ref)]

    rc, data, out = fleet_cli(lab, "deploy", inventory, "--limit", host, "--json", journal=journal)
    assert rc == 0, out
    prober = InstanceProber(spec.url, 10)
    models = prober.models()
    assert (models.status, models.ids, models.adapters) == (200, (LLAMA, "sql"), ("sql",)), models
    argv = must(lab, 0, f"tr '\\000' ' ' < /proc/{instance_state(lab, fleet)[str(ref)]['pid']}/cmdline")
    assert "--lora-modules sql=fleet-lora/sql" in argv and '"method":"ngram"' in argv, argv
    staged = must(lab, 0, "sudo cat /var/lib/vllm/hf/hub/models--fleet-lora--sql/refs/main").strip()
    assert must(lab, 0, f"sudo stat -c %U /var/lib/vllm/hf/hub/models--fleet-lora--sql/snapshots/{staged}/"
                "adapter_config.json").strip() == "vllm"  # fmt: skip
    answer = prober.completion("sql", "Hello", 4)
    assert answer.status == 200 and answer.completion_tokens > 0, answer
    first = instance_state(lab, fleet)[str(ref)]
    assert first["pid"] != before["pid"] and first["unit"] == "active/running"

    # the adapter retrained under the same name: a new snapshot, so a new configuration revision,
    # rolled out behind the gates (before, nothing restarted and the old weights stayed loaded)
    (sql / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    rc, data, out = fleet_cli(lab, "deploy", inventory, "--limit", host, "--json", journal=journal)
    assert rc == 0, out
    assert any(op.startswith("rolled out") for h in data["hosts"] for op in h["operations"]), data
    retrained = instance_state(lab, fleet)[str(ref)]
    assert retrained["pid"] != first["pid"] and retrained["unit"] == "active/running"
    snapshot = must(lab, 0, "sudo cat /var/lib/vllm/hf/hub/models--fleet-lora--sql/refs/main").strip()
    assert snapshot != staged and f"# weights: fleet-lora/sql snapshot {snapshot}" in must(
        lab, 0, f"sudo cat /etc/fleet/{ref.instance}.env"
    )
    first = retrained

    inventory = str(lora_inventory(lab, {"sql": sql, "chat": chat}))
    rc, data, out = fleet_cli(lab, "deploy", inventory, "--limit", host, "--json", journal=journal)
    assert rc == 0, out
    rolled = [op for h in data["hosts"] for op in h["operations"] if op.startswith("rolled out")]
    assert rolled, data
    after = instance_state(lab, fleet)[str(ref)]
    assert after["pid"] != first["pid"] and after["unit"] == "active/running"
    models = prober.models()
    assert sorted(models.adapters) == ["chat", "sql"], models
    assert prober.completion("chat", "Hello", 4).status == 200

    # `fleet rollback` of that change: back to the revision with one adapter, gated on that set (the
    # previous revision's revision.json records it), not on the model alone
    rollout_id = next(op.rsplit(" ", 1)[1].rstrip(")") for h in data["hosts"] for op in h["operations"]
                      if op.startswith("rolled out"))  # fmt: skip
    rc, back, out = fleet_cli(lab, "rollback", rollout_id, *FAST, journal=journal)
    assert rc == 0 and back["kind"] == "rollback", out
    assert prober.models().adapters == ("sql",)
    with Journal(journal) as j:
        undone = j.latest_state(back["id"]).instances[ref]
    assert undone.target.adapters == ("sql",) and undone.phase.value == "done", undone


def test_a_rollout_to_a_model_no_host_had_stages_it_in_a_tree_before_any_instance_restarts(
    llama: tuple[LabFleet, RolloutFleet, Path], tmp_path: Path
) -> None:
    """Issue 22 part 5: ``fleet rollout --model M`` where M is in the inventory's ``model_source``
    only (a generated checkpoint with Mistral 7B's config, which the stand-in serves): M is staged
    on every host, fanned out host to host (``staging.fanout``), and verified, before the first
    instance stops; then the fleet rolls to it. Last in this module: the hosts serve M after it."""
    lab, fleet, journal = llama
    model = "fleet-test/tiny-mistral"
    repo = f"/var/lib/vllm/hf/hub/models--{model.replace('/', '--')}"
    make_checkpoint(tmp_path / "src", model, REPO_ROOT / "fleet" / "data" / "models" / MISTRAL / "config.json")
    base = lab.opts.inventory
    assert base is not None
    hosts = ast.literal_eval(base.read_text().split(f"\n{GROUP} = ", 1)[1])
    for _name, host_data in hosts:
        host_data["model_source"] = {"kind": "dir", "path": str(tmp_path / "src")}
        host_data["staging"] = {"fanout": True, "concurrency": 2}
    inventory = base.with_name("staged.py")  # beside it: its group_data (the quick rollout policy) applies
    inventory.write_text(f"{GROUP} = {pprint.pformat(hosts, width=100, sort_dicts=False)}\n")
    for i in range(HOSTS):
        assert must(lab, i, f"sudo test -e {repo} && echo had || echo none").strip() == "none"
    before = instance_state(lab, fleet)

    rc, data, out = fleet_cli(lab, "rollout", str(inventory), "--model", model, *FAST, journal=journal)
    assert rc == 0, out
    after = instance_state(lab, fleet)
    assert set(serves(after).values()) == {(model,)}, after
    assert all(after[r]["unit"] == "active/running" and after[r]["pid"] != before[r]["pid"] for r in after)
    staged = [op for h in data["hosts"] for op in h["operations"] if op.startswith(f"{model} @ ")]
    assert len(staged) == HOSTS, json.dumps(data["hosts"], indent=1)
    # fanned out: 4 hosts from one source in ⌈log₂5⌉ = 3 rounds, some copies sent host to host
    fan = data["staging"]
    assert fan["bounds"] == [{"model": model, "revision": fan["bounds"][0]["revision"], "hosts": HOSTS,
                              "holders": 1, "rounds": 3}], fan  # fmt: skip
    copies = [c for r in fan["rounds"] for c in r]
    assert sorted(c["to"] for c in copies if c["status"] == "staged") == sorted(fleet.hosts), fan
    assert any(c["from"] != "(control)" for c in copies), fan
    revision = fan["bounds"][0]["revision"]
    # every host's copy was complete (refs/main switched) before the first instance restarted
    refs = {
        i: float(must(lab, i, f"sudo python3 -c 'import os; print(os.stat(\"{repo}/refs/main\").st_mtime)'"))
        for i in range(HOSTS)
    }
    assert all(must(lab, i, f"sudo cat {repo}/refs/main").strip() == revision for i in range(HOSTS))
    rollout_id = next(op.rsplit(" ", 1)[1].rstrip(")") for op in data["hosts"][0]["operations"] if "rollout" in op)
    with sqlite3.connect(journal) as db:
        (began,) = db.execute("SELECT started_at FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
        steps = db.execute("SELECT at, action FROM steps WHERE rollout_id = ? ORDER BY seq", (rollout_id,)).fetchall()
    assert steps and all(at >= began for at, _action in steps), (began, steps)
    assert max(refs.values()) < began, (refs, began, steps[:3])
    # the deploy's progress: the staging phase said it fans out, and each host's copy was told
    said = " ".join(out.split())  # rich wraps the lines off a terminal
    assert "4 of them in a tree (staging.fanout)" in said and said.count("weights: round ") >= HOSTS, out
