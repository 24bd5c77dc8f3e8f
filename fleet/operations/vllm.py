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
from collections.abc import Mapping
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import OperationError
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.server import Which
from pyinfra.operations import files, server

from fleet.facts.releases import MARKER, VllmReleases
from fleet.facts.users import UserEntry
from fleet.operations import layout
from fleet.operations.files import Commands

DEFAULT_ROOT = "/opt/fleet/vllm"
PIP_TIMEOUT_S = 60


SERVICE_USER = "vllm"
SERVICE_SHELL = "/usr/sbin/nologin"


def user_command(existing: Mapping[str, Any] | None, user: str, home: str, shell: str) -> list[str]:
    """What makes ``user`` the service user (pure): its own group as primary group, ``home`` and
    ``shell``; ``existing``: its entry (``fleet.facts.users.UserEntry``, None: no such user).

    The argv pyinfra 3.10's ``server.user(user, group=user, home, shell, system=True,
    create_home=True)`` yields (``pyinfra/operations/server.py``: ``useradd -d -s -g -r -m`` for a
    new user, ``usermod`` with what differs for an existing one), empty when nothing differs."""
    if existing is None:
        return ["useradd", "-d", home, "-s", shell, "-g", user, "-r", "-m", user]
    changes: list[str] = []
    if existing.get("home") != home:
        changes += ["-d", home]
    if existing.get("shell") != shell:
        changes += ["-s", shell]
    if existing.get("group") != user:
        changes += ["-g", user]
    return ["usermod", *changes, user] if changes else []


@operation()
def service_user(user: str = SERVICE_USER, home: str = "/var/lib/vllm") -> Commands:
    """
    The system user the vLLM units run as, with its home (caches, model files).

    + user: user (and group) name
    + home: its home directory, created by useradd (its default mode)

    pyinfra's ``server.user`` decides from the ``Users`` fact, which reads every user on the
    host (``lastlog`` and ``id`` for each); this reads the one user (``UserEntry``) and decides as
    ``server.user`` does (:func:`user_command`), then the home's ownership as ``server.user``
    does (``files.directory``).
    """
    yield from server.group._inner(group=user, system=True)
    argv = user_command(host.get_fact(UserEntry, user=user), user, home, SERVICE_SHELL)
    if argv:
        if not host.get_fact(Which, command=argv[0]):
            raise OperationError(f"{argv[0]} is not installed (Debian's passwd package)")
        yield StringCommand(*(QuoteString(a) for a in argv))
    yield from files.directory._inner(path=home, user=user, group=user, _no_fail_on_link=True)


def release_dir(root: str, release_id: str) -> str:
    return f"{root}/releases/{release_id}"


#: Margin over the measured size of the largest release already on the host: a new release pins
#: the same packages but for what changed (the vLLM version, an extra), so its size is close.
SIZE_MARGIN = 1.10
#: What a release needs at least where the host has none to measure: a venv with pip and its
#: metadata (``python3 -m venv`` with ``ensurepip`` wrote 24 MiB on Debian 12's Python 3.11), plus
#: a third. A first build that needs more (the real vLLM 0.33 with torch and the CUDA wheels is
#: several GB installed: ``pip install --no-cache-dir vllm`` left 6.9 GB in site-packages in
#: vllm-project/vllm#13112) and runs out of space stops with ``No space left on device (ENOSPC)``
#: and the numbers, its half-built directory removed; the next build is measured from this one.
FIRST_RELEASE_KIB = 32 * 1024

