"""A balancer on this machine (``on: local``): its configuration written and HAProxy reloaded in place.

``fleet deploy`` (and ``fleet lab up --lb``) write the configuration the way a reload must find it:
to a scratch file beside it (unique, removed after), checked with ``haproxy -c`` (a configuration
HAProxy refuses never replaces the one it runs), then written atomically over it
(``fleet.localfs.atomic_write``: a temporary renamed over it, one ``rename(2)``).

A reload keeps every server's runtime state (fleet's ``set server ... state`` and its health):
``show servers state`` is written to the configuration's ``server-state-file`` first (atomically),
then the master process gets ``SIGUSR2``, HAProxy's master-worker reload (management guide,
"Stopping and restarting HAProxy"; the new worker reads the file through
``load-server-state-from-file global``). The master is found from the running worker: ``show info``
on the admin socket names the worker's ``Pid``, and its parent must be an ``haproxy`` process
(a HAProxy that does not run master-worker, ``-W``, is not reloaded: the caller says how to).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from fleet.lb.config import BalancerConfig
from fleet.lb.transport import BalancerDown, BalancerError, BalancerMisconfigured, LocalSocket
from fleet.localfs import atomic_write

#: How long a reload may take until the new worker answers with every server.
RELOAD_TIMEOUT_S = 15.0


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if found is None:
        raise BalancerMisconfigured("haproxy is not installed on this machine: apt-get install haproxy")
    return found


def check_config(text: str, where: Path) -> None:
    """``haproxy -c`` of ``text`` (written beside ``where``); ``BalancerMisconfigured`` with
    HAProxy's own words when it refuses it.

    The text goes to a scratch file, not through ``atomic_write``: it replaces nothing and
    nothing else reads it. ``tempfile.NamedTemporaryFile`` gives it a unique name (``O_EXCL``:
    two fleet runs never check each other's text, a symlink at the name is never written
    through) and removes it after."""
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=where.parent, prefix=f".{where.name}.",
                                     suffix=".fleet-check") as scratch:  # fmt: skip
        scratch.write(text)
        scratch.flush()
        done = subprocess.run([haproxy_binary(), "-c", "-q", "-f", scratch.name], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
    if done.returncode != 0:
        raise BalancerMisconfigured(
            f"haproxy -c refused the configuration for {where}: {(done.stderr or done.stdout).strip()[-800:]}"
        )


def write_config(config: BalancerConfig, text: str) -> bool:
    """The configuration in place (checked first); False when it already was."""
    path = Path(config.spec.config)
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    check_config(text, path)
    atomic_write(path, text)
    return True


def master_pid(socket_path: str, timeout_s: float = 5.0) -> int:
    """The master of the HAProxy answering at ``socket_path`` (see the module docstring)."""
    info = LocalSocket(socket_path, timeout_s).send("show info")
    worker = next((int(line.split(":", 1)[1]) for line in info.splitlines() if line.startswith("Pid:")), 0)
    if worker <= 0:
        raise BalancerMisconfigured(f"{socket_path}: `show info` names no Pid: is it HAProxy's admin socket?")
    try:
        stat = Path(f"/proc/{worker}/stat").read_text()
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        comm = Path(f"/proc/{parent}/comm").read_text().strip()
    except (OSError, ValueError, IndexError) as exc:
        raise BalancerDown(f"{socket_path}: HAProxy's worker {worker} is gone ({exc})") from None
    if comm != "haproxy":
        raise BalancerMisconfigured(
            f"{socket_path}: HAProxy (pid {worker}) does not run master-worker (its parent is {comm!r}): reload it "
            "the way it was started, after writing `show servers state` to its server-state-file"
        )
    return parent


def save_state(config: BalancerConfig) -> None:
    """``show servers state`` into the configuration's ``server-state-file`` (atomically)."""
    text = LocalSocket(config.spec.admin_socket, config.spec.timeout_s).send("show servers state")
    atomic_write(config.state_file, text)


def reload(config: BalancerConfig) -> None:
    """Reload the HAProxy running ``config`` keeping its servers' runtime state; returns once the
    new worker answers (``BalancerError`` otherwise)."""
    sock = config.spec.admin_socket
    master = master_pid(sock)
    old = _worker(sock)
    save_state(config)
    os.kill(master, signal.SIGUSR2)
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if _worker(sock) not in (0, old):
                return
        except BalancerError:
            pass
        time.sleep(0.1)
    raise BalancerDown(f"{sock}: no new HAProxy worker answered within {RELOAD_TIMEOUT_S:g}s of the reload")


def _worker(sock: str) -> int:
    info = LocalSocket(sock, 2.0).send("show info")
    return next((int(line.split(":", 1)[1]) for line in info.splitlines() if line.startswith("Pid:")), 0)
