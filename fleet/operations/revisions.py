"""Store each instance's rendered configuration as an immutable revision on its host
(``fleet.render.revision``), and prune old ones.

A revision is written once, into its own root-only directory, its ``revision.json`` last (the
revision counts only once that is there, as a release counts once its marker is). The live files
are not this operation's business: an idle unit's are written in place by ``units.installed``, a
serving unit's are put in place by the rolling engine between its stop and its start.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from pyinfra.api.operation import operation
from pyinfra.context import host

from fleet.facts.revisions import InstanceRevision, InstanceRevisions, fact_instances
from fleet.operations import layout
from fleet.operations.files import Commands, atomic_file
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
    changed = False
    for rev in revisions:
        none: InstanceRevision = {"state": "unknown", "live": None, "stored": [], "exe": None}
        have = found.get(rev.instance) or none
        names = [s["id"] for s in have["stored"]]
        if rev.id not in names:
            d = rev.directory(root)
            yield shlex.join(["install", "-d", "-m", "0700", "--", root, f"{root}/{rev.instance}", d])
            yield from atomic_file._inner(path=f"{d}/{UNIT}", content=rev.unit.content, mode=0o600)
            yield from atomic_file._inner(path=f"{d}/{ENV}", content=rev.env.content, mode=0o600)
            yield from atomic_file._inner(path=f"{d}/{META}", content=rev.meta(), mode=0o600)
            names.append(rev.id)
            changed = True
        victims = layout.releases_to_prune(names, have["live"], rev.id, keep)
        if victims:
            yield shlex.join(["rm", "-rf", "--", *[f"{root}/{rev.instance}/{v}" for v in victims]])
            changed = True
    if not changed:
        host.noop(f"{len(revisions)} configuration revision(s) stored")
