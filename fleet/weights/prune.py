"""Pruning models a host no longer needs (issue 22, part 2): decided here, pure, from one listing.

A host's units read models from the Hugging Face cache ``<HF_HOME>/hub/models--ORG--NAME/``
(``huggingface_hub``'s ``repo_folder_name``: the id's ``/`` become ``--``). A repository there is
kept when any of these names it, and pruned otherwise:

* the inventory plans it on that host: its ``model``, the ``speculative`` draft model, each LoRA
  adapter (``fleet-lora/NAME``);
* a unit file or env file fleet keeps on the host: the live ``fleet-*.service`` units and every
  stored configuration revision (``/etc/fleet/revisions/<instance>/<id>/``), which a rollback puts
  back, so a model a rollback would serve again is never removed under it;
* a copy is being staged into it (its ``.fleet-incoming`` directory exists).

The listing (``fleet.facts.hub``: ``HubListing``, one root command, the host's ``python3``, Python 3.6) returns each
repository's folder and bytes and every model-id-like word of those files (a word with one ``/``,
split at blanks, ``=``, ``,`` and quotes: ``serve ORG/NAME``, ``--lora-modules sql=fleet-lora/sql``,
``--speculative-config {"model":"ORG/DRAFT"}``). The comparison is on folder names, so a
repository named by any word is kept: the check errs towards keeping.

Removal renames each folder to ``.fleet-pruning-<folder>`` in the same directory (a unit starting
at that moment finds the model whole or not at all), then deletes it. Folder names are checked
again on the host (one path component, ``models--`` prefix) before anything is renamed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.hub import (  # the listing is a fact (``fleet status`` reads it too); re-exported here
    LIST_SCRIPT,
    UNIT_DIR,
    HubListing,
    HubModels,
    HubRepo,
    folder_of,
    listing_command,
    parse_listing,
)
from fleet.facts.output import answer_line
from fleet.facts.sshlink import Link, SshError, SshTarget, connect
from fleet.inventory.spec import HostSpec

__all__ = [
    "LIST_SCRIPT", "REMOVE_SCRIPT", "UNIT_DIR", "HostPrune", "HubListing", "HubModels", "HubRepo", "Keep",
    "RepoVerdict", "decide", "folder_of", "freed", "listing_command", "parse_listing", "planned_models",
    "prune_host", "remove_command", "to_remove",
]  # fmt: skip

_FOLDER = re.compile(r"models--[A-Za-z0-9][A-Za-z0-9._-]*")

REMOVE_SCRIPT = r"""
import json, os, re, shutil, sys
hub = sys.argv[1]
ok = re.compile(r"models--[A-Za-z0-9][A-Za-z0-9._-]*\Z")
for name in json.load(sys.stdin):
    if not ok.match(name):
        sys.exit("refusing to remove %r: not a model folder name" % name)
    top, gone = os.path.join(hub, name), os.path.join(hub, ".fleet-pruning-" + name)
    if os.path.isdir(top) and not os.path.islink(top):
        os.rename(top, gone)
    if os.path.isdir(gone) and not os.path.islink(gone):
        shutil.rmtree(gone)
    print(name)
"""


def remove_command(hub: str) -> str:
    """Run as root with the JSON list of folders on stdin (never in argv: the list can be long)."""
    return ssh_command(["sudo", "-n", "--", "python3", "-c", REMOVE_SCRIPT, hub])


class Keep(Enum):
    PLANNED = "planned"
    REVISION = "named by a unit or stored revision"
    STAGING = "a copy is being staged into it"
    FOREIGN = "not a folder name fleet removes"
    PRUNE = "prune"


@dataclass(frozen=True)
class RepoVerdict:
    folder: str
    bytes: int
    keep: Keep
    why: str

    @property
    def pruned(self) -> bool:
        return self.keep is Keep.PRUNE


def planned_models(spec: HostSpec) -> tuple[str, ...]:
    """The model ids the inventory plans on a host: its model (each of its ``models``), the
    speculative draft (when named by id, not by a path) and its LoRA adapters' repositories."""
    out: list[str] = []
    for m in spec.model_specs:  # a host with models: every entry's
        out.append(m.model)
        if m.speculative is not None and m.speculative.model and not m.speculative.model.startswith("/"):
            out.append(m.speculative.model)
        out += [a.repo for a in m.lora.adapters] if m.lora is not None else []
    return tuple(dict.fromkeys(out))


