"""pyinfra's SSH connections for a deploy, with fleet's reasons and deadlines.

pyinfra connects (``pyinfra.api.connect.connect_all``) and runs the operations over its own
paramiko clients. Two things are added here:

* **the reason a host could not be connected to**, in fleet's words (``fleet.facts.sshlink``):
  pyinfra reports it only to its log and to ``host_connect_error`` callbacks, the underlying
  paramiko or socket error being the ``__context__`` of its ``ConnectError``. pyinfra's own log
  lines while connecting (its ``ssh-keygen -R`` advice for a changed key edits
  ``~/.ssh/known_hosts``, not the inventory's ``ssh_known_hosts_file``) go to fleet's log file.
* **a deadline when a host goes silent** during the operations: each connected client is watched
  by a ``sshlink.Link`` (a heartbeat, and a watchdog that closes the client once the host has not
  answered for ``SILENT_S``), so an operation on a frozen or cut-off host fails instead of
  hanging the deploy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.host import Host
from pyinfra.api.state import BaseStateCallback, State

from fleet.facts import sshlink
from fleet.facts.runner import SshTarget
from fleet.logs import to_log_file


class _ConnectErrors(BaseStateCallback):
    def __init__(self) -> None:
        self.errors: dict[str, BaseException] = {}

    def host_connect_error(self, state: State, host: Host, error: Any) -> None:  # type: ignore[override]
        self.errors[host.name] = error


def why_not_connected(host: Host, error: BaseException | None, timeout: float) -> str:
    """One line: why pyinfra could not connect to ``host``."""
    if error is None:
        return "could not connect over SSH"
    cause = error.__cause__ or error.__context__
    try:
        target = SshTarget.from_data(host.name, host.data.dict())  # type: ignore[no-untyped-call]
    except Exception:
        return str(error)
    return sshlink.describe(cause, target, timeout) if cause is not None else str(error)


@dataclass
class Connected:
    """The hosts pyinfra connected to, watched; and why each of the others was not."""

    failed: dict[str, str] = field(default_factory=dict)
    links: dict[str, tuple[sshlink.Link, object]] = field(default_factory=dict)

    def silent(self, host: str) -> str:
        """Why the watchdog closed ``host``'s connection (it stopped answering); empty if it did not."""
        link = self.links.get(host)
        return link[0].dead if link is not None else ""

    def release(self) -> None:
        """Stop watching (before pyinfra disconnects)."""
        for link, job in self.links.values():
            link.release(job)
        self.links.clear()


def connect(state: State) -> Connected:
    """``connect_all`` with the reasons kept and every connected client watched."""
    errors = _ConnectErrors()
    state.add_callback_handler(errors)  # type: ignore[no-untyped-call]
    with to_log_file("pyinfra"):
        try:
            connect_all(state)
        except PyinfraError:  # "No hosts remaining!": each host's reason is kept below
            if state.activated_hosts or not errors.errors:
                raise
    out = Connected()
    timeout = float(state.config.CONNECT_TIMEOUT or sshlink.CONNECT_TIMEOUT_S)
    for host in state.inventory:
        if host in state.activated_hosts:
            client = getattr(host.connector, "client", None)
            if client is not None and client.get_transport() is not None:
                link = sshlink.Link(host.name, client)
                out.links[host.name] = (link, link.hold(math.inf))
        elif host.name in errors.errors:
            out.failed[host.name] = why_not_connected(host, errors.errors[host.name], timeout)
    return out
