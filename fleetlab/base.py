"""The cached Debian base every lab host's root filesystem is an overlay of.

Built once with ``debootstrap --variant=minbase`` and kept under the cache dir, keyed by suite,
architecture, package list and the recipe version, so a changed package list builds a new base
beside the old one. It is built in a temporary directory and renamed into place, so an
interrupted build never looks finished; a lock file serialises concurrent builders.

After debootstrap the recipe: removes the ssh host keys debootstrap generated (each host gets its
own, made by the lab), empties ``/etc/machine-id`` (each host gets its own), and creates the login
user ``fleet`` (uid 1000) with passwordless sudo. Per-lab secrets (authorized_keys) never enter
the base.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from fleetlab.errors import LabError
from fleetlab.locks import file_lock
from fleetlab.mounts import unmount_all_under

DEFAULT_CACHE_DIR = Path(os.environ.get("FLEET_LAB_CACHE", "/var/cache/fleet/lab"))
DEFAULT_SUITE = "bookworm"
BASE_PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "sudo",
    "python3",
    "python3-venv",
    "iproute2",
    "ca-certificates",
)
#: Bump when the steps after debootstrap change, so old cached bases are not reused.
RECIPE_VERSION = 1
LOGIN_USER = "fleet"
LOGIN_UID = 1000
MARKER = ".fleet-lab-base.json"

Progress = Callable[[str], None]


def _arch() -> str:
    """The Debian architecture name of this machine."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def base_key(suite: str, packages: Sequence[str]) -> str:
    """A short stable digest of everything that makes one base differ from another."""
    text = f"{suite}|{_arch()}|{','.join(sorted(set(packages)))}|recipe={RECIPE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def base_path(cache_dir: Path, suite: str, packages: Sequence[str]) -> Path:
    """Where the base for ``suite`` + ``packages`` lives in the cache."""
    return cache_dir / f"base-{suite}-{base_key(suite, packages)}"


def is_complete(path: Path) -> bool:
    """A base is usable once its marker (written last, before the rename) exists."""
    return (path / MARKER).is_file()


def _locked(cache_dir: Path) -> AbstractContextManager[None]:
    """Serialise builders of the same cache: one builds, the others wait, then reuse."""
    return file_lock(cache_dir / ".build.lock")


def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    """Run ``cmd`` appending its output to ``log``; on failure raise with the log's tail."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LabError(f"{what} failed (exit {result.returncode}); full log: {log}\n{tail}")


def _debootstrap(target: Path, suite: str, packages: Sequence[str], mirror: str, log: Path) -> None:
    """Run debootstrap into ``target``."""
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        f"--arch={_arch()}",
        suite,
        str(target),
        mirror,
    ]
    _run_logged(cmd, log, f"debootstrap of {suite} from {mirror}")


def _customise(root: Path, log: Path) -> None:
    """The recipe's steps after debootstrap (see the module docstring)."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    _run_logged(
        ["chroot", str(root), "useradd", "--create-home", "--shell", "/bin/bash", "--uid", str(LOGIN_UID),
         "--user-group", LOGIN_USER],
        log,
        f"creating the login user {LOGIN_USER!r} in the base",
    )  # fmt: skip
    sudoers = root / "etc/sudoers.d" / LOGIN_USER
    sudoers.write_text(f"{LOGIN_USER} ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)
    _run_logged(["chroot", str(root), "apt-get", "clean"], log, "apt-get clean in the base")


def _build(final: Path, suite: str, packages: Sequence[str], mirror: str, progress: Progress) -> None:
    """Build into a temporary sibling of ``final``, then rename it into place."""
    cache_dir = final.parent
    log = cache_dir / f"{final.name}.log"
    log.write_text("")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=cache_dir))
    try:
        started = time.monotonic()
        progress(f"debootstrap {suite} from {mirror} (about a minute; log: {log})")
        _debootstrap(tmp, suite, packages, mirror, log)
        _customise(tmp, log)
        marker = {"suite": suite, "packages": sorted(packages), "mirror": mirror, "recipe": RECIPE_VERSION,
                  "built_at": time.time(), "build_seconds": round(time.monotonic() - started, 1)}  # fmt: skip
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            unmount_all_under(tmp)  # debootstrap mounts /proc and /sys in the target while it runs
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_base(
    mirror: str,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    suite: str = DEFAULT_SUITE,
    packages: Sequence[str] = BASE_PACKAGES,
    progress: Progress = lambda _msg: None,
) -> Path:
    """Return the path of a complete base for ``suite`` + ``packages``, building it if needed."""
    final = base_path(cache_dir, suite, packages)
    if is_complete(final):
        return final
    with _locked(cache_dir):
        if is_complete(final):  # another builder finished while we waited
            return final
        if final.exists():
            raise LabError(f"{final} exists but is not a complete lab base; remove it (rm -rf {final}) and retry")
        _build(final, suite, packages, mirror, progress)
    return final
