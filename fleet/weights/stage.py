"""Stage a model on hosts: list each host's copy, send what is missing or damaged, verify, point.

Per host, over one SSH connection made the way every fleet connection is made
(``fleet.facts.sshlink.connect``: the inventory's key and user, host keys checked against its
``known_hosts``; no new login, nothing else to trust):

1. ``ModelCopy`` lists the snapshot ``<HF_HOME>/hub/models--ORG--NAME/snapshots/<revision>/``
   (sizes and SHA-256), ``refs/main``, the service user, the bytes free;
2. ``fleet.weights.verify`` decides: current (nothing to do), only ``refs/main`` to point, or
   files to send; a copy that does not fit is refused with the numbers before anything is sent;
3. the files are sent with paramiko's SFTP on that connection (its ``put`` pipelines its writes),
   to OpenSSH's ``sftp-server`` started as the service user (``sudo -n -u vllm``, on a session
   channel: no new login), into ``models--ORG--NAME/.fleet-incoming/`` (on the cache's
   filesystem) under numbered temporary names; then, as root, each is synced, given to the
   service user (mode 0644) and renamed to its place in the snapshot (a rename within one
   filesystem: a reader sees the old file or the complete new one, never half of one);
4. ``ModelCopy`` again: every file must now match the manifest, else the host fails, named, and
   ``refs/main`` is left as it was (a copy that does not verify is never served);
5. ``refs/main`` is written to a temporary name and renamed: from then on the units (which run
   with ``HF_HUB_OFFLINE=1`` and ``HF_HOME`` on that cache) load this snapshot.

SFTP rather than rsync: it runs on the connection fleet already holds (rsync would need an
``ssh`` subprocess given fleet's key, user and known_hosts, and rsync on every host), its
progress is a callback per chunk, and whether a file is right is decided by the manifest's
SHA-256, not by rsync's delta algorithm. The disk check and the verify are fleet's either way.

The while-copying connection is watched by ``Link.hold`` (heartbeat and watchdog): a host that
stops answering mid-copy is closed and reported within ``SILENT_S``, its current model intact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import paramiko
from pydantic import ValidationError

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.hub import hub_dir as hub_dir  # the one definition, re-exported
from fleet.facts.output import answer_line
from fleet.facts.sshlink import Link, SshError, SshTarget, Unreachable, connect
from fleet.inventory.schema import ADAPTER_CONFIG, StagingData, source_model_dir
from fleet.inventory.spec import HostSpec, LoadedInventory, ModelSource
from fleet.weights.copyfact import INCOMING, HostCopy, model_copy_command, parse_copy
from fleet.weights.manifest import Manifest, build_manifest, model_dir
from fleet.weights.mirror import Note, mirror_manifest
from fleet.weights.peer import Seed, SenderFailed, fleet_address, send_from_peer
from fleet.weights.store import store_manifest
from fleet.weights.verify import CopyVerdict, Rate, fmt_bytes, space_refusal, verdict

MIB = 1024 * 1024
#: How fast a host's ``python3`` hashes, for the listing's deadline (slower disks get the floor).
HASH_BYTES_PER_S = 100 * 1024 * 1024
LIST_FLOOR_S = 120.0

#: Root's part of a copy, as a script on the host (``python3 -c``; the job as JSON on stdin).
#: ``place``: sync each received file, give it to the service user, rename it into the snapshot,
#: remove the incoming directory. ``point``: ``refs/main`` names the snapshot (temporary + rename).
FINISH = r"""
import json, os, pwd, shutil, sys
job = json.load(sys.stdin)
pw = pwd.getpwnam(job["user"])
def own(path, mode):
    os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, mode)
def dirs(path):
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        os.mkdir(d)
        own(d, 0o755)
if sys.argv[1] == "place":
    for name, rel in job["moves"]:
        src = os.path.join(job["incoming"], name)
        dst = os.path.join(job["snapshot"], rel)
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs(os.path.dirname(dst))
        own(src, 0o644)
        os.rename(src, dst)
    shutil.rmtree(job["incoming"], ignore_errors=True)
else:
    refs = os.path.join(job["repo"], "refs")
    dirs(refs)
    tmp = os.path.join(refs, ".main.fleet-tmp")
    with open(tmp, "w") as f:
        f.write(job["revision"])
        f.flush()
        os.fsync(f.fileno())
    own(tmp, 0o644)
    os.rename(tmp, os.path.join(refs, "main"))
