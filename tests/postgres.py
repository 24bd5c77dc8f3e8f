"""A private PostgreSQL server for tests: Debian's ``postgresql`` package, a fresh cluster
(``initdb``) under a temporary directory, listening on a free loopback port (and a unix socket in
its own directory), password authentication (scram-sha-256) for the ``fleet`` role over TCP.

As root the server runs as the package's ``postgres`` user (``initdb`` refuses root), through
``runuser``. ``PgCluster.stop`` (``pg_ctl stop -m immediate``) and ``start`` let a test take the
database away mid-rollout and bring it back; the fixture that owns the cluster stops it and
removes its directory at the end, pass or fail.

Without the server's binaries the tests skip with the reason; with ``FLEET_LAB_REQUIRED=1`` (CI,
where ``scripts/install.sh`` installs ``postgresql``) they fail instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROLE = "fleet"
DATABASE = "fleet"


def pg_bin() -> Path | None:
    """The newest installed server's binaries (``/usr/lib/postgresql/<major>/bin``), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def require_postgres() -> Path:
    where = pg_bin()
    if where is not None:
        return where
    reason = "PostgreSQL's server is not installed (Debian: apt install postgresql; scripts/install.sh does)"
    if os.environ.get("FLEET_LAB_REQUIRED") == "1":
        pytest.fail(f"FLEET_LAB_REQUIRED=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgCluster:
    bin: Path
    root: Path  #: owned by the server's user: data/, the socket, the log
    port: int
    password: str  #: the ``fleet`` role's password (tests hand it over by reference only)
    run_as: str | None  #: "postgres" when the tests run as root

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """The journal URL: no password (it comes from ~/.pgpass or password_ref)."""
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{DATABASE}"

    def _cmd(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        full = ["runuser", "-u", self.run_as, "--", *argv] if self.run_as else list(argv)
        return subprocess.run(full, capture_output=True, text=True, check=check, timeout=timeout, cwd=self.root)

    def start(self) -> None:
        self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60",
                  "start")  # fmt: skip

    def running(self) -> bool:
        return self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "status", check=False).returncode == 0

    def stop(self) -> None:
        """Gone at once, as a server that crashed or a machine that lost power (``-m immediate``)."""
        self._cmd(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def superuser(self, sql: str) -> str:
        """Run ``sql`` as the cluster's superuser over its unix socket; its output."""
        out = self._cmd(str(self.bin / "psql"), "-h", str(self.root), "-p", str(self.port), "-U", "postgres",
                        "-d", DATABASE, "-v", "ON_ERROR_STOP=1", "-Atc", sql)  # fmt: skip
        return out.stdout.strip()

    def pgpass(self, home: Path) -> Path:
        """``HOME/.pgpass`` (0600) with the role's password, as an operator keeps it."""
        path = home / ".pgpass"
        path.write_text(f"127.0.0.1:{self.port}:*:{ROLE}:{self.password}\n")
        path.chmod(0o600)
        return path


@contextlib.contextmanager
def private_cluster() -> Iterator[PgCluster]:
    """A running cluster with a ``fleet`` role (password) owning a ``fleet`` database; stopped and
    removed at the end."""
    where = require_postgres()
    run_as = "postgres" if os.getuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
    if run_as:
        entry = pwd.getpwnam(run_as)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    cluster = PgCluster(where, root, free_port(), secrets.token_hex(16), run_as)
    try:
        cluster._cmd(str(where / "initdb"), "-D", str(cluster.data), "-U", "postgres", "--auth-local=trust",
                     "--auth-host=scram-sha-256", "-E", "UTF8", "--no-instructions")  # fmt: skip
        with (cluster.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {cluster.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{root}'\n"
                "max_connections = 40\nshared_buffers = 32MB\n"
            )
        cluster.start()
        cluster._cmd(str(where / "psql"), "-h", str(root), "-p", str(cluster.port), "-U", "postgres", "-d", "postgres",
                     "-v", "ON_ERROR_STOP=1", "-q", "-c", f"CREATE ROLE {ROLE} LOGIN PASSWORD '{cluster.password}'",
                     "-c", f"CREATE DATABASE {DATABASE} OWNER {ROLE}")  # fmt: skip
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
