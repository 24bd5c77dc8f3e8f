"""``fleet stage`` on real lab hosts (issue 22): a generated checkpoint of real safetensors files
copied from a source directory on this machine into each host's units' cache, verified against
its manifest; a corrupted and a truncated file found and sent again; a host whose disk is too
small refused with the numbers before anything is sent. Shares the session's ``lab_fleet``."""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import pprint
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.inventory.spec import load_inventory
from fleet.weights.manifest import build_manifest
from fleet.weights.stage import jobs_for, manifests_for, stage_all
from fleetlab import ssh
from fleetlab.inventory_writer import GROUP

from .conftest import LabFleet
from .deploying import REPO_ROOT

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
MODEL = "fleet-test/tiny-st"
REPO = "/var/lib/vllm/hf/hub/models--fleet-test--tiny-st"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"


def safetensors_file(path: Path, tensors: dict[str, tuple[int, int]], seed: int) -> None:
    """A safetensors file per its format (huggingface/safetensors, README "Format"): an 8-byte
    little-endian header length, the JSON header (dtype, shape, data_offsets per tensor), then the
    tensors' bytes (F32 here, deterministic per ``seed``)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, (rows, cols) in tensors.items():
        start = len(data)
        data += b"".join(struct.pack("<f", ((i * 31 + seed) % 997) / 997.0) for i in range(rows * cols))
        header[name] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [start, len(data)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format allows trailing spaces; aligns the data
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def make_checkpoint(root: Path, model: str = MODEL, config: Path = CONFIG) -> Path:
    """A small checkpoint of ``model`` under ``root`` (``root/ORG/NAME``, as a ``dir`` model_source
    holds it): ``config``'s config.json, two safetensors shards and their index."""
    top = root / model
    top.mkdir(parents=True)
    (top / "config.json").write_bytes(config.read_bytes())
    shards = {
        "model-00001-of-00002.safetensors": {"model.embed_tokens.weight": (256, 256), "model.norm.weight": (1, 256)},
        "model-00002-of-00002.safetensors": {"lm_head.weight": (256, 512)},
    }
    weight_map = {}
    for n, (name, tensors) in enumerate(shards.items()):
        safetensors_file(top / name, tensors, seed=n)
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(4 * rows * cols for tensors in shards.values() for rows, cols in tensors.values())  # F32
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}  # as transformers writes it
    (top / "model.safetensors.index.json").write_text(json.dumps(index))
    (top / "tokenizer_config.json").write_text("{}")
    return top


def staging_inventory(lab: LabFleet, path: Path, source: Path, **extra: object) -> Path:
    """The lab's inventory with every host serving ``MODEL`` from ``source`` (and ``extra`` data)."""
    assert lab.opts.inventory is not None
    text = lab.opts.inventory.read_text()
    hosts = ast.literal_eval(text.split(f"\n{GROUP} = ", 1)[1])
    for _name, data in hosts:
        data["model"] = MODEL
        data["model_source"] = {"kind": "dir", "path": str(source)}
        data.update(extra)
    path.write_text(f"{GROUP} = {pprint.pformat(hosts, width=100, sort_dicts=False)}\n")
    return path