"""


def repo_dir(state_dir: str, model: str) -> str:
    """``huggingface_hub``'s cache folder of a model repository: ``models--ORG--NAME``."""
    return f"{hub_dir(state_dir)}/models--{model.replace('/', '--')}"


@dataclass(frozen=True)
class StageJob:
    """One host to stage: how to reach it, the model, and the source directory holding it.

    A LoRA adapter (``lora_adapters``) is staged the same way, as the repository ``fleet-lora/NAME``
    (``fleet.inventory.spec.LORA_REPO_ORG``) whose files are the adapter's own directory."""

    target: SshTarget
    model: str
    source: str  #: the ``dir`` source's root (``model_source.path``), or the adapter's directory
    directory: str = ""  #: the files' directory when it is not ``source/ORG/NAME`` (an adapter's)
    marker: str = "config.json"  #: the file the source directory must hold
    #: ``fleet stage --fanout``: another host sends the files (None: this machine, over SFTP)
    seed: Seed | None = None
    rate: float | None = None  #: this machine's egress limit when it sends, bytes per second
    probe: bool = False  #: list and check only: a copy that needs files ends ``waiting``, nothing sent
    #: a ``hub`` source: its files are fetched and checked into ``source`` first (``fleet.weights.mirror``)
    hub: ModelSource | None = None
    #: a ``store`` source (``fleet.weights.store``): the store host sends the files (its ``rate``
    #: is this job's ``rate``); ``source`` is then ``STORE:PATH`` (the store's name and its
    #: directory), so a store's (source, model) is never taken for a ``dir`` source's of the same path
    store: Seed | None = None

    @property
    def files(self) -> str:
        if self.store is not None:
            return self.store.snapshot  # on the store host
        return self.directory or str(model_dir(self.source, self.model))


@dataclass
class StageResult:
    host: str
    model: str
    #: current (already verified and pointed), staged (sent and/or pointed now), refused (not
    #: started: no room, no service user), failed (mid-way: its current model untouched), unreachable
    status: str
    revision: str = ""
    sent_files: int = 0
    sent_bytes: int = 0
    repaired: list[str] = field(default_factory=list)  #: files that were there but wrong
    seconds: float = 0.0
    error: str | None = None
    sender: str | None = None  #: the host that sent the files (None: this machine)
    sender_fault: bool = False  #: failed because its sender stopped mid-copy (another may try)
    #: when the files were sent (wall-clock seconds, first byte to last), for measuring a sender's egress
    window: tuple[float, float] | None = None
    commit: str | None = None  #: a ``hub`` source: the mirror's commit the files are of

    @property
    def ok(self) -> bool:
        return self.status in ("current", "staged")

    def data(self) -> dict[str, Any]:
        rate = Rate(self.sent_bytes, self.sent_bytes, self.seconds).per_second
        return {
            "host": self.host, "model": self.model, "status": self.status, "revision": self.revision,
            "sent_files": self.sent_files, "sent_bytes": self.sent_bytes, "repaired": self.repaired,
            "seconds": round(self.seconds, 3), "bytes_per_s": round(rate) if rate else None, "error": self.error,
            "sender": self.sender, "commit": self.commit,
            "send_window": [round(t, 3) for t in self.window] if self.window else None,
        }  # fmt: skip


#: ``progress(host, what, done_bytes, total_bytes)``: ``what`` is ``listing``, ``sending``,
#: ``verifying``, or a final status; called from the staging threads.
Progress = Callable[[str, str, int, int], None]


def manifests_for(
    jobs: Sequence[StageJob], hashed: list[str] | None = None, note: Note = lambda _t: None, *, fetch: bool = True
) -> dict[tuple[str, str], Manifest]:
    """One manifest per (source, model), computed before any host is touched; ``FleetError``
    (naming the source and the file) when one cannot be read. A ``hub`` source's files are
    fetched here and checked against the mirror's metadata (``fleet.weights.mirror``; ``note``
    tells what is fetched; ``fetch=False``, a dry run: its weights are left on the mirror)."""
    out: dict[tuple[str, str], Manifest] = {}
    for job in jobs:
        key = (job.source, job.model)
        if key in out:
            continue
        if job.store is not None:
            root = job.source.partition(":")[2]  # STORE:PATH (a host name has no ':')
            out[key] = store_manifest(job.store.sender, root, job.store.snapshot, job.model, job.marker)
        elif job.hub is not None:
            out[key] = mirror_manifest(job.hub, job.model, hashed, note, fetch=fetch)
        else:
            out[key] = build_manifest(job.source, job.model, hashed, directory=job.directory, marker=job.marker)
    return out


