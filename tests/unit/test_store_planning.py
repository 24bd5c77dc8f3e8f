"""``fleet plan`` reads a ``store`` source's planning files from the store host (issue 22, point 4:
"fleet plan reads the model's config.json from the source when the control machine has no copy").

The store-side script (``fleet.model.store.SCRIPT``) is run here, through ``bash -c`` on the very
command line fleet sends over SSH, on a real directory laid out as a store's; only the SSH hop is
left out (``sshlink.run_once`` replaced by a local shell). The lab test (``tests/lab/test_stage_lab.py``)
does the same over the lab's real sshd. A store that does not answer is a real closed port on
127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fleet.errors import FleetError, InventoryError
from fleet.facts.sshlink import SshTarget
from fleet.inventory.spec import host_spec
from fleet.model import store as store_mod
from fleet.model.store import MAX_PLANNING_BYTES, fetch_store_planning_files, parse_planning, write_planning
from tests.lab.test_stage_lab import make_checkpoint

MODEL = "fleet-test/tiny-st"
BASE: dict[str, Any] = {
    "model": MODEL,
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}


class LocalLink:
    """``fleet.facts.sshlink.Link`` with the command run by this machine's bash (the SSH hop left out)."""

    commands: ClassVar[list[str]] = []

    def __init__(self, name: str, client: object) -> None:
        self.name = name

    def run(self, command: str, timeout: float, stdin: bytes = b"", *, label: str = "") -> tuple[int, str, str]:
        LocalLink.commands.append(command)
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    def close(self) -> None:
        pass


@pytest.fixture
def local_store(monkeypatch: pytest.MonkeyPatch) -> None:
    def run_once(target: SshTarget, command: str, timeout: float, **kw: Any) -> tuple[int, str, str]:
        return LocalLink(target.name, object()).run(command, timeout, **kw)  # the SSH hop left out

    monkeypatch.setattr(store_mod, "run_once", run_once)
    LocalLink.commands = []
    store_mod.forget()


def target(port: int = 22) -> SshTarget:
    return SshTarget(name="store-1", hostname="127.0.0.1", port=port, user=None, key=None, known_hosts=None)


def test_a_store_sources_model_config_is_its_copy_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": {"kind": "store", "host": "store-1",
                                                                       "path": "/srv/models"}})  # fmt: skip
    assert spec.model_source is not None and spec.model_config == spec.model_source.planning_dir(MODEL)
    assert spec.model_config.startswith(str(tmp_path / "xdg" / "fleet" / "store" / "store-1-"))
    assert spec.model_config.endswith("/fleet-test/tiny-st") and "/srv/models" not in spec.model_config
    other = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": {"kind": "store", "host": "store-1",
                                                                        "path": "/srv/other"}})  # fmt: skip
    assert other.model_config != spec.model_config  # one copy per (store, path)
    store = {"kind": "store", "host": "s", "path": "/m"}
    given = host_spec("inv.py", "gpu-1", (), {**BASE, "model_config": "/etc/c.json", "model_source": store})
    assert given.model_config == "/etc/c.json"


