"""Did a deploy converge? Each instance of a host against what the inventory asks of it (pure).

``fleet deploy`` converges every instance to the inventory's release and configuration in one
run, or says which did not: after starting and rolling, it reads each changed host's instances
again (``fleet.facts.revisions.InstanceRevisions``: the unit's state, the interpreter of its
main process and the id of the unit and env file in place) and :func:`drift` compares them with
the release and configuration revision the deploy staged for them. An instance counts as
converged when its unit is active, its process runs the inventory's release (by the one
definition of what an instance runs, ``fleet.facts.releases.running_release``: its process's
interpreter, not the host's ``current`` link) and the files in place are the inventory's
revision. Anything else is named, with what it is and what it should be.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet.facts.releases import running_release
from fleet.facts.revisions import InstanceRevision


def drift(
    host: str,
    release: str,
    revisions: Mapping[str, str],
    found: Mapping[str, InstanceRevision],
    root: str,
) -> list[str]:
    """Why each of the host's instances (``revisions``: instance -> the revision it should have
    in place) is not on ``release`` and its revision, one line per instance; empty: converged.

    An active unit whose interpreter is not a release's (nothing under ``<root>/releases``) counts
    as not on ``release``: what it runs cannot be told, so it is not taken as converged."""
    out: list[str] = []
    for instance, want in sorted(revisions.items()):
        f = found.get(instance)
        where = f"{host}/{instance}"
        if f is None:
            out.append(f"{where}: not read from the host")
            continue
        problems = []
        if f["state"] != "active":
            problems.append(f"its unit is {f['state']}")
        else:
            runs = running_release(f["exe"], None, root)
            if runs != release:
                what = f"release {runs}" if runs else f"an interpreter outside the releases ({f['exe'] or 'none'})"
                problems.append(f"runs {what}, the inventory's is {release}")
        if f["live"] != want:
            problems.append(f"configuration {f['live'] or '(files missing)'} in place, the inventory's is {want}")
        if problems:
            out.append(f"{where}: " + "; ".join(problems))
    return out