def stage(
    jobs: Sequence[StageJob],
    *,
    user: str = "vllm",
    state_dir: str = "/var/lib/vllm",
    parallel: int = 4,
    progress: Progress = lambda _h, _w, _d, _t: None,
    manifests: Mapping[tuple[str, str], Manifest] | None = None,
) -> dict[str, StageResult]:
    """Stage every job's model on its host, ``parallel`` hosts at a time: ``{host: result}``."""
    known = dict(manifests) if manifests is not None else manifests_for(jobs)
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(jobs) or 1))) as pool:
        futures = {
            j.target.name: pool.submit(_stage_one, j, known[(j.source, j.model)], user, state_dir, progress)
            for j in jobs
        }
        return {name: f.result() for name, f in futures.items()}


def _list(link: Link, repo: str, manifest: Manifest, user: str) -> HostCopy:
    timeout = max(LIST_FLOOR_S, manifest.total_bytes / HASH_BYTES_PER_S * 1.5)
    rc, out, err = link.run(model_copy_command(repo, manifest.revision, user), timeout, label="listing the model copy")
    if rc != 0:
        raise FleetError(f"listing the model copy exited {rc}: {err.strip()[-300:]}")
    return parse_copy(answer_line(out.splitlines()))


def _root(link: Link, mode: str, job: dict[str, Any], timeout: float) -> None:
    command = ssh_command(["sudo", "-n", "--", "python3", "-c", FINISH, mode])
    rc, _out, err = link.run(command, timeout, json.dumps(job).encode(), label=f"{mode} (as root)")
    if rc != 0:
        raise FleetError(f"{mode} (as root) exited {rc}: {err.strip()[-300:]}")


def _stage_one(job: StageJob, manifest: Manifest, user: str, state_dir: str, progress: Progress) -> StageResult:
    name, t0 = job.target.name, time.monotonic()
    result = StageResult(name, job.model, "failed", manifest.revision, commit=manifest.commit)
    try:
        client = connect(job.target)
    except SshError as exc:
        result.status, result.error = "unreachable", exc.reason
        progress(name, result.status, 0, 0)
        return result
    link = Link(name, client)
    try:
        _copy(link, client, job, manifest, user, state_dir, progress, result)
    except SenderFailed as exc:
        result.status, result.sender_fault = "failed", True
        result.error = f"{exc}; its current model is untouched (refs/main not changed)"
    except SshError as exc:
        result.status = "unreachable" if isinstance(exc, Unreachable) else "failed"
        result.error = f"{exc.reason}; its current model is untouched (refs/main not changed)"
    except (FleetError, paramiko.SSHException, OSError, EOFError) as exc:
        result.status = "failed"
        result.error = f"{exc or type(exc).__name__}; its current model is untouched (refs/main not changed)"
    finally:
        link.close()
        result.seconds = time.monotonic() - t0
    progress(name, result.status, result.sent_bytes, result.sent_bytes)
    return result


def _copy(
    link: Link,
    client: paramiko.SSHClient,
    job: StageJob,
    manifest: Manifest,
    user: str,
    state_dir: str,
    progress: Progress,
    result: StageResult,
) -> None:
    name, repo = job.target.name, repo_dir(state_dir, job.model)
    snapshot = f"{repo}/snapshots/{manifest.revision}"
    progress(name, "listing", 0, manifest.total_bytes)
    have = _list(link, repo, manifest, user)
    before = verdict(manifest, have.files, have.refs_main)
    if before.current:
        result.status = "current"
        return
    if not have.user_exists:
        result.status = "refused"
        result.error = (
            f"the service user {user} does not exist on the host: `fleet deploy` creates it; nothing was sent"
        )
        return
    if (why := space_refusal(before.bytes_to_send, have.free, have.where)) is not None:
        result.status, result.error = "refused", why
        return
    if job.probe and before.to_send:
        result.status = "waiting"
        return
    result.repaired = before.damaged()
    if before.to_send:
        _send(link, client, job, manifest, before, repo, snapshot, user, progress, result)
        progress(name, "verifying", result.sent_bytes, before.bytes_to_send)
        after = _list(link, repo, manifest, user)
        check = verdict(manifest, after.files, after.refs_main)
        if not check.complete:
            wrong = [f"{f.path} ({s.value})" for f, s in check.states if s.resend]
            raise FleetError("after the copy the snapshot still does not match the manifest: " + ", ".join(wrong[:10]))
    _root(link, "point", {"repo": repo, "revision": manifest.revision, "user": user}, 60)
    result.status = "staged"


