"""Model staging (issue 22): the ``model_source`` key at the inventory boundary, the manifest and
its cache, the verdicts on a host's copy (table tests), and the host-side listing script run
here on a real directory."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError, InventoryError
from fleet.inventory.spec import host_spec
from fleet.weights.copyfact import HASH_CACHE_DIR, SCRIPT, hash_cache_path, parse_copy
from fleet.weights.manifest import CACHE_NAME, FileEntry, Manifest, build_manifest, safe_relpath
from fleet.weights.verify import FileState, HostFile, Rate, file_state, space_refusal, verdict

MODEL = "acme/tiny-7b"
BASE: dict[str, Any] = {
    "model": MODEL,
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}


def make_source(root: Path, files: dict[str, bytes] | None = None) -> Path:
    top = root / "acme" / "tiny-7b"
    top.mkdir(parents=True)
    for rel, data in (files or {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"x" * 3000}).items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)
    return top


def problems(extra: dict[str, Any], model: str = MODEL) -> list[str]:
    with pytest.raises(InventoryError) as err:
        host_spec("inv.py", "gpu-1", (), {**BASE, "model": model, **extra})
    return [str(p) for p in err.value.problems]


# -- the inventory key ------------------------------------------------------------------------------


def test_a_dir_source_holding_the_model_is_taken(tmp_path: Path) -> None:
    make_source(tmp_path)
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": {"kind": "dir", "path": str(tmp_path)}})
    assert spec.model_source is not None
    assert (spec.model_source.kind, spec.model_source.path) == ("dir", str(tmp_path))
    assert spec.model_source.model_dir(MODEL) == str(tmp_path / "acme" / "tiny-7b")


def test_no_source_is_the_default() -> None:
    assert host_spec("inv.py", "gpu-1", (), BASE).model_source is None


@pytest.mark.parametrize(
    ("source", "want"),
    [
        ({"kind": "dir", "path": "/nonexistent/models"}, "model_source.path='/nonexistent/models': no such directory"),
        ({"kind": "dir", "path": "models"}, "model_source.path='models': an absolute path"),
        ({"kind": "dir", "path": "/srv/../models"}, "an absolute path without '.' or '..' parts"),
        ({"kind": "http", "path": "/srv"}, "model_source.kind="),
        ({"kind": "dir", "path": "/srv", "pth": 1}, "model_source.pth=1: unknown key; allowed: kind, path"),
        ({"path": "/srv"}, "model_source.kind"),
        ("/srv/models", "model_source='/srv/models': must be a dict"),
    ],
)
def test_bad_sources_are_named_with_the_way_out(source: object, want: str) -> None:
    found = problems({"model_source": source})
    assert any(want in p and "inv.py: host gpu-1" in p for p in found), found


def test_a_source_without_the_model_names_the_missing_directory(tmp_path: Path) -> None:
    (found,) = problems({"model_source": {"kind": "dir", "path": str(tmp_path)}})
    assert f"model_source.path='{tmp_path}': holds no {MODEL}/config.json" in found, found
    assert f"huggingface-cli download {MODEL} --local-dir" in found, found


def test_a_path_model_is_not_staged(tmp_path: Path) -> None:
    (found,) = problems({"model_source": {"kind": "dir", "path": str(tmp_path)}}, model="/models/x")
    assert "stages models named by Hugging Face id" in found, found


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_source_is_refused(tmp_path: Path) -> None:
    make_source(tmp_path)
    tmp_path.chmod(0)
    try:
        (found,) = problems({"model_source": {"kind": "dir", "path": str(tmp_path)}})
    finally:
        tmp_path.chmod(0o755)
    assert "not readable by this user" in found, found


# -- the manifest ------------------------------------------------------------------------------------


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    make_source(tmp_path, {"config.json": b"{}", "sub/b.bin": b"bb", ".cache/x": b"skip", ".hidden": b"skip"})
    m = build_manifest(str(tmp_path), MODEL)
    assert m.files == (
        FileEntry("config.json", 2, hashlib.sha256(b"{}").hexdigest()),
        FileEntry("sub/b.bin", 2, hashlib.sha256(b"bb").hexdigest()),
    )
    assert m.total_bytes == 4 and len(m.revision) == 40


def test_the_manifest_is_hashed_once_and_again_only_for_a_changed_file(tmp_path: Path) -> None:
    top = make_source(tmp_path)
    hashed: list[str] = []
    first = build_manifest(str(tmp_path), MODEL, hashed)
    assert sorted(hashed) == ["config.json", "model.safetensors"] and (top / CACHE_NAME).is_file()
    hashed.clear()
    assert build_manifest(str(tmp_path), MODEL, hashed) == first and hashed == []
    (top / "model.safetensors").write_bytes(b"y" * 3000)  # same size, new mtime
    os.utime(top / "model.safetensors", ns=(1, 1))
    second = build_manifest(str(tmp_path), MODEL, hashed)
    assert hashed == ["model.safetensors"] and second.revision != first.revision


def test_a_read_only_source_caches_under_the_users_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = make_source(tmp_path / "src")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    os.chmod(top, 0o555)
    try:
        if os.access(top, os.W_OK):
            pytest.skip("root writes into a read-only directory")
        build_manifest(str(tmp_path / "src"), MODEL)
    finally:
        os.chmod(top, 0o755)
    assert list((tmp_path / "cache" / "fleet" / "manifests").glob("*.json"))


def test_a_source_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match=r"no acme/tiny-7b/config\.json"):
        build_manifest(str(tmp_path), MODEL)


@pytest.mark.parametrize(
    ("rel", "ok"),
    [("a.bin", True), ("sub/a.bin", True), ("../a", False), ("/a", False), ("a//b", False), ("a\nb", False),
     ("", False), ("./a", False), ("ü.bin", True)],
)  # fmt: skip
def test_safe_relpath(rel: str, ok: bool) -> None:
    assert safe_relpath(rel) is ok


# -- verdicts ------------------------------------------------------------------------------------


WANT = FileEntry("m.safetensors", 100, "a" * 64)


@pytest.mark.parametrize(
    ("have", "state"),
    [
        (None, FileState.MISSING),
        (HostFile(99, "b" * 64), FileState.TRUNCATED),
        (HostFile(0, "b" * 64), FileState.TRUNCATED),
        (HostFile(101, "b" * 64), FileState.OVERSIZED),
        (HostFile(100, "b" * 64), FileState.CORRUPTED),
        (HostFile(100, None), FileState.CORRUPTED),
        (HostFile(100, "a" * 64), FileState.OK),
    ],
)
def test_file_state(have: HostFile | None, state: FileState) -> None:
    assert file_state(WANT, have) is state


def test_verdict_sends_what_is_wrong_and_points_refs_last() -> None:
    a, b, c = FileEntry("a", 10, "1" * 64), FileEntry("b", 20, "2" * 64), FileEntry("c", 30, "3" * 64)
    m = Manifest(MODEL, (a, b, c))
    v = verdict(m, {"a": HostFile(10, "1" * 64), "b": HostFile(5, "x"), "z": HostFile(1, "z")}, None)
    assert v.to_send == (b, c) and v.bytes_to_send == 50 and not v.complete and not v.current
    assert v.damaged() == ["b (truncated)"] and v.missing() == 1
    full = {f.path: HostFile(f.size, f.sha256) for f in m.files}
    assert verdict(m, full, None).complete and not verdict(m, full, None).current
    assert verdict(m, full, m.revision).current
    assert not verdict(m, full, "0" * 40).current


@pytest.mark.parametrize(
    ("need", "free", "refused"),
    [(0, 0, False), (100, 100, False), (101, 100, True), (5 * 2**30, 2**30, True)],
)
def test_space_refusal(need: int, free: int, refused: bool) -> None:
    why = space_refusal(need, free, "/var/lib/vllm")
    assert (why is not None) is refused
    if why is not None:
        assert f"({need} bytes)" in why and f"({free} bytes) free" in why and "/var/lib/vllm" in why
        assert "nothing was sent" in why


@pytest.mark.parametrize(
    ("done", "total", "elapsed", "rate", "eta"),
    [(0, 100, 0.0, None, None), (0, 100, 5.0, None, None), (50, 100, 5.0, 10.0, 5.0), (100, 100, 4.0, 25.0, 0.0)],
)
def test_rate(done: int, total: int, elapsed: float, rate: float | None, eta: float | None) -> None:
    r = Rate(done, total, elapsed)
    assert (r.per_second, r.eta) == (rate, eta)


# -- the host-side listing script, run here on a real directory --------------------------------------


def test_the_listing_script_finds_truncated_and_corrupted_files(tmp_path: Path) -> None:
    repo = tmp_path / "models--acme--tiny-7b"
    snap = repo / "snapshots" / "r1"
    (snap / "sub").mkdir(parents=True)
    (snap / "ok.bin").write_bytes(b"hello")
    (snap / "sub" / "cut.bin").write_bytes(b"hel")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("r0\n")
    (repo / ".fleet-incoming").mkdir()
    (repo / ".fleet-incoming" / "000000.partial").write_bytes(b"z" * 10)
    proc = subprocess.run(
        [sys.executable, "-", str(repo), "r1", getpass.getuser()], input=SCRIPT, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    copy = parse_copy(proc.stdout.strip())
    assert copy.refs_main == "r0" and copy.user_exists and copy.where == str(repo) and copy.free >= 10
    good = FileEntry("ok.bin", 5, hashlib.sha256(b"hello").hexdigest())
    cut = FileEntry("sub/cut.bin", 5, hashlib.sha256(b"hello").hexdigest())
    bad = FileEntry("bad.bin", 1, "0" * 64)
    states = verdict(Manifest(MODEL, (bad, good, cut)), copy.files, copy.refs_main).states
    assert [s for _f, s in states] == [FileState.MISSING, FileState.OK, FileState.TRUNCATED]


def test_the_listing_script_on_a_host_without_the_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-", str(tmp_path / "hub" / "models--a--b"), "r1", "no-such-user-x"], input=SCRIPT,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    copy = parse_copy(proc.stdout.strip())
    assert copy.files == {} and copy.refs_main is None and not copy.user_exists and copy.where == str(tmp_path)


def _list_with_cache(repo: Path, cache: Path) -> Any:
    proc = subprocess.run(
        [sys.executable, "-", str(repo), "r1", getpass.getuser(), str(cache)], input=SCRIPT, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return parse_copy(proc.stdout.strip())


def test_the_listing_script_reads_an_unchanged_file_once(tmp_path: Path) -> None:
    """The hash cache (issue 22's re-hash cost): a second listing reads no file; a file rewritten
    with the same size and its old mtime put back is read again (its ctime moved), so a corrupted
    copy is still found; a cache others may write is not trusted."""
    snap = tmp_path / "models--acme--tiny-7b" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "a.bin").write_bytes(b"a" * 1000)
    (snap / "b.bin").write_bytes(b"b" * 500)
    cache = tmp_path / "cache" / "snap.json"
    first = _list_with_cache(snap.parent.parent, cache)
    assert (first.hashed_bytes, first.reused_bytes) == (1500, 0)
    assert cache.stat().st_mode & 0o777 == 0o600 and cache.parent.stat().st_mode & 0o777 == 0o700
    second = _list_with_cache(snap.parent.parent, cache)
    assert (second.hashed_bytes, second.reused_bytes) == (0, 1500) and second.files == first.files
    old = (snap / "b.bin").stat()
    (snap / "b.bin").write_bytes(b"B" * 500)  # a flipped copy of the same size ...
    os.utime(snap / "b.bin", ns=(old.st_atime_ns, old.st_mtime_ns))  # ... with its old mtime back
    third = _list_with_cache(snap.parent.parent, cache)
    assert (third.hashed_bytes, third.reused_bytes) == (500, 1000)
    assert third.files["b.bin"].sha256 == hashlib.sha256(b"B" * 500).hexdigest() != first.files["b.bin"].sha256
    cache.chmod(0o666)
    assert _list_with_cache(snap.parent.parent, cache).hashed_bytes == 1500


def test_the_hash_cache_is_one_root_only_file_per_snapshot() -> None:
    a, b = hash_cache_path("/var/lib/vllm/hf/hub/models--a--b", "r1"), hash_cache_path("/srv/hub/models--a--b", "r1")
    assert (
        a != b
        and a.startswith(HASH_CACHE_DIR + "/")
        and a.endswith("-r1.json")
        and "/" not in a[len(HASH_CACHE_DIR) + 1 :]
    )


def test_an_unreadable_answer_is_an_error() -> None:
    with pytest.raises(FleetError, match="unreadable answer"):
        parse_copy(json.dumps({"files": []}))


def test_the_planner_reads_the_models_config_from_the_source(tmp_path: Path) -> None:
    """A model this machine has no copy of is planned from the source's config.json (issue 22, part 4)."""
    from fleet.model.arch import load_model
    from fleet.model.config import BUNDLED_MODELS

    config = (BUNDLED_MODELS / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json").read_bytes()
    make_source(tmp_path, {"config.json": config})
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": {"kind": "dir", "path": str(tmp_path)}})
    assert spec.model_config == str(tmp_path / "acme" / "tiny-7b")
    arch = load_model(spec.model, spec.model_config)
    assert arch.name == MODEL and str(tmp_path) in arch.source


def test_a_draft_model_the_source_holds_is_staged_after_the_model(tmp_path: Path) -> None:
    """Issue 23 part 2: the speculative draft's weights travel with the model (when named by id and
    held by ``model_source``); a draft the source does not hold is left to the operator."""
    from fleet.inventory.spec import load_inventory
    from fleet.weights.stage import jobs_for

    bundled = Path(__file__).resolve().parents[2] / "fleet" / "data" / "models" / "meta-llama"
    source = tmp_path / "src"
    for name in ("Llama-3.1-70B-Instruct", "Llama-3.1-8B-Instruct"):
        (source / "meta-llama" / name).mkdir(parents=True)
        (source / "meta-llama" / name / "config.json").write_bytes((bundled / name / "config.json").read_bytes())
    wl = {"p95_input_tokens": 2000, "p95_output_tokens": 300, "prefix_reuse": 0.0, "target_concurrency": 8}

    def staged(draft: str, **extra: str) -> list[str]:
        sp = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, **extra}
        inv = tmp_path / "inv.py"
        inv.write_text(
            f"h = [('h1', {{'model': 'meta-llama/Llama-3.1-70B-Instruct', 'workload': {wl}, 'gpu': {{'sku': "
            f"'h100-sxm-80gb', 'count': 4}}, 'speculative': {sp}, 'model_source': {{'kind': 'dir', 'path': "
            f"'{source}'}}}})]\n"
        )
        return [j.model for j in jobs_for(load_inventory(str(inv)))]

    seventy, eight = "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"
    assert staged(eight) == [seventy, eight]
    elsewhere = tmp_path / "draft"  # the draft's config given apart, its weights not in the source
    elsewhere.mkdir()
    (elsewhere / "config.json").write_bytes((source / eight / "config.json").read_bytes())
    (source / eight / "config.json").unlink()
    (source / eight).rmdir()
    assert staged(eight, model_config=str(elsewhere / "config.json")) == [seventy]


def test_each_host_s_env_files_name_the_snapshots_staged_for_it(tmp_path: Path) -> None:
    """``weights_by_host``: (model id, manifest revision) per staged job, in the order staged;
    a file rewritten under the same name gives another revision (so another configuration revision)."""
    from fleet.deploy.staging import weights_by_host
    from fleet.inventory.spec import load_inventory
    from fleet.weights.stage import jobs_for, manifests_for

    top = make_source(tmp_path / "src")
    inv = tmp_path / "inv.py"
    data = {**BASE, "model_source": {"kind": "dir", "path": str(tmp_path / "src")}}
    inv.write_text(f"h = [('h1', {data!r}), ('h2', {BASE!r})]\n")
    loaded = load_inventory(str(inv))
    first = weights_by_host(loaded, manifests_for(jobs_for(loaded)))
    assert list(first) == ["h1"] and [m for m, _r in first["h1"]] == [MODEL]  # h2 stages nothing
    (top / "model.safetensors").write_bytes(b"y" * 3000)
    again = weights_by_host(loaded, manifests_for(jobs_for(loaded)))
    assert again["h1"][0][1] != first["h1"][0][1]
