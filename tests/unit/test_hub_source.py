"""``model_source: {kind: hub}`` (issue 22, part 1's mirror): the key at the inventory boundary
(a table of bad values and their messages), and the manifest and the control machine's copy built
from a Hub-shaped mirror on 127.0.0.1 (``tests/hubmirror.py``) serving a generated checkpoint of
real safetensors files: happy path, a token refused, a model or revision the mirror lacks, a file
whose content does not match the mirror's own LFS metadata, a mirror that does not answer, and
``fleet plan`` reading config.json from the mirror when this machine has no copy."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError, InventoryError
from fleet.inventory.spec import ModelSource, host_spec
from fleet.model import mirror
from fleet.model.mirror import MirrorError, fetch_planning_files
from fleet.weights.mirror import mirror_manifest
from tests.hubmirror import HubStandIn
from tests.lab.test_stage_lab import make_checkpoint

MODEL = "fleet-test/tiny-st"
TOKEN = "hf_" + "Zq8RkT2vLm4NwX6pYb1CdE3fGh5JsU7a"  # shaped like a real token: must never be printed
BASE: dict[str, Any] = {
    "model": MODEL,
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}


def problems(source: object) -> list[str]:
    with pytest.raises(InventoryError) as err:
        host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": source})
    return [str(p) for p in err.value.problems]


# -- the inventory key ------------------------------------------------------------------------------


def test_a_hub_source_is_taken_and_kept_in_its_cache_dir(tmp_path: Path) -> None:
    src = {"kind": "hub", "endpoint": "https://hf-mirror.internal/", "token_ref": "env:HF_MIRROR_TOKEN",
           "revision": "v1.0", "cache_dir": str(tmp_path)}  # fmt: skip
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": src})
    source = spec.model_source
    assert source is not None and source.kind == "hub"
    assert (source.endpoint, source.revision, str(source.token_ref)) == (
        "https://hf-mirror.internal", "v1.0", "env:HF_MIRROR_TOKEN"
    )  # fmt: skip
    assert source.path.startswith(str(tmp_path) + "/hf-mirror.internal-") and source.path.endswith("/v1.0")
    # the planner reads the model's config where the mirror's files land on this machine
    assert spec.model_config == source.model_dir(MODEL) == os.path.join(source.path, "fleet-test", "tiny-st")
    other = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": {**src, "revision": "refs/pr/1"}})
    assert other.model_source is not None and other.model_source.path.endswith("/refs%2Fpr%2F1")


def test_a_hub_source_defaults_to_main_and_the_users_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = host_spec(
        "inv.py", "gpu-1", (), {**BASE, "model_source": {"kind": "hub", "endpoint": "http://10.0.0.5:8080"}}
    )
    assert spec.model_source is not None
    assert (spec.model_source.revision, spec.model_source.token_ref) == ("main", None)
    assert spec.model_source.path.startswith(str(tmp_path / "fleet" / "hub" / "10.0.0.5-"))


@pytest.mark.parametrize(
    ("source", "want"),
    [
        (
            {"kind": "hub"},
            "model_source.endpoint=None: required: the URL of a mirror laid out like the Hugging Face Hub",
        ),
        (
            {"kind": "hub", "endpoint": "ftp://mirror.internal"},
            "model_source.endpoint='ftp://mirror.internal': an http:// or https:// URL",
        ),
        (
            {"kind": "hub", "endpoint": "mirror.internal"},
            "an http:// or https:// URL of a mirror laid out like the Hugging Face Hub",
        ),
        (
            {"kind": "hub", "endpoint": "https://alice@mirror.internal"},
            "no user or password (a token goes in token_ref)",
        ),
        ({"kind": "hub", "endpoint": "https://mirror.internal/?token=x"}, "no query or fragment"),
        ({"kind": "hub", "endpoint": "https://mirror.internal:99999"}, "an http:// or https:// URL"),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "revision": "../main"},
            "model_source.revision='../main': a branch or tag name",
        ),
        ({"kind": "hub", "endpoint": "https://m.internal", "revision": "main/"}, "not ending in '/' or '.lock'"),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "revision": ""},
            "model_source.revision='': a branch or tag name",
        ),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "cache_dir": "cache"},
            "model_source.cache_dir='cache': an absolute path",
        ),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "token_ref": "HF_TOKEN"},
            "model_source.token_ref=<redacted>: a reference to the mirror's token",
        ),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "path": "/srv"},
            "model_source.path='/srv': unknown key; allowed: kind, endpoint, token_ref, revision, cache_dir",
        ),
        (
            {"kind": "hub", "endpoint": "https://m.internal", "token": "abc"},
            "model_source.token=<redacted>: unknown key; allowed: kind, endpoint, token_ref, revision, cache_dir",
        ),
        (
            {"kind": "s3", "endpoint": "https://m.internal"},
            "model_source.kind='s3': must be one of: dir (a directory on this machine) or hub",
        ),
        (
            {"kind": "dir", "endpoint": "https://m.internal", "path": "/srv"},
            "model_source.endpoint='https://m.internal': unknown key; allowed: kind, path",
        ),
    ],
)
def test_bad_hub_sources_are_named_with_the_way_out(source: object, want: str) -> None:
    found = problems(source)
    assert any(want in p for p in found), found


def test_a_token_in_the_inventory_is_refused_and_never_echoed() -> None:
    for source in ({"kind": "hub", "endpoint": "https://m.internal", "token_ref": TOKEN},
                   {"kind": "hub", "endpoint": "https://m.internal", "token": TOKEN},
                   {"kind": "hub", "endpoint": f"https://user:{TOKEN}@m.internal"}):  # fmt: skip
        found = problems(source)
        assert found and not any(TOKEN in p or TOKEN[:12] in p for p in found), found


def test_names_like_hf_dash_mirror_are_not_tokens(tmp_path: Path) -> None:
    """``hf-mirror.internal`` and ``/srv/hf-cache`` are names, not tokens (a token is hf_ + letters)."""
    src = {"kind": "hub", "endpoint": "https://hf-mirror.internal", "cache_dir": str(tmp_path / "hf-cache-big")}
    assert host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": src}).model_source is not None


def test_a_model_given_as_a_path_is_not_staged_from_a_hub() -> None:
    with pytest.raises(InventoryError) as err:
        host_spec("inv.py", "gpu-1", (), {**BASE, "model": "/models/x",
                                          "model_source": {"kind": "hub", "endpoint": "https://m.internal"}})  # fmt: skip
    assert "model_source='https://m.internal': stages models named by Hugging Face id" in str(err.value)


# -- the mirror -------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "repo")


@pytest.fixture
def hub(checkpoint: Path) -> Iterator[HubStandIn]:
    mirror.forget()
    with HubStandIn() as server:
        server.add(MODEL, checkpoint)
        yield server
    mirror.forget()


def source_of(hub: HubStandIn, cache: Path, **extra: Any) -> ModelSource:
    data = {"kind": "hub", "endpoint": hub.url, "cache_dir": str(cache), **extra}
    spec = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": data})
    assert spec.model_source is not None
    return spec.model_source


def sha256s(top: Path) -> dict[str, str]:
    return {p.relative_to(top).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(top.rglob("*")) if p.is_file() and not any(x.startswith(".") for x in p.relative_to(top).parts)}  # fmt: skip


def test_the_manifest_is_the_mirrors_metadata_and_the_copy_matches_it(
    hub: HubStandIn, checkpoint: Path, tmp_path: Path
) -> None:
    source = source_of(hub, tmp_path / "cache")
    hashed: list[str] = []
    manifest = mirror_manifest(source, MODEL, hashed)
    want = sha256s(checkpoint)
    assert {f.path: f.sha256 for f in manifest.files} == want
    assert {f.path: f.size for f in manifest.files} == {p: (checkpoint / p).stat().st_size for p in want}
    # the LFS files' SHA-256 are the mirror's own metadata, as the tree listing gave them
    lfs = {str(e["path"]): str(e["lfs"]["oid"]) for e in hub.repos[MODEL].files.values() if "lfs" in e}  # type: ignore[index]
    assert lfs and all(manifest.by_path()[p].sha256 == sha for p, sha in lfs.items())
    top = Path(source.model_dir(MODEL))
    assert sha256s(top) == want and sorted(hashed) == sorted(want)
    assert not (top / ".fleet-download").exists()
    # a second run (another process) finds the copy whole: nothing downloaded, nothing hashed again
    mirror.forget()
    gets = len([r for r in hub.requests if "/resolve/" in r[1]])
    again: list[str] = []
    assert mirror_manifest(source, MODEL, again) == manifest
    assert again == [] and len([r for r in hub.requests if "/resolve/" in r[1]]) == gets


def test_a_damaged_or_stale_copy_here_is_fetched_again_and_other_files_removed(hub: HubStandIn, tmp_path: Path) -> None:
    source = source_of(hub, tmp_path / "cache")
    first = mirror_manifest(source, MODEL)
    top = Path(source.model_dir(MODEL))
    shard = top / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    (top / "old-shard.safetensors").write_bytes(b"from another commit")
    mirror.forget()
    hashed: list[str] = []
    assert mirror_manifest(source, MODEL, hashed) == first
    assert hashed == ["model-00002-of-00002.safetensors"]
    assert not (top / "old-shard.safetensors").exists()


def test_a_file_that_does_not_match_the_mirrors_metadata_is_refused(
    hub: HubStandIn, checkpoint: Path, tmp_path: Path
) -> None:
    shard = checkpoint / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the same size, another SHA-256 than the mirror's LFS metadata says
    shard.write_bytes(bytes(data))
    source = source_of(hub, tmp_path / "cache")
    with pytest.raises(MirrorError) as err:
        mirror_manifest(source, MODEL)
    text = str(err.value)
    assert "model-00001-of-00002.safetensors as downloaded" in text and "the mirror's LFS metadata says" in text
    assert hashlib.sha256(bytes(data)).hexdigest() in text and "nothing was sent to any host" in text
    top = Path(source.model_dir(MODEL))
    assert not (top / "model-00001-of-00002.safetensors").exists()  # never where a manifest would list it


def test_a_small_file_is_checked_against_its_git_blob_id(hub: HubStandIn, checkpoint: Path, tmp_path: Path) -> None:
    (checkpoint / "tokenizer_config.json").write_text("[]")  # same size as "{}", another blob
    with pytest.raises(MirrorError, match=r"tokenizer_config.json as downloaded .* has git blob id"):
        mirror_manifest(source_of(hub, tmp_path / "cache"), MODEL)


def test_a_token_the_mirror_refuses_names_the_ref_never_the_token(
    hub: HubStandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub.token = TOKEN
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the machine's own token is never sent on the inventory's behalf
    with pytest.raises(MirrorError) as err:
        mirror_manifest(source_of(hub, tmp_path / "cache"), MODEL)
    assert "the mirror wants a token (HTTP 401)" in str(err.value) and "set model_source.token_ref" in str(err.value)
    assert "check model" in str(err.value)  # the Hub answers 401 for a model it lacks, without a token
    assert all(auth is None for _m, _p, auth in hub.requests)
    monkeypatch.setenv("MIRROR_TOKEN", "hf_" + "WrongWrongWrong1234567890abcdef")
    mirror.forget()
    with pytest.raises(MirrorError) as err:
        mirror_manifest(source_of(hub, tmp_path / "cache", token_ref="env:MIRROR_TOKEN"), MODEL)
    text = str(err.value)
    assert "refused the token from model_source.token_ref env:MIRROR_TOKEN (HTTP 401)" in text
    assert "WrongWrong" not in text and TOKEN not in text
    monkeypatch.setenv("MIRROR_TOKEN", TOKEN)
    mirror.forget()
    manifest = mirror_manifest(source_of(hub, tmp_path / "cache", token_ref="env:MIRROR_TOKEN"), MODEL)
    assert len(manifest.files) == 5 and hub.requests[-1][2] == f"Bearer {TOKEN}"


def test_a_token_ref_that_cannot_be_read_is_named(hub: HubStandIn, tmp_path: Path) -> None:
    with pytest.raises(FleetError, match=r"model_source\.token_ref env:NO_SUCH_VARIABLE_X: the environment variable"):
        mirror_manifest(source_of(hub, tmp_path / "cache", token_ref="env:NO_SUCH_VARIABLE_X"), MODEL)
    assert hub.requests == []


def test_a_model_or_revision_the_mirror_lacks_is_named(hub: HubStandIn, tmp_path: Path) -> None:
    source = source_of(hub, tmp_path / "cache")
    with pytest.raises(MirrorError, match=r"the mirror has no model fleet-test/other: fix model"):
        mirror_manifest(source, "fleet-test/other")
    with pytest.raises(
        MirrorError, match=r"the mirror has no revision 'v9' of fleet-test/tiny-st: fix model_source.revision"
    ):
        mirror_manifest(source_of(hub, tmp_path / "cache", revision="v9"), MODEL)
    assert not any(r[0] == "GET" and "/resolve/" in r[1] for r in hub.requests)


def test_a_mirror_that_does_not_answer_is_named(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mirror.forget()
    data = {"kind": "hub", "endpoint": f"http://127.0.0.1:{port}", "cache_dir": str(tmp_path)}
    source = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": data}).model_source
    assert source is not None
    with pytest.raises(MirrorError, match=rf"model_source http://127.0.0.1:{port}: .*cannot reach the mirror"):
        mirror_manifest(source, MODEL)


def test_plan_reads_config_json_from_the_mirror(hub: HubStandIn, checkpoint: Path, tmp_path: Path) -> None:
    from fleet.plan.outcomes import load_for_planning, plan_inventory

    inventory = tmp_path / "inventory.py"
    data = {**BASE, "gpu": {"sku": "h100-sxm-80gb", "count": 1},
            "model_source": {"kind": "hub", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    inventory.write_text(f"gpus = [('h1', {data!r})]\n")
    loaded = load_for_planning(inventory)
    spec = loaded.hosts[0]
    assert spec.model_config is not None
    assert json.loads(Path(spec.model_config, "config.json").read_text()) == json.loads(
        (checkpoint / "config.json").read_text()
    )
    got = {r[1].rsplit("/", 1)[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert got == {"config.json", "tokenizer_config.json", "model.safetensors.index.json"}  # not the weights
    (outcome,) = plan_inventory(loaded)
    assert outcome.plan is not None


def test_plan_names_a_mirror_that_lacks_the_model_before_any_host(hub: HubStandIn, tmp_path: Path) -> None:
    from fleet.plan.outcomes import load_for_planning

    inventory = tmp_path / "inventory.py"
    data = {**BASE, "model": "fleet-test/missing", "gpu": {"sku": "h100-sxm-80gb", "count": 1},
            "model_source": {"kind": "hub", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    inventory.write_text(f"gpus = [('h1', {data!r})]\n")
    with pytest.raises(InventoryError) as err:
        load_for_planning(inventory)
    (problem,) = err.value.problems
    assert (problem.host, problem.field, problem.value) == ("h1", "model_source", hub.url)
    assert "the mirror has no model fleet-test/missing" in problem.allowed


def test_fetch_planning_files_keeps_a_matching_copy(hub: HubStandIn, tmp_path: Path) -> None:
    source = source_of(hub, tmp_path / "cache")
    top = fetch_planning_files(source, MODEL)
    gets = [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]
    mirror.forget()
    assert fetch_planning_files(source, MODEL) == top
    assert [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]] == gets


def test_a_dry_run_leaves_the_weights_on_the_mirror_and_gets_the_same_manifest(hub: HubStandIn, tmp_path: Path) -> None:
    source = source_of(hub, tmp_path / "cache")
    dry = mirror_manifest(source, MODEL, fetch=False)
    got = {r[1].rsplit("/", 1)[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert got == {"config.json", "tokenizer_config.json", "model.safetensors.index.json"}
    assert not list(Path(source.model_dir(MODEL)).glob("*.safetensors"))
    mirror.forget()
    assert mirror_manifest(source, MODEL) == dry  # the same revision the hosts get


def test_the_librarys_warnings_go_to_fleets_log_redacted(
    hub: HubStandIn, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import logging

    mirror_manifest(source_of(hub, tmp_path / "cache"), MODEL)
    logging.getLogger("huggingface_hub.file_download").warning("Couldn't access the Hub with %s", TOKEN)
    assert "Couldn't access" not in capfd.readouterr().err
    log = Path(os.environ["FLEET_LOG"]).read_text()
    assert "Couldn't access the Hub with <redacted>" in log and TOKEN not in log


def test_one_run_serves_one_commit_and_the_next_follows_the_branch(
    hub: HubStandIn, checkpoint: Path, tmp_path: Path
) -> None:
    source = source_of(hub, tmp_path / "cache")
    first = mirror_manifest(source, MODEL)
    newer = tmp_path / "newer"
    newer.mkdir()
    for p in checkpoint.iterdir():
        if p.name != "model-00002-of-00002.safetensors":
            (newer / p.name).write_bytes(p.read_bytes())
    (newer / "model-00003.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}      ")
    commit = hub.add(MODEL, newer)  # main moves on
    assert mirror_manifest(source, MODEL) == first  # this process planned the first commit: it stages it
    mirror.forget()
    second = mirror_manifest(source, MODEL)
    assert second.revision != first.revision and "model-00003.safetensors" in second.by_path()
    top = Path(source.model_dir(MODEL))
    assert not (top / "model-00002-of-00002.safetensors").exists()  # the old commit's file is gone here
    assert any(f"/resolve/{commit}/model-00003.safetensors" in r[1] for r in hub.requests)


def test_a_server_that_is_not_a_hub_mirror_is_named(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Page(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b"<html>welcome</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        mirror.forget()
        data = {"kind": "hub", "endpoint": f"http://127.0.0.1:{server.server_address[1]}", "cache_dir": str(tmp_path)}
        source = host_spec("inv.py", "gpu-1", (), {**BASE, "model_source": data}).model_source
        assert source is not None
        with pytest.raises(MirrorError, match=r"is not the Hub.s .*: is model_source\.endpoint a mirror laid out like"):
            mirror_manifest(source, MODEL)
    finally:
        server.shutdown()
        server.server_close()


# -- an interrupted download, resumed ---------------------------------------------------------------

SHARD = "model-00002-of-00002.safetensors"


def test_the_stand_in_answers_a_range_as_the_hub_does(hub: HubStandIn) -> None:
    """``Range: bytes=N-`` (what ``http_get`` sends with ``resume_size``): 206 with ``Content-Range``."""
    import urllib.request

    url = f"{hub.url}/{MODEL}/resolve/main/{SHARD}"
    whole = urllib.request.urlopen(url, timeout=10).read()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=1000-"}), timeout=10) as r:
        assert r.status == 206 and r.headers["Content-Range"] == f"bytes 1000-{len(whole) - 1}/{len(whole)}"
        assert r.read() == whole[1000:]


def test_an_interrupted_download_is_resumed_by_the_next_run_fetching_only_the_rest(tmp_path: Path) -> None:
    """The connection closes 20 MiB into a 24 MiB shard and the mirror then fails (the run is
    interrupted): the bytes written are kept (``http_get`` writes whole chunks of the library's
    ``DOWNLOAD_CHUNK_SIZE``, 10 MiB, hence the size); the next run asks for the rest only
    (``Range``), gets it (206), checks the whole file's SHA-256 against the mirror's LFS metadata
    and renames it into place."""
    checkpoint = make_checkpoint(tmp_path / "repo")
    big = "model-big.safetensors"
    (checkpoint / big).write_bytes(os.urandom(24 << 20))
    size, cut = 24 << 20, 20 << 20
    mirror.forget()
    with HubStandIn() as hub:
        hub.add(MODEL, checkpoint)
        source = source_of(hub, tmp_path / "cache")
        top = Path(source.model_dir(MODEL))
        hub.cut[big] = cut
        with pytest.raises(MirrorError, match=rf"HTTP 503 while downloading {big}"):
            mirror_manifest(source, MODEL)
        want = mirror.remote_snapshot(source, MODEL).file(big)
        assert want is not None
        kept = mirror.partial_path(top, want)
        have = kept.stat().st_size
        assert 0 < have <= cut and kept.read_bytes() == (checkpoint / big).read_bytes()[:have]
        assert not (top / big).exists()  # never where a manifest would list it

        hub.down.clear()
        hub.served.clear()
        mirror.forget()
        notes: list[str] = []
        manifest = mirror_manifest(source, MODEL, note=notes.append)
        assert hub.served[big] == size - have  # only the rest
        assert (big, f"bytes={have}-") in hub.ranges
        assert SHARD not in hub.served  # done in the first run
        assert sha256s(top) == sha256s(checkpoint)
        assert manifest.by_path()[big].sha256 == hashlib.sha256((checkpoint / big).read_bytes()).hexdigest()
        assert any(f"fetching {big}" in n and "resuming at" in n for n in notes), notes
        assert not (top / ".fleet-download").exists()  # every file here: nothing kept
    mirror.forget()


def test_a_resumed_file_that_does_not_verify_is_refused_then_fetched_whole(
    hub: HubStandIn, checkpoint: Path, tmp_path: Path
) -> None:
    """A kept partial file whose bytes are not the mirror's (damaged here meanwhile): the resumed
    file fails the SHA-256 check, is removed and refused, never renamed into place; the next run
    downloads it whole."""
    source = source_of(hub, tmp_path / "cache")
    top = Path(source.model_dir(MODEL))
    want = mirror.remote_snapshot(source, MODEL).file(SHARD)
    assert want is not None
    kept = mirror.partial_path(top, want)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"\xff" * 1000)
    with pytest.raises(MirrorError, match=rf"{SHARD} as downloaded \(commit \w+, resumed at byte 1000\) has sha256"):
        mirror_manifest(source, MODEL)
    assert not kept.exists() and not (top / SHARD).exists()
    assert hub.served[SHARD] == want.size - 1000
    hub.served.clear()
    mirror.forget()
    mirror_manifest(source, MODEL)
    assert hub.served[SHARD] == want.size and sha256s(top) == sha256s(checkpoint)


def test_the_manifest_and_the_stage_result_name_the_mirrors_commit(hub: HubStandIn, tmp_path: Path) -> None:
    from fleet.deploy.staging import weights_data
    from fleet.weights.stage import StageResult, describe

    manifest = mirror_manifest(source_of(hub, tmp_path / "cache"), MODEL)
    commit = hub.repos[MODEL].commit
    assert manifest.commit == commit
    result = StageResult("gpu-1", MODEL, "current", manifest.revision, commit=manifest.commit)
    assert result.data()["commit"] == commit and f"(mirror commit {commit[:12]})" in describe(result)
    (row,) = weights_data({("/cache", MODEL): manifest})
    assert row == {"model": MODEL, "source": "/cache", "revision": manifest.revision, "commit": commit,
                   "bytes": manifest.total_bytes}  # fmt: skip


# -- a speculative draft from the mirror ------------------------------------------------------------

DRAFT = "fleet-test/tiny-draft"
LLAMA = Path(__file__).resolve().parents[2] / "fleet" / "data" / "models" / "meta-llama"


def draft_inventory(tmp_path: Path, hub: HubStandIn, **speculative: object) -> Path:
    sp = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4, **speculative}
    data = {**BASE, "gpu": {"sku": "h100-sxm-80gb", "count": 4}, "speculative": sp,
            "model_source": {"kind": "hub", "endpoint": hub.url, "cache_dir": str(tmp_path / "cache")}}  # fmt: skip
    inventory = tmp_path / "inventory.py"
    inventory.write_text(f"gpus = [('h1', {data!r})]\n")
    return inventory


def test_a_speculative_draft_named_by_id_comes_from_the_mirror_too(tmp_path: Path) -> None:
    """Issue 22 (draft models from a hub source): the plan reads the draft's config.json from the
    mirror beside the model's, and the draft is staged after the model from the same mirror (its
    own commit, checked against the mirror's metadata). A draft the mirror lacks is named on
    ``speculative.model`` before any host; a draft with its own ``model_config`` is left to the
    operator (not fetched, not staged), as for a ``dir`` source."""
    from fleet.plan.outcomes import load_for_planning, plan_inventory
    from fleet.weights.stage import jobs_for, manifests_for

    target = make_checkpoint(tmp_path / "repo", MODEL, config=LLAMA / "Llama-3.1-70B-Instruct" / "config.json")
    draft = make_checkpoint(tmp_path / "repo", DRAFT, config=LLAMA / "Llama-3.1-8B-Instruct" / "config.json")
    mirror.forget()
    with HubStandIn() as hub:
        hub.add(MODEL, target)
        with pytest.raises(InventoryError) as err:
            load_for_planning(draft_inventory(tmp_path, hub))
        (problem,) = err.value.problems
        assert (problem.host, problem.field, problem.value) == ("h1", "speculative.model", DRAFT)
        assert f"the mirror has no model {DRAFT}" in problem.allowed and "or give speculative.model_config" in (
            problem.allowed
        )

        hub.add(DRAFT, draft)
        mirror.forget()
        loaded = load_for_planning(draft_inventory(tmp_path, hub))
        spec = loaded.hosts[0]
        assert spec.model_source is not None and spec.speculative is not None
        assert spec.speculative.model_config == spec.model_source.planning_dir(DRAFT)
        assert Path(spec.speculative.model_config, "config.json").read_bytes() == (draft / "config.json").read_bytes()
        (outcome,) = plan_inventory(loaded)
        assert outcome.plan is not None, outcome
        jobs = jobs_for(loaded)
        assert [(j.model, j.hub == spec.model_source) for j in jobs] == [(MODEL, True), (DRAFT, True)]
        known = manifests_for(jobs)
        drafted = known[(jobs[1].source, DRAFT)]
        assert drafted.commit == hub.repos[DRAFT].commit
        assert sha256s(Path(spec.model_source.model_dir(DRAFT))) == sha256s(draft)

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "config.json").write_bytes((draft / "config.json").read_bytes())
        own = load_for_planning(draft_inventory(tmp_path, hub, model_config=str(elsewhere / "config.json")))
        assert [j.model for j in jobs_for(own)] == [MODEL]
    mirror.forget()
