"""The lab's load balancer: HAProxy (Debian's package) on this machine, in front of the lab's instances.

``fleet lab up --lb`` writes a ``balancer`` entry (``on: local``) on every lab host of the
inventory, renders the configuration fleet renders for any balancer (``fleet.lb.config``) from
that inventory and its plan (the hosts' ``gpu`` entries), and runs HAProxy in master-worker mode
(``haproxy -W -db``) detached in its own session, so it outlives the command, like the lab's package
index. It listens on ``127.0.<octet>.1:8080`` (the lab's own address range; no lab host has ``.1``);
its admin socket, configuration, state file, pid file and log live in ``<lab>/lb/``.

Running ``up`` again re-renders the configuration and, when it changed, reloads HAProxy the way
fleet keeps runtime state across reloads (``fleet.lb.local``, as ``fleet deploy`` does for any
balancer on this machine: ``show servers state`` into the state file, then ``SIGUSR2`` to the
master). ``fleet lab down`` stops it.
Servers start ``disabled``: ``fleet deploy`` sets each ``ready`` once its instance serves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from fleetlab.errors import LabError
from fleetlab.state import LabDir, LabState

PORT = 8080
START_TIMEOUT_S = 15.0


def lb_dir(lab: LabDir) -> Path:
    return lab.root / "lb"


def bind_of(state: LabState) -> str:
    return f"127.0.{state.octet}.1:{PORT}"


def url_of(state: LabState) -> str:
    return f"http://{bind_of(state)}"


def balancer_entry(lab: LabDir, state: LabState) -> dict[str, Any]:
    """The ``balancer`` data every lab host gets in the inventory."""
    d = lb_dir(lab)
    return {"kind": "haproxy", "on": "local", "bind": bind_of(state), "admin_socket": str(d / "admin.sock"),
            "config": str(d / "haproxy.cfg"), "timeout_s": 5}  # fmt: skip


def _pid(lab: LabDir) -> int | None:
    try:
        pid = int((lb_dir(lab) / "haproxy.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def _answers(socket_path: str) -> bool:
    from fleet.lb.transport import BalancerError, LocalSocket

    try:
        LocalSocket(socket_path, 2.0).send("show info")
        return True
    except BalancerError:
        return False


def ensure(lab: LabDir, inventory: Path) -> str:
    """Render the configuration from the lab's inventory and start (or reload) HAProxy; its URL."""
    from fleet.inventory.spec import load_inventory
    from fleet.lb import local
    from fleet.lb.config import fleet_configs, render_config
    from fleet.lb.transport import BalancerError
    from fleet.plan.outcomes import plan_inventory

    try:
        haproxy = local.haproxy_binary()
    except BalancerError:
        raise LabError(
            "--lb needs HAProxy on this machine: apt-get install haproxy (scripts/install.sh does)"
        ) from None
    loaded = load_inventory(inventory)
    outcomes = plan_inventory(loaded)
    configs = fleet_configs(loaded, {o.spec.name: o.plan for o in outcomes})
    if len(configs) != 1:
        raise LabError(f"the lab's inventory {inventory} should name one local balancer, not {len(configs)}")
    config = configs[0]
    d = lb_dir(lab)
    d.mkdir(parents=True, exist_ok=True)
    cfg = Path(config.spec.config)
    sock = config.spec.admin_socket
    try:
        changed = local.write_config(config, render_config(config, str(inventory), written_by="fleet lab up --lb"))
        running = _pid(lab) is not None and _answers(sock)
        if running and changed:
            local.reload(config)  # keeps every server's runtime state (the state file, SIGUSR2)
    except BalancerError as exc:
        raise LabError(f"the lab's HAProxy: {exc}") from None
    if not running:
        with contextlib.suppress(FileNotFoundError):
            Path(sock).unlink()
        with open(d / "haproxy.log", "ab") as log:
            subprocess.Popen(
                [haproxy, "-W", "-db", "-f", str(cfg), "-p", str(d / "haproxy.pid")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(sock):
        if time.monotonic() > deadline:
            tail = (d / "haproxy.log").read_text(errors="replace")[-800:] if (d / "haproxy.log").exists() else ""
            raise LabError(f"the lab's HAProxy does not answer at {sock} after {START_TIMEOUT_S:g}s: {tail}")
        time.sleep(0.1)
    return f"http://{config.backends[0].bind}"


def stop(lab: LabDir) -> bool:
    """Stop the lab's HAProxy (its master and workers); True when one was running."""
    pid = _pid(lab)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True
