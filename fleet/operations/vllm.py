"""vLLM on a host: its system user, one immutable virtual environment per release, and the
``current`` link that selects the release the units run.

A release is ``<root>/releases/<id>``, ``<id>`` named by its content (``layout.ReleaseSpec``:
vLLM version, the host's Python, extras, pinned companions, the package index), so the same
inputs always give the same directory and a change gives a new one beside it. It is built in
place (a venv cannot move) and counts only once its marker file is written, last. ``current``
and ``previous`` are symlinks flipped atomically (``ln -sfn`` to a temporary name, then
``mv -T``: one ``rename(2)``) under a per-host lock (``SWITCH_SH``, shared with the rollout's
``flip_release``), so going back is one flip, no reinstall. Old releases are pruned
beyond a count, never the current or the previous one.
"""

from __future__ import annotations

import json
import shlex

from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.operations import server

from fleet.facts.releases import MARKER, VllmReleases
from fleet.operations import layout
from fleet.operations.files import Commands, atomic_file

DEFAULT_ROOT = "/opt/fleet/vllm"
PIP_TIMEOUT_S = 60


@operation()
def service_user(user: str = "vllm", home: str = "/var/lib/vllm") -> Commands:
    """
    The system user the vLLM units run as, with its home (caches, model files).

    + user: user (and group) name
    + home: its home directory, created by useradd (its default mode)
    """
    yield from server.group._inner(group=user, system=True)
    yield from server.user._inner(
        user=user, group=user, home=home, shell="/usr/sbin/nologin", system=True, create_home=True
    )


def release_dir(root: str, release_id: str) -> str:
    return f"{root}/releases/{release_id}"


@operation()
def release(spec: layout.ReleaseSpec, root: str = DEFAULT_ROOT, python: str = "python3") -> Commands:
    """
    Build the release ``spec`` names under ``root`` unless it is there and complete.

    + spec: what goes into the venv (its ``release_id`` names the directory)
    + root: where releases live
    + python: the interpreter the venv is made from
    """
    facts = host.get_fact(VllmReleases, root=root)
    name = spec.release_id
    found = next((r for r in facts["releases"] if r["name"] == name), None)
    if found is not None and found["complete"]:
        host.noop(f"release {name} is there")
        return
    target = release_dir(root, name)
    if found is not None:  # half-built by an earlier run: start again
        yield shlex.join(["rm", "-rf", "--", target])
    yield shlex.join(["mkdir", "-p", "--", f"{root}/releases"])
    yield shlex.join([python, "-m", "venv", target])
    yield shlex.join(
        [
            f"{target}/bin/pip", "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir",
            "--timeout", str(PIP_TIMEOUT_S), "--index-url", spec.index_url, *spec.requirements(),
        ]
    )  # fmt: skip
    marker = {
        "id": name,
        "vllm_version": spec.vllm_version,
        "python": spec.python_version,
        "index_url": spec.index_url,
        "requirements": spec.requirements(),
    }
    yield from atomic_file._inner(path=f"{target}/{MARKER}", content=json.dumps(marker, indent=2) + "\n", mode=0o644)


#: Every switch of a host's release links takes this lock on the host (util-linux ``flock(1)``)
#: for as long as it runs, so two switches on one host never interleave: two instances of one
#: batch switching at once, or a deploy's ``activate`` beside a rollout's ``flip_release``.
SWITCH_LOCK = ".fleet-switch.lock"
SWITCH_LOCK_WAIT_S = 60
#: The exit status of a switch that did not get the lock in ``SWITCH_LOCK_WAIT_S`` (EX_TEMPFAIL).
SWITCH_LOCK_BUSY = 75

#: Shell that points ``$r/current`` at ``releases/$rel`` (``$r``, ``$rel`` set by the caller), the
#: release it pointed at becoming ``previous``: under the host's switch lock (held until the
#: calling script ends), each link replaced by one ``rename(2)`` (``ln -sfn`` to a temporary link
#: named for this process, then ``mv -T``); a no-op when ``current`` already names the release.
SWITCH_SH = (
    f'exec 9>>"$r/{SWITCH_LOCK}"; flock -w {SWITCH_LOCK_WAIT_S} 9 || {{ echo "another switch of $r held '
    f'its lock ($r/{SWITCH_LOCK}) for {SWITCH_LOCK_WAIT_S}s" >&2; exit {SWITCH_LOCK_BUSY}; }}; '
    'cur=$(readlink "$r/current" || true); if [ "$cur" != "releases/$rel" ]; then '
    'if [ -n "$cur" ]; then ln -sfn "$cur" "$r/.previous.fleet-tmp.$$"; mv -fT "$r/.previous.fleet-tmp.$$" '
    '"$r/previous"; fi; ln -sfn "releases/$rel" "$r/.current.fleet-tmp.$$"; '
    'mv -fT "$r/.current.fleet-tmp.$$" "$r/current"; fi'
)


def switch_command(root: str, release_id: str) -> str:
    """The command that makes ``release_id`` current under ``root`` (``SWITCH_SH``)."""
    return shlex.join(["sh", "-c", f"set -e; r=$1; rel=$2; {SWITCH_SH}", "fleet-activate", root, release_id])


@operation()
def activate(release_id: str, root: str = DEFAULT_ROOT) -> Commands:
    """
    Point ``current`` at ``release_id``; the release it pointed at becomes ``previous``.

    + release_id: a complete release under ``root``
    + root: where releases live
    """
    facts = host.get_fact(VllmReleases, root=root)
    if facts["current"] == release_id:
        host.noop(f"current is {release_id}")
        return
    yield switch_command(root, release_id)


@operation()
def prune(keep: int = 3, root: str = DEFAULT_ROOT) -> Commands:
    """
    Remove the oldest releases beyond ``keep``, never the current or the previous one.

    + keep: how many releases stay (at least 2)
    + root: where releases live
    """
    facts = host.get_fact(VllmReleases, root=root)
    names = [r["name"] for r in facts["releases"]]
    victims = layout.releases_to_prune(names, facts["current"], facts["previous"], keep)
    if not victims:
        host.noop(f"{len(names)} release(s), keeping up to {keep}")
        return
    yield shlex.join(["rm", "-rf", "--", *[release_dir(root, v) for v in victims]])