def stage_body(inventory: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [str(FLEET), "stage", str(inventory), "--json", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, {"hosts": []}, proc.stdout + proc.stderr


def stage(inventory: Path, *args: str) -> tuple[int, dict[str, dict[str, object]], str]:
    rc, body, err = stage_body(inventory, *args)
    return rc, {h["host"]: h for h in body["hosts"]}, err


def on(lab: LabFleet, i: int, command: str, timeout: float = 120) -> tuple[int, str, str]:
    h = lab.state.hosts[i]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def host_sums(lab: LabFleet, i: int, revision: str) -> dict[str, str]:
    rc, out, err = on(lab, i, f"cd {REPO}/snapshots/{revision} && sudo find . -type f -exec sha256sum {{}} +")
    assert rc == 0, err
    return {line.split()[1].removeprefix("./"): line.split()[0] for line in out.splitlines()}


def sums_of(top: Path) -> dict[str, str]:
    return {p.relative_to(top).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in top.rglob("*")
            if p.is_file() and not p.name.startswith(".")}  # fmt: skip


def service_users(lab: LabFleet) -> list[int]:
    """The service user on every host, as `fleet deploy` creates it (fleet.operations.vllm.service_user);
    the hosts it was created on."""
    created = []
    for i in range(len(lab.state.hosts)):
        rc, _out, _err = on(lab, i, "id -u vllm")
        if rc != 0:
            rc, _out, err = on(lab, i, "sudo useradd --system --home-dir /var/lib/vllm --create-home "
                               "--shell /usr/sbin/nologin --user-group vllm")  # fmt: skip
            assert rc == 0, err
            created.append(i)
    return created


def test_stage_copies_verifies_repairs_and_refuses_a_small_disk(lab_fleet: LabFleet, tmp_path: Path) -> None:
    top = make_checkpoint(tmp_path / "src")
    want = sums_of(top)
    inventory = staging_inventory(lab_fleet, tmp_path / "inventory.py", tmp_path / "src")
    names = [h.name for h in lab_fleet.state.hosts]
    small = names[1]
    created = []
    try:
        created = service_users(lab_fleet)
        rc, _out, err = on(
            lab_fleet, 1, f"sudo mkdir -p {REPO} && sudo mount -t tmpfs -o size=64k fleet-test-small {REPO}"
        )
        assert rc == 0, err

        rc, hosts, err = stage(inventory)
        assert rc == 1, (hosts, err)
        refused = hosts[small]
        assert refused["status"] == "refused", refused
        assert f"on the filesystem of {REPO}; nothing was sent" in str(refused["error"]), refused
        need = sum((top / p).stat().st_size for p in want)
        numbers = f"the copy needs {need / 1024:.1f} KiB ({need} bytes), 64.0 KiB (65536 bytes) free"
        assert numbers in str(refused["error"]), refused
        rc, out, _err = on(lab_fleet, 1, f"sudo find {REPO} -type f")
        assert rc == 0 and out.strip() == "", out  # nothing was written there
        revision = str(hosts[names[0]]["revision"])
        for i, name in enumerate(names):
            if name == small:
                continue
            assert hosts[name]["status"] == "staged" and hosts[name]["sent_files"] == len(want), hosts[name]
            assert host_sums(lab_fleet, i, revision) == want
            rc, out, err = on(lab_fleet, i, f"sudo cat {REPO}/refs/main; echo; sudo stat -c '%U %a' "
                              f"{REPO}/snapshots/{revision}/config.json; sudo ls -A {REPO}")  # fmt: skip
            assert rc == 0 and out.split() == [revision, "vllm", "644", "refs", "snapshots"], (out, err)

        rc, hosts, err = stage(inventory, "--limit", names[0])
        assert rc == 0 and hosts[names[0]]["status"] == "current" and hosts[names[0]]["sent_bytes"] == 0, (hosts, err)

        snap = f"{REPO}/snapshots/{revision}"
        rc, _out, err = on(lab_fleet, 0, (
            f"printf 'X' | sudo dd of={snap}/model-00001-of-00002.safetensors bs=1 seek=5000 conv=notrunc status=none"
            f" && sudo truncate -s 1000 {snap}/model-00002-of-00002.safetensors"
        ))  # fmt: skip
        assert rc == 0, err
        rc, hosts, err = stage(inventory, "--limit", names[0])
        fixed = hosts[names[0]]
        assert rc == 0 and fixed["status"] == "staged" and fixed["sent_files"] == 2, (fixed, err)
        assert sorted(fixed["repaired"]) == [  # type: ignore[call-overload]
            "model-00001-of-00002.safetensors (corrupted)", "model-00002-of-00002.safetensors (truncated)"
        ]  # fmt: skip
        assert host_sums(lab_fleet, 0, revision) == want
    finally:
        on(lab_fleet, 1, f"sudo umount {REPO}")
        for i in range(len(names)):
            on(lab_fleet, i, f"sudo rm -rf {REPO}")
        for i in created:
            on(lab_fleet, i, "sudo userdel -r vllm")


#: The per-link limit of the fan-out test: each sender (this machine too) sends at most this much.
LINK_MIB_S = 0.5


def test_fanout_sends_host_to_host_in_a_tree_at_the_link_limit(lab_fleet: LabFleet, tmp_path: Path) -> None:
    """``fleet stage --fanout`` over the session lab's hosts (3: the issue's 8 would need a lab of
    its own; the tree's shape for any n is table-tested in tests/unit/test_fanout_tree.py): the
    rounds of a tree from this machine, a host sending to another directly through the air gap's
    staging port, every copy verified, each sender within its egress limit; then a holder whose
    copy cannot be read fails as a sender mid-run, is named, and its receiver gets another sender."""
    top = make_checkpoint(tmp_path / "src")
    want = sums_of(top)
    size = sum((top / p).stat().st_size for p in want)
    limit = LINK_MIB_S * 1024 * 1024
    inventory = staging_inventory(lab_fleet, tmp_path / "inventory.py", tmp_path / "src",
                                  staging={"egress_mib_s": LINK_MIB_S})  # fmt: skip
    state = lab_fleet.state
    names = [h.name for h in state.hosts]
    assert len(names) == 3, names
    created = []
    try:
        created = service_users(lab_fleet)
        rc, body, err = stage_body(inventory, "--fanout")
        hosts = {h["host"]: h for h in body["hosts"]}
        assert rc == 0 and body["ok"], (body, err)
        revision = str(hosts[names[0]]["revision"])
        assert body["bounds"] == [{"model": MODEL, "revision": revision, "hosts": 3, "holders": 1, "rounds": 2}]
        rounds = [[(s["from"], s["to"], s["status"]) for s in r] for r in body["rounds"]]
        assert rounds == [
            [("(control)", names[0], "staged")],
            [("(control)", names[1], "staged"), (names[0], names[2], "staged")],  # host to host
        ], rounds
        assert [hosts[n]["sender"] for n in names] == [None, None, names[0]]
        for r in body["rounds"]:
            for s in r:
                assert s["rate_limit"] == limit and s["sent_bytes"] == size, s
                assert s["sent_bytes"] / s["seconds"] <= limit * 1.05, s  # the sender kept to its limit
        for i in range(3):
            assert host_sums(lab_fleet, i, revision) == want  # every copy verifies
            rc, out, _err = on(lab_fleet, i, f"sudo cat {REPO}/refs/main; echo; sudo ls -A {REPO}")
            assert out.split() == [revision, "refs", "snapshots"], out

        if state.air_gap is not None:  # only the staging port is open between the hosts
            peer = state.hosts[1].address
            probe = (f"python3 -c 'import socket; s = socket.socket(); s.bind((\"{state.hosts[0].address}\", 0)); "
                     f"s.settimeout(10); s.connect((\"{peer}\", {state.ssh_port}))'")  # fmt: skip
            rc, _out, err = on(lab_fleet, 0, probe)
            assert rc != 0 and ("No route to host" in err or "Permission denied" in err), err

        # host 0 holds a verified copy but its second shard cannot be read by the service user: as a
        # sender it fails after the first files; it keeps its own copy, is named, and host 2 waits
        # for another sender
        snap = f"{REPO}/snapshots/{revision}"
        rc, _out, err = on(lab_fleet, 0, f"sudo chmod 000 {snap}/model-00002-of-00002.safetensors")
        assert rc == 0, err
        for i in (1, 2):
            rc, _out, err = on(lab_fleet, i, f"sudo rm -rf {REPO}")
            assert rc == 0, err
        rc, body, err = stage_body(inventory, "--fanout")
        hosts = {h["host"]: h for h in body["hosts"]}
        assert rc == 0 and body["ok"], (body, err)
        assert body["broken_senders"] == [names[0]], body
        first = {(s["from"], s["to"]): s for s in body["rounds"][0]}
        assert set(first) == {("(control)", names[1]), (names[0], names[2])}, first
        failed = first[(names[0], names[2])]
        assert failed["status"] == "failed" and f"the sender {names[0]} failed" in failed["error"], failed
        assert "Permission denied" in failed["error"], failed
        again = [(s["from"], s["to"], s["status"]) for s in body["rounds"][1]]
        assert again in ([("(control)", names[2], "staged")], [(names[1], names[2], "staged")]), again
        assert hosts[names[0]]["status"] == "current"
        for i in (1, 2):
            assert host_sums(lab_fleet, i, revision) == want
    finally:
        on(lab_fleet, 0, f"sudo rm -rf {REPO}")
        for i in range(len(names)):
            on(lab_fleet, i, f"sudo rm -rf {REPO}")
        for i in created:
            on(lab_fleet, i, "sudo userdel -r vllm")


def store_inventory(lab: LabFleet, path: Path, store: str, root: str, egress_mib_s: float | None = None) -> Path:
    """The lab's inventory with every host but ``store`` serving ``MODEL`` from ``model_source:
    {kind: store, host: store, path: root}``; the store host stays as it is (a host of the same
    inventory, reached with its own settings), with ``staging.egress_mib_s`` when given."""
    assert lab.opts.inventory is not None
    text = lab.opts.inventory.read_text()
    hosts = ast.literal_eval(text.split(f"\n{GROUP} = ", 1)[1])
    for name, data in hosts:
        if name != store:
            data["model"] = MODEL
            data["model_source"] = {"kind": "store", "host": store, "path": root}
        elif egress_mib_s is not None:
            data["staging"] = {"egress_mib_s": egress_mib_s}
    path.write_text(f"{GROUP} = {pprint.pformat(hosts, width=100, sort_dicts=False)}\n")
    return path


def dry_deploy(inventory: Path, host: str, xdg: Path) -> tuple[int, dict[str, Any], str]:
    """``fleet deploy --dry --json`` of ``host`` with this machine's cache in ``xdg`` (no copy of
    any model here but what the command itself reads)."""
    proc = subprocess.run(
        [str(FLEET), "deploy", str(inventory), "--dry", "--limit", host, "--json"], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, "XDG_CACHE_HOME": str(xdg)},
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, {}, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_store_host_sends_the_model_to_the_others_verified(lab_fleet: LabFleet, tmp_path: Path) -> None:
    """``model_source: {kind: store}`` (issue 22, part 1): the session lab's first host is the store.
    ``fleet deploy --dry`` plans from the store's config.json (read over the store's SSH, this
    machine holding no copy; issue 22 point 4), or names the store, path and model it lacks.
    Bad input is named before any host is changed; then the store's own manifest (computed there
    over SSH) is the one a ``dir`` source of the same files gives, the store sends each host its
    copy directly (through the staging port, as its login user), each copy verifies on its host;
    the store's own ``staging.egress_mib_s`` bounds what it sends in all (one copy at a time, each
    at the limit: the copies' send windows do not overlap and the bytes over their span keep to the
    limit); a copy damaged on a host is repaired from the store; ``--fanout`` roots its tree at the
    store, at the store's limit; a file changed on the store after its manifest was read is refused
    by the host's verify."""
    top = make_checkpoint(tmp_path / "src")
    want = sums_of(top)
    revision = build_manifest(str(tmp_path / "src"), MODEL).revision
    names = [h.name for h in lab_fleet.state.hosts]
    store = names[0]
    root = f"/srv/fleet-test-store-{os.getpid()}"
    inventory = store_inventory(lab_fleet, tmp_path / "inventory.py", store, root, egress_mib_s=LINK_MIB_S)
    limit = LINK_MIB_S * 1024 * 1024
    created = []
    try:
        created = service_users(lab_fleet)
        # bad input: each named, exit 2, before any host is changed
        rc, body, err = stage_body(inventory)
        said = json.dumps(body)
        assert rc == 2 and f"model_source: store {store}, path {root}: no such directory on {store}" in said, (
            said,
            err,
        )
        rc, _out, err = on(lab_fleet, 0, f"sudo install -d -o $(id -u) -m 0755 {root}")
        assert rc == 0, err
        rc, body, err = stage_body(inventory)
        assert rc == 2 and f"{MODEL} is not there" in json.dumps(body), (body, err)
        rc, body, err = dry_deploy(inventory, names[1], tmp_path / "xdg")
        lacks = f"model_source.host='{store}': store {store}, path {root}: {MODEL}: the model is not on the store"
        assert rc == 2 and lacks in json.dumps(body), (body, err)
        elsewhere = store_inventory(lab_fleet, tmp_path / "elsewhere.py", "no-such-store", root)
        rc, body, err = stage_body(elsewhere)
        said = json.dumps(body)
        assert rc == 2 and "model_source.host='no-such-store'" in said and "not in this inventory" in said, (said, err)
        for i in (1, 2):
            rc, out, _err = on(lab_fleet, i, f"sudo test -e {REPO} && echo there || echo absent")
            assert out.strip() == "absent", out

        h = lab_fleet.state.hosts[0]
        client = ssh.connect(h.address, lab_fleet.state.ssh_port, lab_fleet.dir.control_key, lab_fleet.dir.known_hosts)
        try:
            sftp = client.open_sftp()
            for d in (f"{root}/{MODEL.split('/')[0]}", f"{root}/{MODEL}"):
                sftp.mkdir(d)
            for rel in want:
                sftp.put(str(top / rel), f"{root}/{MODEL}/{rel}")
            sftp.close()
        finally:
            client.close()

        # the plan reads the store's planning files (and only those) into this machine's cache
        rc, body, err = dry_deploy(inventory, names[1], tmp_path / "xdg")
        assert rc == 0, (body, err)
        copies = [p for p in (tmp_path / "xdg").rglob("*") if p.is_file() and p.parent.name == MODEL.split("/")[1]]
        assert sorted(p.name for p in copies) == ["config.json", "model.safetensors.index.json",
                                                  "tokenizer_config.json"], copies  # fmt: skip
        assert all(p.read_bytes() == (top / p.name).read_bytes() for p in copies)
        for i in (1, 2):
            rc, out, _err = on(lab_fleet, i, f"sudo test -e {REPO} && echo there || echo absent")
            assert out.strip() == "absent", out  # a dry run stages nothing

        rc, hosts, err = stage(inventory)
        assert rc == 0, (hosts, err)
        assert sorted(hosts) == sorted(names[1:])  # the store stages nothing itself
        for i, name in enumerate(names):
            if i == 0:
                continue
            r = hosts[name]
            assert r["status"] == "staged" and r["sender"] == store and r["sent_files"] == len(want), r
            assert r["revision"] == revision, r  # the store's manifest is the one of the same files here
            assert host_sums(lab_fleet, i, revision) == want
            rc, out, err = on(lab_fleet, i, f"sudo cat {REPO}/refs/main; echo; sudo stat -c '%U %a' "
                              f"{REPO}/snapshots/{revision}/config.json; sudo ls -A {REPO}")  # fmt: skip
            assert rc == 0 and out.split() == [revision, "vllm", "644", "refs", "snapshots"], (out, err)
        # the store's total egress: its copies one after another, the bytes over their span within its limit
        windows = sorted((hosts[n]["send_window"], hosts[n]["sent_bytes"]) for n in names[1:])
        assert all(w[0][1] <= v[0][0] for w, v in itertools.pairwise(windows)), windows
        span = windows[-1][0][1] - windows[0][0][0]
        assert sum(b for _w, b in windows) / span <= limit * 1.05, windows
        rc, out, err = on(lab_fleet, 0, "ls ~/.cache/fleet/store-manifests/")
        assert rc == 0 and len(out.split()) == 1, (out, err)  # the store's hash cache

        snap = f"{REPO}/snapshots/{revision}"
        rc, _out, err = on(lab_fleet, 1, f"printf 'X' | sudo dd of={snap}/model-00001-of-00002.safetensors bs=1 "
                           "seek=5000 conv=notrunc status=none")  # fmt: skip
        assert rc == 0, err
        rc, hosts, err = stage(inventory, "--limit", names[1])
        fixed = hosts[names[1]]
        assert rc == 0 and fixed["status"] == "staged" and fixed["sender"] == store, (fixed, err)
        assert fixed["repaired"] == ["model-00001-of-00002.safetensors (corrupted)"], fixed
        assert host_sums(lab_fleet, 1, revision) == want

        for i in (1, 2):
            rc, _out, err = on(lab_fleet, i, f"sudo rm -rf {REPO}")
            assert rc == 0, err
        rc, body, err = stage_body(inventory, "--fanout")
        assert rc == 0 and body["ok"], (body, err)
        assert body["bounds"] == [{"model": MODEL, "revision": revision, "hosts": 2, "holders": 1, "rounds": 2}]
        assert [(s["from"], s["status"], s["rate_limit"]) for s in body["rounds"][0]] == [(store, "staged", limit)]
        for i in (1, 2):
            assert host_sums(lab_fleet, i, revision) == want

        # a shard changed on the store after its manifest was read (same size, other bytes): the host's
        # verify refuses the copy, refs/main is not written, the host is named
        loaded = load_inventory(str(inventory), [names[1]])
        jobs = jobs_for(loaded)
        known = manifests_for(jobs)
        rc, _out, err = on(lab_fleet, 0, f"printf 'Y' | dd of={root}/{MODEL}/model-00002-of-00002.safetensors bs=1 "
                           "seek=100 conv=notrunc status=none")  # fmt: skip
        assert rc == 0, err
        rc, _out, err = on(lab_fleet, 1, f"sudo rm -rf {REPO}")
        assert rc == 0, err
        late = stage_all(jobs, manifests=known)[names[1]]
        assert late.status == "failed" and late.sender == store, late
        assert "does not match the manifest: model-00002-of-00002.safetensors (corrupted)" in str(late.error), late
        rc, out, _err = on(lab_fleet, 1, f"sudo test -e {REPO}/refs/main && echo there || echo absent")
        assert out.strip() == "absent", out
    finally:
        on(lab_fleet, 0, f"sudo rm -rf {root}; rm -rf ~/.cache/fleet/store-manifests")
        for i in range(len(names)):
            on(lab_fleet, i, f"sudo rm -rf {REPO}")
        for i in created:
            on(lab_fleet, i, "sudo userdel -r vllm")
