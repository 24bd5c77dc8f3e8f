"""``fleet stage`` from a mirror laid out like the Hugging Face Hub (issue 22, part 1's mirror) to a
real lab host: the Hub-shaped stand-in (``tests/hubmirror.py``) on this machine's 127.0.0.1 serves
a generated checkpoint of real safetensors files behind a bearer token; only this machine talks to
it (the lab's hosts are air-gapped), the files are checked against the mirror's own metadata here
and then staged like a directory source. A refused token and a file whose content differs from the
mirror's LFS metadata are refused before any host is touched, the token never printed. Shares the
session's ``lab_fleet``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.hubmirror import HubStandIn

from .conftest import LabFleet
from .deploying import REPO_ROOT
from .test_stage_lab import (
    FLEET,
    MODEL,
    REPO,
    host_sums,
    make_checkpoint,
    on,
    service_users,
    stage_body,
    staging_inventory,
    sums_of,
)

pytestmark = pytest.mark.lab

TOKEN = "hf_" + "Lb7QwE9rTy2UiOp4AsDf6GhJk8LzXc1V"


def test_stage_from_a_hub_mirror_behind_a_token(
    lab_fleet: LabFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = make_checkpoint(tmp_path / "repo")
    want = sums_of(top)
    host = lab_fleet.state.hosts[0].name
    created: list[int] = []
    with HubStandIn(token=TOKEN) as hub:
        commit = hub.add(MODEL, top)

        def inventory(name: str, **source: object) -> Path:
            hub_source = {"kind": "hub", "endpoint": hub.url, "token_ref": "env:MIRROR_TOKEN",
                          "cache_dir": str(tmp_path / "cache"), **source}  # fmt: skip
            return staging_inventory(lab_fleet, tmp_path / name, top, model_source=hub_source)

        try:
            created = service_users(lab_fleet)
            # a token the mirror refuses: refused here, before any host is touched, naming the ref
            monkeypatch.setenv("MIRROR_TOKEN", "hf_" + "Wrong0Wrong0Wrong0Wrong0Wrong0Wr")
            rc, body, err = stage_body(inventory("refused.py"), "--limit", host)
            assert rc == 2, (body, err)
            assert "refused the token from model_source.token_ref env:MIRROR_TOKEN (HTTP 401)" in body["error"]
            assert "Wrong0" not in str(body) + err
            rc, out, _err = on(lab_fleet, 0, f"sudo ls -A {REPO} 2>/dev/null | wc -l")
            assert out.strip() == "0", out  # nothing on the host

            # the token it takes: fetched here, checked against the mirror's metadata, staged and verified
            monkeypatch.setenv("MIRROR_TOKEN", TOKEN)
            before = len(hub.requests)
            rc, body, err = stage_body(inventory("good.py"), "--limit", host)
            assert rc == 0, (body, err)
            (result,) = body["hosts"]
            assert result["status"] == "staged" and result["sent_files"] == len(want), result
            revision = str(result["revision"])
            assert host_sums(lab_fleet, 0, revision) == want
            rc, out, err = on(lab_fleet, 0, f"sudo cat {REPO}/refs/main")
            assert rc == 0 and out.strip() == revision, (out, err)
            assert TOKEN not in str(body) + err
            asked = hub.requests[before:]
            gets = [path for method, path, _auth in asked if method == "GET" and "/resolve/" in path]
            assert sorted(p.rsplit("/", 1)[1] for p in gets) == sorted(want)
            assert all(f"/resolve/{commit}/" in p for p in gets)  # one commit, whatever main names later
            assert asked and all(auth == f"Bearer {TOKEN}" for _m, _p, auth in asked)

            # the mirror's copy of a shard no longer matches its own LFS metadata: refused, the host
            # keeps the verified copy it has (a fresh cache here, so the file is downloaded again)
            shard = top / "model-00002-of-00002.safetensors"
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0x01
            shard.write_bytes(bytes(data))
            rc, body, err = stage_body(inventory("damaged.py", cache_dir=str(tmp_path / "cache2")), "--limit", host)
            assert rc == 2, (body, err)
            assert "model-00002-of-00002.safetensors as downloaded" in body["error"], body
            assert "the mirror's LFS metadata says" in body["error"] and "nothing was sent to any host" in body["error"]
            assert host_sums(lab_fleet, 0, revision) == want
        finally:
            for i in range(len(lab_fleet.state.hosts)):
                on(lab_fleet, i, f"sudo rm -rf {REPO}")
            for i in created:
                on(lab_fleet, i, "sudo userdel -r vllm")


def test_a_dry_deploy_plans_from_the_mirror_and_leaves_its_weights_there(
    lab_fleet: LabFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fleet deploy --dry` on a hub source: the plan reads config.json from the mirror (this machine
    has no copy), the manifest is the mirror's metadata, and no weight file is downloaded."""
    top = make_checkpoint(tmp_path / "repo")
    host = lab_fleet.state.hosts[0].name
    with HubStandIn(token=TOKEN) as hub:
        hub.add(MODEL, top)
        source = {"kind": "hub", "endpoint": hub.url, "token_ref": "env:MIRROR_TOKEN", "cache_dir": str(tmp_path / "c")}
        inventory = staging_inventory(lab_fleet, tmp_path / "dry.py", top, model_source=source)
        monkeypatch.setenv("MIRROR_TOKEN", TOKEN)
        proc = subprocess.run(
            [str(FLEET), "deploy", str(inventory), "--dry", "--limit", host, "--json"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert TOKEN not in proc.stdout + proc.stderr
        got = {p.rsplit("/", 1)[1] for m, p, _a in hub.requests if m == "GET" and "/resolve/" in p}
        assert got == {"config.json", "tokenizer_config.json", "model.safetensors.index.json"}, got
        assert not list((tmp_path / "c").rglob("*.safetensors"))