def decide(listing: HubListing, planned: Iterable[str]) -> list[RepoVerdict]:
    """Each repository of the listing, kept (and why) or to prune. Pure."""
    planned_folders = {folder_of(m): m for m in planned}
    named_folders = {folder_of(w): w for w in listing.named}
    out = []
    for repo in listing.repos:
        if repo.folder in planned_folders:
            v = RepoVerdict(
                repo.folder, repo.bytes, Keep.PLANNED, f"the inventory plans {planned_folders[repo.folder]}"
            )
        elif repo.folder in named_folders:
            v = RepoVerdict(repo.folder, repo.bytes, Keep.REVISION,
                            f"{named_folders[repo.folder]} is named by a unit or a stored revision (a rollback "
                            "may serve it)")  # fmt: skip
        elif repo.staging:
            v = RepoVerdict(repo.folder, repo.bytes, Keep.STAGING, "a copy is being staged into it")
        elif not _FOLDER.fullmatch(repo.folder):
            v = RepoVerdict(repo.folder, repo.bytes, Keep.FOREIGN, "not a folder name fleet removes")
        else:
            v = RepoVerdict(repo.folder, repo.bytes, Keep.PRUNE, "no planned instance and no kept revision uses it")
        out.append(v)
    return out


def to_remove(verdicts: Sequence[RepoVerdict]) -> list[str]:
    return [v.folder for v in verdicts if v.pruned]


def freed(verdicts: Sequence[RepoVerdict]) -> int:
    return sum(v.bytes for v in verdicts if v.pruned)


#: Seconds for a host's listing (it walks the cache's metadata, reading no file's contents) and
#: for its removals (``rmtree`` of what it lists).
LIST_TIMEOUT_S = 120.0
REMOVE_TIMEOUT_S = 600.0


@dataclass
class HostPrune:
    """One host's pruning: every repository's verdict, what was removed, or why nothing was."""

    host: str
    verdicts: list[RepoVerdict] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def data(self) -> dict[str, object]:
        return {
            "host": self.host,
            "ok": self.ok,
            "error": self.error or None,
            "repos": [
                {"folder": v.folder, "bytes": v.bytes, "keep": v.keep.name.lower(), "why": v.why} for v in self.verdicts
            ],
            "removed": self.removed,
            "freed_bytes": sum(v.bytes for v in self.verdicts if v.folder in self.removed),
        }


def prune_host(target: SshTarget, hub: str, planned: Sequence[str], apply: bool) -> HostPrune:
    """List the host's cache, decide, and with ``apply`` remove what is to prune (one login)."""
    result = HostPrune(target.name)
    try:
        link = Link(target.name, connect(target))
    except SshError as exc:
        result.error = exc.reason
        return result
    try:
        rc, out, err = link.run(listing_command(hub), LIST_TIMEOUT_S, label="listing the model cache")
        if rc != 0:
            raise FleetError(f"listing the model cache exited {rc}: {err.strip()[-300:]}")
        result.verdicts = decide(parse_listing(answer_line(out.splitlines())), planned)
        gone = to_remove(result.verdicts)
        if apply and gone:
            rc, out, err = link.run(remove_command(hub), REMOVE_TIMEOUT_S, json.dumps(gone).encode(), label="pruning")
            result.removed = [line for line in out.splitlines() if line in gone]
            if rc != 0:
                raise FleetError(f"pruning exited {rc} after removing {len(result.removed)}: {err.strip()[-300:]}")
    except (SshError, FleetError) as exc:
        result.error = exc.reason if isinstance(exc, SshError) else str(exc)
    finally:
        link.close()
    return result