def test_the_planning_files_are_read_from_the_store_and_only_they(local_store: None, tmp_path: Path) -> None:
    top = make_checkpoint(tmp_path / "store")
    dest = tmp_path / "here" / MODEL
    got = fetch_store_planning_files(target(), str(tmp_path / "store"), MODEL, dest)
    assert got == dest
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors.index.json",
                                                      "tokenizer_config.json"]  # not the weights # fmt: skip
    for p in dest.iterdir():
        assert p.read_bytes() == (top / p.name).read_bytes()
    # asked once per process (a deploy reloads its inventory): the same answer, no second read
    fetch_store_planning_files(target(), str(tmp_path / "store"), MODEL, dest)
    assert len(LocalLink.commands) == 1
    # a later process reads the store again: a file changed there is changed here, one gone is removed
    store_mod.forget()
    (top / "model.safetensors.index.json").unlink()
    (top / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    fetch_store_planning_files(target(), str(tmp_path / "store"), MODEL, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "tokenizer_config.json"]
    assert json.loads((dest / "tokenizer_config.json").read_text()) == {"model_max_length": 4096}


def test_a_store_without_the_directory_or_the_model_is_named(local_store: None, tmp_path: Path) -> None:
    root = tmp_path / "store"
    with pytest.raises(FleetError) as err:
        fetch_store_planning_files(target(), str(root), MODEL, tmp_path / "here")
    said = str(err.value)
    assert f"model_source: store store-1, path {root}: {MODEL}" in said and "no such directory on store-1" in said
    root.mkdir()
    with pytest.raises(FleetError) as err:
        fetch_store_planning_files(target(), str(root), MODEL, tmp_path / "here")
    said = str(err.value)
    assert f"{MODEL}: the model is not on the store (no {root}/{MODEL}/config.json there)" in said, said
    assert f"put its files in {root}/{MODEL} on store-1" in said
    assert not (tmp_path / "here").exists()


def test_a_file_too_large_for_a_planning_file_is_refused(local_store: None, tmp_path: Path) -> None:
    top = make_checkpoint(tmp_path / "store")
    with open(top / "tokenizer_config.json", "wb") as f:
        f.truncate(MAX_PLANNING_BYTES + 1)
    with pytest.raises(FleetError, match=r"tokenizer_config.json is \d+ bytes, more than a planning file's"):
        fetch_store_planning_files(target(), str(tmp_path / "store"), MODEL, tmp_path / "here")


@pytest.mark.parametrize(
    ("answer", "want"),
    [
        ("Traceback (most recent call last):", "unreadable answer from the store"),
        ('{"status": "unreadable", "why": "cannot read x: Permission denied", "files": {}}',
         "cannot read x: Permission denied: make the model's planning files readable by the SSH login user"),
        ('{"status": "ok", "why": "", "files": {"config.json": "!!"}}', "unreadable config.json"),
        ('{"status": "ok", "why": "", "files": {}}', "the store's answer has no config.json"),
        ('{"status": "ok", "why": "", "files": []}', "unreadable answer from the store"),
    ],
)  # fmt: skip
def test_a_store_answer_that_is_not_the_files_is_refused(answer: str, want: str) -> None:
    with pytest.raises(FleetError, match=want) as err:
        parse_planning("store-1", "/srv/models", MODEL, answer)
    assert str(err.value).startswith(f"model_source: store store-1, path /srv/models: {MODEL}: ")


def test_write_planning_leaves_an_unchanged_file_alone(tmp_path: Path) -> None:
    write_planning(tmp_path, {"config.json": b"{}", "tokenizer_config.json": None})
    before = (tmp_path / "config.json").stat().st_mtime_ns
    write_planning(tmp_path, {"config.json": b"{}", "tokenizer_config.json": None})
    assert (tmp_path / "config.json").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary left


def inventory(tmp_path: Path, root: Path, store_port: int, **extra: object) -> Path:
    data = {**BASE, "gpu": {"sku": "h100-sxm-80gb", "count": 1}, "ssh_hostname": "127.0.0.2",
            "model_source": {"kind": "store", "host": "store-1", "path": str(root)}, **extra}  # fmt: skip
    store = {"role": "balancer", "ssh_hostname": "127.0.0.1", "ssh_port": store_port}
    path = tmp_path / "inventory.py"
    path.write_text(f"gpus = [('h1', {data!r}), ('store-1', {store!r})]\n")
    return path


def test_plan_reads_config_json_from_the_store(
    local_store: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fleet.plan.outcomes import load_for_planning, plan_inventory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    top = make_checkpoint(tmp_path / "store")
    loaded = load_for_planning(inventory(tmp_path, tmp_path / "store", 2222), ["h1"])
    spec = loaded.hosts[0]
    assert spec.model_config is not None and spec.model_config.startswith(str(tmp_path / "xdg"))
    assert Path(spec.model_config, "config.json").read_bytes() == (top / "config.json").read_bytes()
    (outcome,) = plan_inventory(loaded)
    assert outcome.plan is not None
    assert len(LocalLink.commands) == 1


def test_plan_names_a_store_that_lacks_the_model_before_any_host(
    local_store: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fleet.plan.outcomes import load_for_planning

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "store").mkdir()
    with pytest.raises(InventoryError) as err:
        load_for_planning(inventory(tmp_path, tmp_path / "store", 2222), ["h1"])
    (problem,) = err.value.problems  # said once, on model_source (not again on model)
    assert (problem.host, problem.field, problem.value) == ("h1", "model_source.host", "store-1")
    assert f"store store-1, path {tmp_path / 'store'}: {MODEL}: the model is not on the store" in problem.allowed


def test_plan_names_a_store_that_does_not_answer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fleet.plan.outcomes import load_for_planning

    store_mod.forget()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InventoryError) as err:
        load_for_planning(inventory(tmp_path, tmp_path / "store", port), ["h1"])
    (problem,) = err.value.problems
    assert (problem.host, problem.field, problem.value) == ("h1", "model_source.host", "store-1")
    assert f"{MODEL}: cannot read its config.json from the store" in problem.allowed, problem.allowed
    assert "or set model_config to a copy of its config.json here" in problem.allowed


def test_an_explicit_model_config_is_not_read_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.plan.outcomes import load_for_planning

    store_mod.forget()
    config = make_checkpoint(tmp_path / "here") / "config.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loaded = load_for_planning(inventory(tmp_path, tmp_path / "store", port, model_config=str(config)), ["h1"])
    assert loaded.hosts[0].model_config == str(config)


def test_a_speculative_draft_named_by_id_is_read_and_staged_from_the_store(
    local_store: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The draft's config.json comes from the store beside the model's; the store sends the draft
    after the model. A draft the store lacks is named on ``speculative.model``."""
    from fleet.plan.outcomes import load_for_planning, plan_inventory
    from fleet.weights.stage import jobs_for

    llama = Path(__file__).resolve().parents[2] / "fleet" / "data" / "models" / "meta-llama"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "store"
    make_checkpoint(root, MODEL, config=llama / "Llama-3.1-70B-Instruct" / "config.json")
    draft = "fleet-test/tiny-draft"
    sp = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    inv = inventory(tmp_path, root, 2222, speculative=sp, gpu={"sku": "h100-sxm-80gb", "count": 4})
    with pytest.raises(InventoryError) as err:
        load_for_planning(inv, ["h1"])
    (problem,) = err.value.problems
    assert (problem.field, problem.value) == ("speculative.model", draft)
    assert f"{draft}: the model is not on the store" in problem.allowed, problem.allowed

    make_checkpoint(root, draft, config=llama / "Llama-3.1-8B-Instruct" / "config.json")
    store_mod.forget()
    loaded = load_for_planning(inv, ["h1"])
    spec = loaded.hosts[0]
    assert spec.speculative is not None and spec.speculative.model_config is not None
    assert Path(spec.speculative.model_config, "config.json").is_file()
    (outcome,) = plan_inventory(loaded)
    assert outcome.plan is not None
    jobs = jobs_for(loaded)
    assert [j.model for j in jobs] == [MODEL, draft]
    assert jobs[1].store is not None and jobs[1].store.snapshot == str(root / "fleet-test" / "tiny-draft")
