"""The deploy's staging phase: each host's model (``model_source``) copied and verified before
anything restarts (``fleet.weights.stage``), so a rolling restart costs load time only and no
unit ever starts on a partial copy. Hosts without ``model_source`` are left as before (the
preflight checks their cache)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fleet.inventory.spec import LoadedInventory
from fleet.weights.manifest import Manifest
from fleet.weights.stage import StageResult, jobs_for, manifests_for, stage_all
from fleet.weights.verify import fmt_bytes


def manifests(loaded: LoadedInventory) -> dict[tuple[str, str], Manifest]:
    """Every selected host's model manifest, read before any host is touched (``FleetError``
    naming the source and file when one cannot be read)."""
    return manifests_for(jobs_for(loaded))


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


def stage_hosts(
    loaded: LoadedInventory,
    names: Sequence[str],
    known: Mapping[tuple[str, str], Manifest],
    progress: Callable[[str], None],
    step: Callable[[str, str], None],
) -> dict[str, StageResult]:
    """Stage the model on ``names`` (those with a ``model_source``): ``{host: result}``."""
    jobs = jobs_for(loaded, names)
    if not jobs:
        return {}
    progress(f"staging the model (and LoRA adapters) on {len({j.target.name for j in jobs})} host(s)")
    shown: dict[str, str] = {}

    def moved(host: str, what: str, done: int, total: int) -> None:
        text = f"weights: {what}" + (f" {fmt_bytes(total)}" if what == "sending" else "")
        if shown.get(host) != text:  # one line per change, not per chunk
            shown[host] = text
            step(host, text)

    return stage_all(jobs, progress=moved, manifests=known)