def _send(
    link: Link,
    client: paramiko.SSHClient,
    job: StageJob,
    manifest: Manifest,
    before: CopyVerdict,
    repo: str,
    snapshot: str,
    user: str,
    progress: Progress,
    result: StageResult,
) -> None:
    name, incoming = job.target.name, f"{repo}/{INCOMING}"
    total = before.bytes_to_send
    as_user = ["sudo", "-n", "-u", user, "--"]
    prepare = " && ".join([
        ssh_command([*as_user, "mkdir", "-p", "--", f"{repo}/snapshots"]),
        ssh_command(["sudo", "-n", "--", "rm", "-rf", "--", incoming]),
        ssh_command([*as_user, "mkdir", "-m", "0700", "--", incoming]),
    ])  # fmt: skip
    rc, _out, err = link.run(prepare, 60, label="preparing the incoming directory")
    if rc != 0:
        raise FleetError(f"preparing {incoming} exited {rc}: {err.strip()[-300:]}")
    moves: list[tuple[str, str]] = [(f"{n:06d}.partial", f.path) for n, f in enumerate(before.to_send)]
    seed = job.seed
    if seed is None and job.store is not None:  # the store's own limit, unless the fan-out gives one
        seed = job.store if job.rate is None else replace(job.store, rate=job.rate)
    if seed is not None:
        result.sender = seed.sender.name
        sizes = [(tmp, rel, f.size) for (tmp, rel), f in zip(moves, before.to_send, strict=True)]
        watch = link.hold(math.inf)
        turn = store_turn(seed.sender.name) if job.seed is None and seed.rate else None
        held: contextlib.AbstractContextManager[None] = turn if turn is not None else contextlib.nullcontext()
        try:
            if turn is not None and turn.busy():
                progress(name, f"waiting for {seed.sender.name} (it sends one copy at a time at its egress limit)",
                         0, total)  # fmt: skip
            with held:
                start = time.time()
                result.sent_bytes = send_from_peer(
                    client, seed, sizes, incoming, user, lambda done: progress(name, "sending", done, total)
                )
                result.window = (start, time.time())
        finally:
            link.release(watch)
        result.sent_files = len(moves)
        _root(link, "place", {"incoming": incoming, "snapshot": snapshot, "moves": moves, "user": user}, 600)
        return
    source = Path(job.files)
    pace = _Pace(job.rate)
    watch = link.hold(math.inf)  # a host that goes silent mid-copy is closed, not waited on
    sftp = _sftp_as(client, user)
    start = time.time()
    try:
        for (tmp, _rel), f in zip(moves, before.to_send, strict=True):
            done_before = result.sent_bytes

            def sent(done: int, _size: int, base: int = done_before) -> None:
                pace.wait(base + done)
                progress(name, "sending", base + done, total)

            sftp.put(str(source / f.path), f"{incoming}/{tmp}", callback=sent, confirm=True)
            result.sent_bytes += f.size
            result.sent_files += 1
        result.window = (start, time.time())
    finally:
        sftp.close()
        link.release(watch)
    _root(link, "place", {"incoming": incoming, "snapshot": snapshot, "moves": moves, "user": user}, 600)


class _Turn:
    """One store host's turn to send: its copies to several hosts at once would add up past its
    egress limit (``staging.egress_mib_s``, the most it sends in all), so with a limit it sends one
    copy at a time, each at the whole limit (the hosts' listing, checks and verify still run in
    parallel; the total time is the same as sharing the limit, and the first hosts are done sooner)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def busy(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        self._lock.release()


_turns: dict[str, _Turn] = {}
_turns_lock = threading.Lock()


def store_turn(store: str) -> _Turn:
    """The turn of the store host ``store``, shared by every copy this process makes from it."""
    with _turns_lock:
        return _turns.setdefault(store, _Turn())


class _Pace:
    """This machine's egress limit for an SFTP copy: a token bucket one write deep (paramiko calls
    ``put``'s callback after each write; sleeping there holds the next one back)."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.start = rate, time.monotonic()

    def wait(self, sent: int) -> None:
        if self.rate:
            ahead = sent / self.rate - (time.monotonic() - self.start)
            if ahead > 0:
                time.sleep(ahead)


