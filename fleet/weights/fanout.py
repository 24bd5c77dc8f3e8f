"""``fleet stage --fanout``: the model copied in a tree, hosts that hold it seeding the next ones.

1. Every host's copy is listed and checked first (``StageJob.probe``: the same listing, service
   user and disk checks as a plain stage; a complete copy is pointed at and holds from the start;
   a refused or unreachable host is named and left out);
2. the rounds (``fleet.weights.tree``): the control machine and every holder send to at most one
   host each, at most ``staging.concurrency`` at once, each sender at its own
   ``staging.egress_mib_s``; the control machine sends over SFTP as ``fleet stage`` does, a host
   directly to another (``fleet.weights.peer``); for a ``store`` source the store host takes the
   control machine's place at the root (it sends directly too, ``fleet.weights.store``); each
   receiver verifies its copy against the manifest before it is renamed into place and
   ``refs/main`` moves, and holds from the next round;
3. a sender that fails mid-copy keeps serving (nothing of its own changed) and is named; its
   receiver gets another sender next round; a receiver that fails is named.

One tree per (source, model): hosts serving different models fan out separately, in turn.
LoRA adapters (small) are staged from this machine afterwards (``stage_all``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from fleet.inventory.schema import StagingData
from fleet.weights.manifest import Manifest
from fleet.weights.peer import Seed, fleet_address
from fleet.weights.stage import MIB as MIB
from fleet.weights.stage import Progress, StageJob, StageResult, merge, repo_dir, stage, stage_all
from fleet.weights.tree import SOURCE, Outcome, Send, advance, bound, next_round, start


@dataclass
class FanOut:
    """What a fan-out did: each host's result and every round's copies (for ``--json``)."""

    results: dict[str, StageResult]
    rounds: list[list[dict[str, Any]]] = field(default_factory=list)
    #: ⌈log₂(n+1)⌉ for the n hosts that needed the model, per (source, model), from its holders
    bounds: list[dict[str, Any]] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  #: senders that failed mid-copy (still serving)


def fan_out(
    jobs: Sequence[StageJob],
    staging: Mapping[str, StagingData],
    manifests: Mapping[tuple[str, str], Manifest],
    *,
    source_egress: float | None,
    concurrency: int,
    progress: Progress = lambda _h, _w, _d, _t: None,
    user: str = "vllm",
    state_dir: str = "/var/lib/vllm",
) -> FanOut:
    """Stage ``jobs`` in trees (see the module docstring). ``staging``: each host's ``staging``
    settings; ``source_egress``: this machine's egress limit (bytes/s, None: none)."""
    models = [j for j in jobs if not j.directory]
    adapters = [j for j in jobs if j.directory]
    out = FanOut({})
    groups: dict[tuple[str, str], list[StageJob]] = {}
    for j in models:
        groups.setdefault((j.source, j.model), []).append(j)
    for key, group in groups.items():
        _tree(group, manifests[key], staging, source_egress, concurrency, progress, user, state_dir, out)
    if adapters:
        ready = [j for j in adapters if j.target.name not in out.results or out.results[j.target.name].ok]
        later = stage_all(ready, parallel=concurrency, progress=progress, manifests=manifests)
        for host, r in later.items():
            out.results[host] = merge([out.results[host], r]) if host in out.results else r
    return out


def _tree(
    group: Sequence[StageJob],
    manifest: Manifest,
    staging: Mapping[str, StagingData],
    source_egress: float | None,
    concurrency: int,
    progress: Progress,
    user: str,
    state_dir: str,
    out: FanOut,
) -> None:
    by_name = {j.target.name: j for j in group}
    known = {(j.source, j.model): manifest for j in group}
    probed = stage([replace(j, probe=True) for j in group], user=user, state_dir=state_dir,
                   parallel=concurrency, progress=progress, manifests=known)  # fmt: skip
    holders = [SOURCE] + [h for h, r in probed.items() if r.ok]
    waiting = [h for h, r in probed.items() if r.status == "waiting"]
    #: this tree's result per host (a retried receiver's last try); merged into ``out`` at the end, so a
    #: host with two trees (its model and its speculative draft) is told the worse of the two
    mine: dict[str, StageResult] = {h: r for h, r in probed.items() if r.status != "waiting"}
    out.bounds.append({
        "model": manifest.model, "revision": manifest.revision, "hosts": len(waiting),
        "holders": len(holders), "rounds": bound(len(waiting), len(holders)),
    })  # fmt: skip
    addresses = {h: fleet_address(by_name[h].target) for h in by_name}
    #: the root's limit: a store host's own (``staging.egress_mib_s`` in its entry), else this machine's
    own = group[0].store.rate if group[0].store is not None else None
    egress: dict[str, float | None] = {SOURCE: own if own is not None else source_egress}
    for h in by_name:
        mib = staging[h].egress_mib_s
        egress[h] = mib * MIB if mib is not None else None
    repo = repo_dir(state_dir, manifest.model)
    #: who sends for the root: this machine, or a ``store`` source's host (``fleet.weights.store``)
    root = group[0].store.sender.name if group[0].store is not None else SOURCE
    state = start(holders, waiting)
    while not state.finished:
        sends = next_round(state.holders, state.waiting, concurrency=concurrency, egress=egress)
        for s in sends:
            sender = root if s.sender == SOURCE else s.sender
            progress(s.receiver, f"round {len(out.rounds) + 1}: from {sender}", 0, manifest.total_bytes)

        def one(s: Send) -> StageResult:
            job = by_name[s.receiver]
            if s.sender == SOURCE:
                return stage([replace(job, rate=s.rate)], user=user, state_dir=state_dir, progress=progress,
                             manifests=known)[s.receiver]  # fmt: skip
            seed = Seed(
                by_name[s.sender].target, addresses[s.sender], addresses[s.receiver], staging[s.receiver].port,
                s.rate, f"{repo}/snapshots/{manifest.revision}",
            )  # fmt: skip
            return stage([replace(job, seed=seed)], user=user, state_dir=state_dir, progress=progress,
                         manifests=known)[s.receiver]  # fmt: skip

        with ThreadPoolExecutor(max_workers=len(sends)) as pool:
            results = dict(zip([s.receiver for s in sends], pool.map(one, sends), strict=True))
        outcomes = {}
        for s in sends:
            r = results[s.receiver]
            outcomes[s.receiver] = (
                Outcome.OK if r.ok else Outcome.SENDER_FAILED if r.sender_fault else Outcome.RECEIVER_FAILED
            )
            mine[s.receiver] = r
        out.rounds.append([
            {"from": root if s.sender == SOURCE else s.sender, "to": s.receiver,
             "status": results[s.receiver].status,
             "sent_bytes": results[s.receiver].sent_bytes, "seconds": round(results[s.receiver].seconds, 3),
             "rate_limit": s.rate, "error": results[s.receiver].error}
            for s in sends
        ])  # fmt: skip
        state = advance(state, sends, outcomes)
    for h in state.waiting + tuple(h for h in state.failed if h not in mine):
        mine[h] = StageResult(h, manifest.model, "failed", manifest.revision,
                              error="no host holding a verified copy was left to send it")  # fmt: skip
    for h, r in mine.items():
        out.results[h] = merge([out.results[h], r]) if h in out.results else r
    out.broken += [b for b in state.broken if b != SOURCE]
