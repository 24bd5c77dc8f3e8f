"""A store host as a model source (issue 22, part 1): ``model_source: {kind: store, host, path}`` at
the inventory boundary (table tests, and the across-hosts rule that the store is a host of the
inventory), the jobs it makes (the store sends, as its login user), and the store-side manifest
script run here on a real directory: the same manifest as a ``dir`` source of the same files,
cached, and each bad input named with the way out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError, InventoryError
from fleet.inventory.spec import host_spec, load_inventory
from fleet.weights.manifest import build_manifest
from fleet.weights.stage import jobs_for
from fleet.weights.store import SCRIPT, parse_store_manifest

MODEL = "acme/tiny-7b"
BASE: dict[str, Any] = {
    "model": MODEL,
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}
STORE = {"kind": "store", "host": "store-1", "path": "/srv/models"}


def problems(source: object) -> list[str]:
    with pytest.raises(InventoryError) as err:
        host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": source})
    return [str(p) for p in err.value.problems]


# -- the inventory key ------------------------------------------------------------------------------


def test_a_store_source_is_taken_without_reading_this_machine() -> None:
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": STORE})
    assert spec.model_source is not None
    assert (spec.model_source.kind, spec.model_source.host, spec.model_source.path) == (
        "store", "store-1", "/srv/models"
    )  # fmt: skip
    # the store's config.json is not on this machine: the planning commands copy it here first
    # (tests/unit/test_store_planning.py)
    assert spec.model_config == spec.model_source.planning_dir(MODEL) and "/srv/models" not in spec.model_config


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ({**STORE, "host": "bad host"}, "model_source.host='bad host': the name of a host of this inventory"),
        ({**STORE, "host": ""}, "model_source.host='': the name of a host of this inventory"),
        ({**STORE, "path": "models"}, "model_source.path='models': an absolute path without '.' or '..' parts, on "
         "the store host"),
        ({**STORE, "path": "/srv/../etc"}, "an absolute path without '.' or '..' parts, on the store host"),
        ({**STORE, "path": "/srv/\nx"}, "model_source.path="),
        ({"kind": "store", "path": "/srv/models"}, "model_source.host"),
        ({"kind": "store", "host": "store-1"}, "model_source.path"),
        ({**STORE, "port": 22}, "model_source.port=22: unknown key; allowed: kind, host, path"),
        ({**STORE, "host": 7}, "model_source.host=7"),
    ],
)  # fmt: skip
def test_bad_store_sources_are_named_with_the_way_out(source: object, want: str) -> None:
    found = problems(source)
    assert any(want in p and "inv.py: host gpu-1" in p for p in found), found


def write_inventory(tmp_path: Path, hosts: list[tuple[str, dict[str, Any]]]) -> str:
    inv = tmp_path / "inv.py"
    inv.write_text(f"h = {hosts!r}\n")
    return str(inv)


def host(octet: int, **extra: object) -> dict[str, Any]:
    return {**BASE, "ssh_hostname": f"127.0.0.{octet}", **extra}


def test_the_store_must_be_a_host_of_the_inventory(tmp_path: Path) -> None:
    inv = write_inventory(
        tmp_path, [("gpu-1", host(2, model_source={**STORE, "host": "stor-1"})), ("store-1", host(3))]
    )
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    (found,) = [str(p) for p in err.value.problems]
    assert "host gpu-1" in found and "model_source.host='stor-1'" in found, found
    assert "not in this inventory; add the store host to it" in found, found


def test_a_host_cannot_be_its_own_store(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, [("gpu-1", host(2, model_source={**STORE, "host": "gpu-1"}))])
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    assert "names this host itself" in str(err.value), err.value


def test_the_store_sends_to_each_host_as_its_login_user(tmp_path: Path) -> None:
    """The job of a host whose source is a store: the store host (reached with its own inventory
    settings) sends ``PATH/ORG/NAME`` to the host's staging port; the store stages nothing itself,
    and a host left out by ``--limit`` may still be the store."""
    inv = write_inventory(tmp_path, [
        ("gpu-1", host(2, model_source=STORE, staging={"port": 7480})),
        ("gpu-2", host(4, model_source=STORE)),
        ("store-1", host(3, ssh_user="keeper", ssh_port=2222)),
    ])  # fmt: skip
    jobs = jobs_for(load_inventory(inv, ["gpu-1", "gpu-2"]))
    assert [j.target.name for j in jobs] == ["gpu-1", "gpu-2"]
    seed = jobs[0].store
    assert seed is not None and jobs[0].seed is None
    assert (seed.sender.name, seed.sender.hostname, seed.sender.port, seed.sender.user) == (
        "store-1", "127.0.0.3", 2222, "keeper"
    )  # fmt: skip
    assert (seed.sender_address, seed.receiver_address, seed.port) == ("127.0.0.3", "127.0.0.2", 7480)
    assert seed.snapshot == "/srv/models/acme/tiny-7b" and seed.as_login
    assert jobs[0].source == "store-1:/srv/models" and jobs[0].files == "/srv/models/acme/tiny-7b"
    assert jobs[1].store is not None and jobs[1].store.port == 7470


def test_a_store_and_a_dir_source_of_the_same_path_are_two_sources(tmp_path: Path) -> None:
    """Manifests and fan-out trees are keyed by (source, model): a store's ``/srv/x`` is not this
    machine's ``/srv/x``."""
    root = tmp_path / "models"
    (root / "acme" / "tiny-7b").mkdir(parents=True)
    (root / "acme" / "tiny-7b" / "config.json").write_text("{}")
    inv = write_inventory(tmp_path, [
        ("gpu-1", host(2, model_source={**STORE, "path": str(root)})),
        ("gpu-2", host(4, model_source={"kind": "dir", "path": str(root)})),
        ("store-1", host(3)),
    ])  # fmt: skip
    jobs = jobs_for(load_inventory(inv, ["gpu-1", "gpu-2"]))
    assert len({(j.source, j.model) for j in jobs}) == 2, jobs