#: Where OpenSSH's SFTP server lives: Debian/Ubuntu, RHEL/Fedora, Arch/SUSE.
SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/lib/ssh/sftp-server")


def sftp_server_command(user: str) -> str:
    """OpenSSH's ``sftp-server`` run as ``user`` (through ``sudo -n``) on a session channel: the
    files arrive owned by the service user, under its home (which the login user may not even
    enter: useradd makes homes 0700), on the connection fleet already holds."""
    tries = "; ".join(
        f"{ssh_command(['test', '-x', p])} && exec {ssh_command(['sudo', '-n', '-u', user, '--', p])}"
        for p in SFTP_SERVERS
    )
    return f"{tries}; echo 'no sftp-server in {' '.join(SFTP_SERVERS)}' >&2; exit 127"


def _sftp_as(client: paramiko.SSHClient, user: str) -> paramiko.SFTPClient:
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise FleetError("the connection closed before the copy")
    chan = transport.open_session(timeout=30)
    chan.exec_command(sftp_server_command(user))
    try:
        return paramiko.SFTPClient(chan)
    except (paramiko.SSHException, EOFError) as exc:
        why = chan.recv_stderr(4096).decode(errors="replace").strip() if chan.recv_stderr_ready() else ""
        raise FleetError(f"could not start sftp-server as {user} ({why or exc}): sudo -n -u {user} must work") from None


def _commit(r: StageResult) -> str:
    return f" (mirror commit {r.commit[:12]})" if r.commit else ""


def describe(r: StageResult) -> str:
    """One line for people."""
    if r.status == "current":
        return f"{r.model} @ {r.revision[:12]}{_commit(r)}: already verified"
    if r.status == "staged":
        rate = Rate(r.sent_bytes, r.sent_bytes, r.seconds).per_second
        sent = f"sent {r.sent_files} file(s), {fmt_bytes(r.sent_bytes)}" if r.sent_files else "nothing to send"
        speed = f" at {fmt_bytes(rate)}/s" if rate else ""
        fixed = f"; replaced {', '.join(r.repaired)}" if r.repaired else ""
        return f"{r.model} @ {r.revision[:12]}{_commit(r)}: {sent}{speed} in {r.seconds:.1f} s, verified{fixed}"
    return f"{r.model}: {r.status}: {r.error}"


def draft_in_source(spec: HostSpec) -> str | None:
    """The ``speculative`` draft model (or EAGLE head) to stage with the host's model: named by id
    and held by the host's ``model_source``: a ``dir`` source's ``ORG/NAME/``; from a ``hub``
    mirror or a ``store`` host when the draft has no ``model_config`` of its own (the planning
    commands have then read its config from there: ``fleet.inventory.spec.from_source``; the
    manifest says whether the source holds it, before any host is touched). A draft given as a
    path, or one the source does not hold (its ``model_config`` given elsewhere), is left to the
    operator as before; the preflight still checks the host's cache."""
    sp, source = spec.speculative, spec.model_source
    if sp is None or sp.model is None or source is None or sp.model.startswith("/"):
        return None
    if source.kind != "dir":
        return sp.model if sp.model_config == source.planning_dir(sp.model) else None
    return sp.model if os.path.isdir(source_model_dir(source.path, sp.model)) else None


def jobs_for(loaded: LoadedInventory, names: Sequence[str] | None = None) -> list[StageJob]:
    """A job for every selected host (or each of ``names``) whose inventory names a ``model_source``
    (its model, then its speculative draft when the source holds it), and one for each of its LoRA
    adapters (``lora_adapters``), after its model's."""
    out = []
    for spec in loaded.hosts:
        if (spec.model_source is None and spec.lora is None) or (names is not None and spec.name not in names):
            continue
        data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
        target = SshTarget.from_data(spec.name, data)
        if spec.model_source is not None:
            hub = spec.model_source if spec.model_source.kind == "hub" else None
            store_host = spec.model_source.host if spec.model_source.kind == "store" else None
            staged: list[str] = []  # a host with models: each entry's model and draft, each once
            for m in spec.model_specs:
                for repo in (m.model, draft_in_source(m)):
                    if repo is not None and repo not in staged and not repo.startswith("/"):
                        staged.append(repo)
                        root = spec.model_source.path
                        store = _store_seed(loaded, store_host, root, repo, spec, target) if store_host else None
                        source = f"{store_host}:{root}" if store_host else root  # (see StageJob.store)
                        out.append(StageJob(target, repo, source, hub=hub, store=store))
        for a in spec.lora.adapters if spec.lora is not None else ():
            out.append(StageJob(target, a.repo, a.path, directory=a.path, marker=ADAPTER_CONFIG))
    return out