#: Builds one release, checked and cleaned up: ``sh -s -- ROOT ID PYTHON FLOOR_KIB MARGIN_PERCENT
#: MARKER MARKER_JSON PIP_ARGS...`` with this script on stdin (so an error shows the arguments, not
#: the script; what it runs reads ``/dev/null``, never the script). Before anything is written it compares the space
#: needed (the largest complete release here, measured with ``du``, plus the margin; ``FLOOR_KIB``
#: where there is none) with what ``df`` says is free on the releases' filesystem, and refuses with
#: both numbers, the filesystem and its mount point (exit 28, ENOSPC's errno). A step that fails
#: removes the half-built release directory and says why in its last line: ``No space left on
#: device (ENOSPC)`` when its output says so or the filesystem has no MiB left (``ensurepip`` hides
#: the cause: ``venv`` prints only its exit status), with the numbers; otherwise the step and its
#: last output lines. The marker is written last (a temporary name, then ``mv -T``): a build cut
#: short by a lost connection leaves a directory without it, which the next run removes.
#:
#: The venv gets what ``python3 -m venv`` gives it (pip, and setuptools before Python 3.12: the
#: wheels the interpreter's ``ensurepip`` bundles, in its ``_bundled`` directory or the
#: distribution's ``WHEEL_PKG_DIR``, Debian's /usr/share/python-wheels) but in one pip run instead of
#: two: the venv is made ``--without-pip`` and pip, run from its own wheel (pip's ``__main__.py``
#: supports that), installs the requirements and ``pip``/``setuptools`` together, those wheels
#: offered with ``--find-links`` beside the index (pip takes the newer of the two, as a second
#: ``pip install`` after ensurepip would where a requirement needs it: torch 2.13 needs
#: setuptools >= 77, Debian 12 bundles 66). Measured on a lab host (Debian 12, the lab's stand-in
#: vLLM, the machine at load 8-11), three runs each: ensurepip then pip 3.6-4.4 s of CPU and
#: 10.4-12.0 s wall, the one run 3.4-3.9 s of CPU and 5.2-7.2 s wall. Without the wheels (no
#: ``ensurepip``, a distribution that removed them) the build makes the venv with ensurepip as before.
BUILD = r"""
set -u
root=$1; id=$2; py=$3; floor=$4; margin=$5; marker=$6; marker_json=$7; shift 7
rel=$root/releases; target=$rel/$id; tmp=${TMPDIR:-/tmp}
mib() { echo $(( ($1 + 1023) / 1024 )); }
fs() { df -Pk -- "$1" | awk 'NR == 2 { print $1 " mounted at " $6 }'; }
avail() { df -Pk -- "$1" | awk 'NR == 2 { print $4 }'; }
mkdir -p -- "$rel" || exit 1
rm -rf -- "$target"
largest=0; from=
for d in "$rel"/*/; do
  [ -f "$d$marker" ] || continue
  k=$(du -sk -- "$d" | cut -f1)
  if [ "$k" -gt "$largest" ]; then largest=$k; from=${d%/}; from=${from##*/}; fi
done
if [ "$largest" -gt 0 ]; then
  need=$(( largest * margin / 100 ))
  basis="the largest release here, $from, is $(mib "$largest") MiB, +$((margin - 100))%"
else
  need=$floor; basis="no release here to measure: a venv with pip"
fi
free=$(avail "$rel")
if [ "$free" -lt "$need" ]; then
  echo "release $id: No space left on device (ENOSPC): needs $(mib "$need") MiB ($basis), \
$(mib "$free") MiB free on $(fs "$rel"); nothing was written" >&2
  exit 28
fi
fail() {
  step=$1; out=$2; full=
  case "$out" in *"No space left on device"*|*"Errno 28"*) full=1 ;; esac
  left=$(avail "$rel"); where=$(fs "$rel")
  [ "$left" -lt 1024 ] && full=1
  rm -rf -- "$target"
  printf '%s\n' "$out" | tail -n 4 >&2
  if [ -n "$full" ]; then
    also=
    [ "$(fs "$tmp")" = "$where" ] || \
      also="; $(mib "$(avail "$tmp")") MiB free in $tmp (pip's temporary files) on $(fs "$tmp")"
    echo "release $id: No space left on device (ENOSPC) during $step: needed more than the \
$(mib "$need") MiB checked for ($basis); $(mib "$left") MiB were free on $where when it failed$also; \
the half-built release was removed" >&2
    exit 28
  fi
  echo "release $id: $step failed; the half-built release was removed" >&2
  exit 1
}
wheels=$("$py" -I - 2>/dev/null <<'FLEET_BUNDLED_EOF'
import os, sys, sysconfig
try:
    import ensurepip
except ImportError:
    sys.exit(0)
names = ("setuptools", "pip") if sys.version_info < (3, 12) else ("pip",)
found = {}
bundled = os.path.join(os.path.dirname(ensurepip.__file__), "_bundled")
for d in (bundled, sysconfig.get_config_var("WHEEL_PKG_DIR") or ""):
    try:
        files = sorted(os.listdir(d))
    except OSError:
        continue
    for f in files:
        for n in names:
            if f.startswith(n + "-") and f.endswith(".whl"):
                found[n] = os.path.join(d, f)
if set(found) == set(names) and all(os.path.isfile(w) and "\n" not in w for w in found.values()):
    print(" ".join(names))
    for n in names:
        print(found[n])
FLEET_BUNDLED_EOF
) || wheels=
links=
if [ -n "$wheels" ]; then links=$(mktemp -d 2>/dev/null) || links=; fi
if [ -n "$links" ]; then
  names=$(printf '%s\n' "$wheels" | head -n 1)
  pipwhl=$(printf '%s\n' "$wheels" | tail -n 1)
  printf '%s\n' "$wheels" | tail -n +2 | while IFS= read -r w; do ln -sf -- "$w" "$links/"; done
  out=$("$py" -m venv --without-pip -- "$target" 2>&1 </dev/null) \
    || { rm -rf -- "$links"; fail "python3 -m venv" "$out"; }
  out=$("$target/bin/python" "$pipwhl/pip" "$@" --find-links "$links" $names 2>&1 </dev/null) \
    || { rm -rf -- "$links"; fail "pip install" "$out"; }
  rm -rf -- "$links"
else
  out=$("$py" -m venv -- "$target" 2>&1 </dev/null) || fail "python3 -m venv (ensurepip)" "$out"
  out=$("$target/bin/pip" "$@" 2>&1 </dev/null) || fail "pip install" "$out"
fi
m=$target/$marker
out=$( { umask 022 && printf '%s\n' "$marker_json" > "$m.fleet-tmp" && mv -fT -- "$m.fleet-tmp" "$m"; } 2>&1) \
  || fail "writing the marker" "$out"
"""


@operation()
def release(spec: layout.ReleaseSpec, root: str = DEFAULT_ROOT, python: str = "python3") -> Commands:
    """
    Build the release ``spec`` names under ``root`` unless it is there and complete.

    One command (``BUILD``): the space it needs checked against what is free on the releases'
    filesystem first, the venv, pip from the inventory's index only, the marker last; a failed
    step removes what it wrote, and a full disk is named as such, with the numbers.

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
    pip = [
        "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir",
        "--timeout", str(PIP_TIMEOUT_S), "--index-url", spec.index_url,
        *(["--no-deps"] if spec.no_deps else []), *spec.requirements(),
    ]  # fmt: skip
    marker = {
        "id": name,
        "vllm_version": spec.vllm_version,
        "python": spec.python_version,
        "index_url": spec.index_url,
        "requirements": spec.requirements(),
    }
    margin = str(round(SIZE_MARGIN * 100))
    argv = ["sh", "-s", "--", root, name, python, str(FIRST_RELEASE_KIB), margin, MARKER, json.dumps(marker), *pip]
    yield StringCommand(shlex.join(argv), _stdin=BUILD)


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