# -- the store-side manifest script, run here on a real directory -----------------------------------


def make_model(root: Path) -> Path:
    top = root / "acme" / "tiny-7b"
    (top / "sub").mkdir(parents=True)
    (top / "config.json").write_bytes(b'{"model_type": "llama"}')
    (top / "model.safetensors").write_bytes(b"x" * 3000)
    (top / "sub" / "tokenizer.json").write_text("{}")
    (top / ".cache").mkdir()
    (top / ".cache" / "skip").write_text("not the model's")
    (top / ".fleet-manifest.json").write_text("{}")
    return top


def run_script(root: Path, cache: Path, model: str = MODEL) -> dict[str, Any]:
    top = os.path.join(root, *model.split("/"))
    proc = subprocess.run(
        [sys.executable, "-", str(root), top, "config.json"], input=SCRIPT, capture_output=True, text=True,
        check=True, env={**os.environ, "XDG_CACHE_HOME": str(cache)},
    )  # fmt: skip
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_store_manifest_is_the_dir_manifest_of_the_same_files(tmp_path: Path) -> None:
    top = make_model(tmp_path / "src")
    answer = run_script(tmp_path / "src", tmp_path / "cache")
    got = parse_store_manifest("store-1", str(tmp_path / "src"), MODEL, json.dumps(answer))
    want = build_manifest(str(tmp_path / "src"), MODEL)
    assert got == want and got.revision == want.revision
    assert [f.path for f in got.files] == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert answer["hashed"] == sum((top / f.path).stat().st_size for f in got.files)


def test_the_store_hashes_an_unchanged_file_once(tmp_path: Path) -> None:
    top = make_model(tmp_path / "src")
    first = run_script(tmp_path / "src", tmp_path / "cache")
    again = run_script(tmp_path / "src", tmp_path / "cache")
    assert again["hashed"] == 0 and again["reused"] == first["hashed"] and again["files"] == first["files"]
    caches = list((tmp_path / "cache" / "fleet" / "store-manifests").iterdir())
    assert len(caches) == 1 and caches[0].stat().st_mode & 0o777 == 0o600
    (top / "model.safetensors").write_bytes(b"y" * 3000)  # same size, new bytes: hashed again
    third = run_script(tmp_path / "src", tmp_path / "cache")
    assert third["hashed"] == 3000 and third["files"] != first["files"]