def _store_seed(loaded: LoadedInventory, store: str, root: str, model: str, spec: HostSpec, target: SshTarget) -> Seed:
    """The store host as the sender of ``model`` to ``target`` (``spec``'s host; ``fleet.weights.store``):
    it sends from ``ROOT/ORG/NAME`` as its login user to the host's staging port."""
    data = loaded.pyinfra.get_host(store).data.dict()  # type: ignore[no-untyped-call]
    sender = SshTarget.from_data(store, data)
    return Seed(
        sender, fleet_address(sender), fleet_address(target), spec.staging.port, store_egress(loaded, store, data),
        str(model_dir(root, model)), as_login=True,
    )  # fmt: skip


def store_egress(loaded: LoadedInventory, store: str, data: Mapping[str, Any]) -> float | None:
    """The most the store host ``store`` sends in all, bytes/s: its own ``staging.egress_mib_s``
    (None: not set). A store left out by ``--limit`` (or one that serves nothing) has its
    ``staging`` read from its inventory ``data`` here, with the one validator's model; a bad value
    is a ``FleetError`` naming the store and the field, before any host is touched."""
    for spec in loaded.hosts:
        if spec.name == store:
            mib = spec.staging.egress_mib_s
            return mib * MIB if mib is not None else None
    raw = data.get("staging")
    if raw is None:
        return None
    try:
        mib = StagingData.model_validate(raw).egress_mib_s
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("staging", *first["loc"]))
        raise FleetError(
            f"{loaded.path}: host {store} (a model_source store): {where}={first.get('input')!r}: {first['msg']}; "
            "staging.egress_mib_s is the most MiB/s the store sends in all (a number above 0)"
        ) from None
    return mib * MIB if mib is not None else None


#: How bad each status is, when one host's model and adapters are told as one result.
_WORST = ("current", "staged", "refused", "failed", "unreachable")


def merge(results: Sequence[StageResult]) -> StageResult:
    """One host's results (its model, then each adapter) as one: the worst status, every error."""
    first = results[0]
    if len(results) == 1:
        return first
    worst = max(results, key=lambda r: _WORST.index(r.status) if r.status in _WORST else len(_WORST))
    errors = [f"{r.model}: {r.error}" for r in results if r.error]
    return StageResult(
        first.host,
        ", ".join(r.model for r in results),
        worst.status,
        first.revision,
        sum(r.sent_files for r in results),
        sum(r.sent_bytes for r in results),
        [f"{r.model}/{p}" for r in results for p in r.repaired],
        sum(r.seconds for r in results),
        "; ".join(errors) or None,
        window=first.window,
        commit=first.commit,
    )


def stage_all(
    jobs: Sequence[StageJob],
    *,
    parallel: int = 4,
    progress: Progress = lambda _h, _w, _d, _t: None,
    manifests: Mapping[tuple[str, str], Manifest] | None = None,
) -> dict[str, StageResult]:
    """``stage`` for jobs of which a host may have several (its model and its adapters): in rounds
    of one job per host, a host's later jobs only after its earlier ones succeeded; ``{host: merged}``."""
    queues: dict[str, list[StageJob]] = {}
    for j in jobs:
        queues.setdefault(j.target.name, []).append(j)
    done: dict[str, list[StageResult]] = {h: [] for h in queues}
    while True:
        round_ = [q[len(done[h])] for h, q in queues.items() if len(done[h]) < len(q) and all(r.ok for r in done[h])]
        if not round_:
            break
        for host, result in stage(round_, parallel=parallel, progress=progress, manifests=manifests).items():
            done[host].append(result)
    return {h: merge(rs) for h, rs in done.items()}
