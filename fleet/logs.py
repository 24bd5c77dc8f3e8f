"""fleet's log file: what libraries log goes there, redacted, never onto the operator's console.

paramiko logs a failed handshake with its whole traceback at ERROR through the
``paramiko.transport`` logger (``Transport.run``: "Exception (client): Error reading SSH protocol
banner" and one record per traceback line), and pyinfra's SSH connector logs its own advice for
a changed host key at WARNING (``pyinfra/connectors/ssh.py``: ``ssh-keygen -R HOST``, which
edits ``~/.ssh/known_hosts``, not the file fleet reads). With no handler configured, Python's
``logging.lastResort`` prints both on stderr, in the middle of fleet's own output. fleet says
what failed in one line itself (``fleet.facts.sshlink``); the libraries' records go to the log
file for whoever wants the details:

* ``$FLEET_LOG``, else ``$XDG_STATE_HOME/fleet/fleet.log`` (``~/.local/state/fleet/fleet.log``,
  beside the rollout journal); created on the first record only, mode 0600 in a 0700 directory,
  rotated at 5 MiB (two old files kept);
* every record runs through ``fleet.secrets.redact``;
* a log file that cannot be written is not an error of the command: its records are dropped.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet.secrets import redact

#: Loggers whose records go to the log file only (never the console).
LIBRARY_LOGGERS = ("paramiko",)
MAX_BYTES = 5 * 2**20
BACKUPS = 2


def log_path() -> Path:
    """``$FLEET_LOG``, else ``$XDG_STATE_HOME/fleet/fleet.log`` (``~/.local/state``)."""
    if os.environ.get("FLEET_LOG"):
        return Path(os.environ["FLEET_LOG"])
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "fleet" / "fleet.log"


class _Redacting(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class _PrivateFile(logging.handlers.RotatingFileHandler):
    """A rotating log file, opened on the first record, readable by its owner only."""

    def _open(self) -> io.TextIOWrapper:
        path = Path(self.baseFilename)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return io.TextIOWrapper(io.FileIO(fd, "a"), encoding=self.encoding or "utf-8", errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        """An unwritable log file drops the record (logging would print a traceback on stderr)."""


_handler: logging.Handler | None = None


def handler() -> logging.Handler:
    """The log file's handler (one per process)."""
    global _handler
    if _handler is None:
        h = _PrivateFile(log_path(), maxBytes=MAX_BYTES, backupCount=BACKUPS, delay=True, encoding="utf-8")
        h.setFormatter(_Redacting("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
        _handler = h
    return _handler


def route_library_logs() -> None:
    """Send the libraries' loggers (``LIBRARY_LOGGERS``) to the log file, not the console."""
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if handler() not in logger.handlers:
            logger.addHandler(handler())
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)  # failures, not every login


@contextmanager
def to_log_file(name: str) -> Iterator[None]:
    """While in the block, ``name``'s records go to the log file only (e.g. pyinfra's while it
    connects: its advice for a changed host key is not fleet's)."""
    logger = logging.getLogger(name)
    propagate, added = logger.propagate, handler() not in logger.handlers
    if added:
        logger.addHandler(handler())
    logger.propagate = False
    try:
        yield
    finally:
        logger.propagate = propagate
        if added:
            logger.removeHandler(handler())
