"""HAProxy on a balancer host (``role: balancer``): Debian's packages, fleet's configuration, a
reload that keeps runtime state.

* ``packages``: ``haproxy`` and ``socat`` (fleet reaches the admin socket with ``socat``, as
  HAProxy's management guide does; Debian's haproxy brings no client) from the host's own apt
  sources (its mirror is the machine's configuration, never fleet's);
* ``configuration``: the systemd drop-in that dumps ``show servers state`` into the
  ``server-state-file`` before every ``systemctl reload haproxy`` (``fleet.lb.config.systemd_dropin``),
  and the configuration from ``fleet.lb.config`` written beside the live one, checked with
  ``haproxy -c`` and only then renamed over it (a configuration HAProxy refuses never replaces the
  one it runs); then ``systemctl reload haproxy``, which with Debian's unit (``-Ws``,
  master-worker) is hitless: the master starts a new worker and the old one finishes its
  connections (HAProxy management guide, "Stopping and restarting HAProxy"). A HAProxy that was
  not running when the run began is (re)started and enabled.

Files are written with ``fleet.operations.files.write_command`` (atomic, owner and mode from the
first byte). Nothing here is secret: the API key never reaches a balancer (clients send it).
"""

from __future__ import annotations

import hashlib
import shlex

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import operation
from pyinfra.context import host
from pyinfra.facts.files import Sha1File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from fleet.facts.packages import DebPackageStates
from fleet.lb.config import SYSTEMD_DROPIN
from fleet.operations.files import Commands, write_command
from fleet.operations.nvidia import APT_INSTALL

PACKAGES = ("haproxy", "socat")
SERVICE = "haproxy.service"
#: ``apt-get update`` of the host's own sources (the distribution's mirror, as the host is configured).
APT_UPDATE = ["apt-get", "update"]


@operation()
def packages() -> Commands:
    """
    Install Debian's ``haproxy`` and ``socat`` from the host's own apt sources.
    """
    installed = host.get_fact(DebPackageStates)
    missing = [p for p in PACKAGES if p not in installed]
    if not missing:
        host.noop("haproxy and socat are installed")
        return
    yield shlex.join(APT_UPDATE)
    yield shlex.join([*APT_INSTALL, *missing])


def _differs(path: str, text: str) -> bool:
    return host.get_fact(Sha1File, path=path) != hashlib.sha1(text.encode()).hexdigest()


@operation()
def configuration(path: str, text: str, dropin: str) -> Commands:
    """
    Install HAProxy's configuration (checked first) and the state-saving reload drop-in; reload.

    + path: the configuration file HAProxy's unit reads (``balancer.config``)
    + text: the configuration (``fleet.lb.config.render_config``)
    + dropin: the drop-in's text (``fleet.lb.config.systemd_dropin``)
    """
    changed = False
    if _differs(SYSTEMD_DROPIN, dropin):
        yield write_command(SYSTEMD_DROPIN, dropin.encode(), 0o644, "root", "root")
        yield "systemctl daemon-reload"
    if _differs(path, text):
        new = f"{path}.fleet-new"
        yield write_command(new, text.encode(), 0o644, "root", "root")
        yield shlex.join(["haproxy", "-c", "-q", "-f", new])
        yield shlex.join(["mv", "-fT", "--", new, path])
        changed = True
    running = host.get_fact(SystemdStatus, services=[SERVICE]).get(SERVICE)
    if not host.get_fact(SystemdEnabled, services=[SERVICE]).get(SERVICE):
        yield shlex.join(["systemctl", "enable", SERVICE])
    if not running:
        # not running when this run began: nothing goes through it, and a HAProxy the packages
        # above just installed and started runs Debian's own configuration: restart, not start
        yield shlex.join(["systemctl", "restart", SERVICE])
    elif changed:
        yield shlex.join(["systemctl", "reload", SERVICE])
    else:
        host.noop("HAProxy's configuration is up to date and it runs")


@deploy("HAProxy balancer")
def balancer_host(path: str, text: str, dropin: str) -> None:
    """The whole balancer host: packages, then the configuration and its reload."""
    packages(name="haproxy and socat")
    configuration(name="HAProxy configuration", path=path, text=text, dropin=dropin)