def test_a_store_without_the_directory_or_the_model_is_named(tmp_path: Path) -> None:
    answer = run_script(tmp_path / "none", tmp_path / "cache")
    with pytest.raises(FleetError, match=r"store store-1, path .*/none: no such directory on store-1: create it"):
        parse_store_manifest("store-1", str(tmp_path / "none"), MODEL, json.dumps(answer))
    (tmp_path / "src").mkdir()
    answer = run_script(tmp_path / "src", tmp_path / "cache")
    with pytest.raises(FleetError, match=f"{MODEL} is not there .*huggingface-cli download {MODEL}"):
        parse_store_manifest("store-1", str(tmp_path / "src"), MODEL, json.dumps(answer))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_an_unreadable_file_on_the_store_is_named(tmp_path: Path) -> None:
    top = make_model(tmp_path / "src")
    (top / "model.safetensors").chmod(0)
    try:
        answer = run_script(tmp_path / "src", tmp_path / "cache")
    finally:
        (top / "model.safetensors").chmod(0o644)
    with pytest.raises(FleetError, match=r"cannot read model\.safetensors: Permission denied"):
        parse_store_manifest("store-1", str(tmp_path / "src"), MODEL, json.dumps(answer))


@pytest.mark.parametrize(
    ("row", "want"),
    [
        (["../etc/passwd", 1, "a" * 64], "has control characters"),
        (["a\nb", 1, "a" * 64], "has control characters"),
        (["ok.bin", -1, "a" * 64], "bad size or SHA-256"),
        (["ok.bin", 1, "xyz"], "bad size or SHA-256"),
        (["ok.bin"], "unreadable file entry"),
    ],
)
def test_a_store_answer_that_is_not_a_manifest_is_refused(row: list[object], want: str) -> None:
    text = json.dumps({"status": "ok", "why": "", "files": [row]})
    with pytest.raises(FleetError, match=want):
        parse_store_manifest("store-1", "/srv/models", MODEL, text)
    with pytest.raises(FleetError, match="unreadable answer from the store"):
        parse_store_manifest("store-1", "/srv/models", MODEL, "Traceback (most recent call last):")


def test_a_store_may_be_a_host_that_serves_nothing(tmp_path: Path) -> None:
    """A host with ``role: balancer`` carries SSH settings only; it may hold the models too."""
    inv = write_inventory(tmp_path, [
        ("gpu-1", host(2, model_source={**STORE, "host": "lb-1"})),
        ("lb-1", {"role": "balancer", "ssh_hostname": "127.0.0.5"}),
    ])  # fmt: skip
    (job,) = jobs_for(load_inventory(inv))
    assert job.store is not None and (job.store.sender.name, job.store.sender_address) == ("lb-1", "127.0.0.5")


def test_the_store_sends_at_its_own_egress_limit(tmp_path: Path) -> None:
    """The store host's own ``staging.egress_mib_s`` is the most it sends in all (``fleet.weights.stage``
    gives its copies turns at that limit): read from its entry, also when ``--limit`` leaves it out or
    it serves nothing; not set, no limit of its own (the hosts' settings are theirs, not the store's)."""
    inv = write_inventory(tmp_path, [
        ("gpu-1", host(2, model_source=STORE, staging={"egress_mib_s": 7})),
        ("store-1", host(3, staging={"egress_mib_s": 12.5})),
        ("gpu-2", host(4, model_source={**STORE, "host": "lb-1"})),
        ("lb-1", {"role": "balancer", "ssh_hostname": "127.0.0.5"}),  # (a balancer host takes no staging key)
        ("gpu-3", host(6, model_source={**STORE, "host": "gpu-4"})),
        ("gpu-4", host(7, staging={"egress_mib_s": 3})),
    ])  # fmt: skip
    for limit in (None, ["gpu-1", "gpu-2", "gpu-3"]):
        rates = {j.target.name: j.store.rate for j in jobs_for(load_inventory(inv, limit)) if j.store is not None}
        assert rates == {"gpu-1": 12.5 * 1024 * 1024, "gpu-2": None, "gpu-3": 3 * 1024 * 1024}, (limit, rates)


def test_a_bad_egress_limit_on_a_store_left_out_is_named(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, [
        ("gpu-1", host(2, model_source=STORE)),
        ("store-1", host(3, staging={"egress_mib_s": -1})),
    ])  # fmt: skip
    with pytest.raises(FleetError) as err:
        jobs_for(load_inventory(inv, ["gpu-1"]))  # the store's own problems are not reported: it is left out
    said = str(err.value)
    assert "host store-1 (a model_source store): staging.egress_mib_s=-1: Input should be greater than 0" in said, said
