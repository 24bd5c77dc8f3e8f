"""The deploy's staging phase: each host's model (``model_source``) copied and verified before
anything restarts (``fleet.weights.stage``), so a rolling restart costs load time only and no
unit ever starts on a partial copy. Hosts whose ``staging.fanout`` is set get it in a tree, from
the hosts that already hold it (``fleet.weights.fanout``, as ``fleet stage --fanout``). Hosts
without ``model_source`` are left as before (the preflight checks their cache)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.inventory.schema import StagingData
from fleet.inventory.spec import LoadedInventory
from fleet.weights.fanout import MIB, fan_out
from fleet.weights.manifest import Manifest
from fleet.weights.stage import StageJob, StageResult, jobs_for, manifests_for, stage_all
from fleet.weights.verify import fmt_bytes


def manifests(
    loaded: LoadedInventory, *, fetch: bool = True, note: Callable[[str], None] = lambda _t: None
) -> dict[tuple[str, str], Manifest]:
    """Every selected host's model manifest, read before any host is touched (``FleetError``
    naming the source and file when one cannot be read). ``fetch=False`` (a dry run): a ``hub``
    source's weights are not downloaded, its manifest is the mirror's metadata. ``note``: a line
    per file a ``hub`` source downloads (as ``fleet stage`` prints them)."""
    return manifests_for(jobs_for(loaded), note=note, fetch=fetch)


def weights_data(known: Mapping[tuple[str, str], Manifest]) -> list[dict[str, Any]]:
    """The snapshots a deploy stages, for its ``--json`` (``weights``): each model's snapshot
    revision, size, and the mirror's resolved commit for a ``hub`` source (None otherwise)."""
    return [
        {"model": m.model, "source": source, "revision": m.revision, "commit": m.commit, "bytes": m.total_bytes}
        for (source, _model), m in known.items()
    ]


def weights_by_host(
    loaded: LoadedInventory, known: Mapping[tuple[str, str], Manifest]
) -> dict[str, tuple[tuple[str, str], ...]]:
    """Per host, the (model id, snapshot revision) of everything staged for it (model, draft,
    adapters), for its env files (``fleet.render.units.env_file``): new files under the same name
    are a new snapshot, so a new configuration revision, rolled out behind the gates."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for job in jobs_for(loaded):
        manifest = known.get((job.source, job.model))
        if manifest is not None:
            out[job.target.name] = (*out.get(job.target.name, ()), (job.model, manifest.revision))
    return out


@dataclass
class Staged:
    """What the staging phase did: each host's result, and the fan-out's rounds and bounds (the
    ``fleet stage --fanout --json`` keys) when hosts asked for it (``staging.fanout``)."""

    results: dict[str, StageResult] = field(default_factory=dict)
    fanout: dict[str, Any] | None = None


def fanout_limits(staging: Iterable[StagingData], parallel: int | None = None) -> tuple[float | None, int]:
    """The fan-out's limits from the hosts' ``staging`` settings: this machine sends at the smallest
    ``egress_mib_s`` of them (bytes/s; None: none set), and at most the smallest ``concurrency``
    (and ``parallel``) copies run at once."""
    settings = list(staging)
    limits = [s.egress_mib_s for s in settings if s.egress_mib_s is not None]
    concurrency = min([*([parallel] if parallel else []), *(s.concurrency for s in settings)], default=parallel or 1)
    return (min(limits) * MIB if limits else None), concurrency


def split_fanout(jobs: Sequence[StageJob], staging: Mapping[str, StagingData]) -> tuple[list[StageJob], list[StageJob]]:
    """``jobs`` as (those fanned out: their host's ``staging.fanout``, those sent from here)."""
    tree = [j for j in jobs if staging[j.target.name].fanout]
    return tree, [j for j in jobs if not staging[j.target.name].fanout]


def stage_hosts(
    loaded: LoadedInventory,
    names: Sequence[str],
    known: Mapping[tuple[str, str], Manifest],
    progress: Callable[[str], None],
    step: Callable[[str, str], None],
) -> Staged:
    """Stage the model on ``names`` (those with a ``model_source``): from this machine to each host,
    or, for hosts whose ``staging.fanout`` is set, in a tree (``fleet.weights.fanout.fan_out``)."""
    jobs = jobs_for(loaded, names)
    if not jobs:
        return Staged()
    staging = {s.name: s.staging for s in loaded.hosts}
    tree, direct = split_fanout(jobs, staging)
    hosts = len({j.target.name for j in jobs})
    how = f", {len({j.target.name for j in tree})} of them in a tree (staging.fanout)" if tree else ""
    progress(f"staging the model (and LoRA adapters) on {hosts} host(s){how}")
    shown: dict[str, str] = {}

    def moved(host: str, what: str, done: int, total: int) -> None:
        text = f"weights: {what}" + (f" {fmt_bytes(total)}" if what == "sending" else "")
        if shown.get(host) != text:  # one line per change, not per chunk
            shown[host] = text
            step(host, text)

    out = Staged()
    if tree:
        source_egress, concurrency = fanout_limits(staging[j.target.name] for j in tree)
        fan = fan_out(tree, staging, known, source_egress=source_egress, concurrency=concurrency, progress=moved)
        out.results.update(fan.results)
        out.fanout = {"rounds": fan.rounds, "bounds": fan.bounds, "broken_senders": fan.broken}
    if direct:
        out.results.update(stage_all(direct, progress=moved, manifests=known))
    return out
