"""Store each instance's rendered configuration as an immutable revision on its host
(``fleet.render.revision``), and prune old ones.

A revision is written once, into its own root-only directory, its ``revision.json`` last (the
revision counts only once that is there, as a release counts once its marker is). The live files
are not this operation's business: an idle unit's are written in place by ``units.installed``, a
serving unit's are put in place by the rolling engine between its stop and its start.

A revision not stored yet is written whole, whatever an interrupted store left of its files
(their content is the revision's own: no file is read first), and every revision and the pruning
go in one command, each part only once the one before succeeded.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from pyinfra.api.operation import operation
from pyinfra.context import host

from fleet.facts.revisions import InstanceRevision, InstanceRevisions, fact_instances
from fleet.operations import layout
from fleet.operations.files import Commands, Wanted, joined, write_many
from fleet.render.revision import ENV, META, ROOT, UNIT, Revision


@operation()
def stored(
    revisions: Sequence[Revision],
    keep: int = 3,
    root: str = ROOT,
    found: Mapping[str, InstanceRevision] | None = None,
) -> Commands:
    """
    Store every revision not stored yet; keep at most ``keep`` per instance (never the live one).

    + revisions: one per instance, from the host's rendered files
    + keep: revisions kept per instance (at least 2: the live one and the one before)
    + root: the revision store
    + found: the ``InstanceRevisions`` fact when the caller already has it (one round trip fewer)
    """
    if found is None:
        found = host.get_fact(InstanceRevisions, instances=fact_instances(revisions), root=root)
    dirs: list[str] = []
    writes: list[Wanted] = []
    prune: list[str] = []
    for rev in revisions:
        none: InstanceRevision = {"state": "unknown", "live": None, "stored": [], "exe": None}
        have = found.get(rev.instance) or none
        names = [s["id"] for s in have["stored"]]
        if rev.id not in names:
            # not stored (a revision counts once its revision.json is there): its files are written
            # whatever a store cut short left of them, revision.json last
            d = rev.directory(root)
            dirs += [f"{root}/{rev.instance}", d]
            writes += [
                Wanted(f"{d}/{UNIT}", rev.unit.content, 0o600),
                Wanted(f"{d}/{ENV}", rev.env.content, 0o600),
                Wanted(f"{d}/{META}", rev.meta(), 0o600),
            ]
            names.append(rev.id)
        prune += [f"{root}/{rev.instance}/{v}" for v in layout.releases_to_prune(names, have["live"], rev.id, keep)]
    parts = []
    stdin = None
    if writes:
        write, stdin = write_many(writes)
        parts += [shlex.join(["install", "-d", "-m", "0700", "--", root, *dirs]), write]
    if prune:
        parts.append(shlex.join(["rm", "-rf", "--", *prune]))
    if not parts:
        host.noop(f"{len(revisions)} configuration revision(s) stored")
        return
    # one command: the stores, then the pruning (each part only once the one before succeeded)
    yield joined(parts, stdin)
