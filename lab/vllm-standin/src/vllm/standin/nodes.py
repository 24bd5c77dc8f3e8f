"""One instance over several nodes (``--nnodes N --node-rank r --master-addr A --master-port P``),
as vLLM 0.33.0's multiprocessing backend runs it, at the boundaries fleet touches.

Mirrors, in vLLM 0.33.0:

* ``init_distributed_environment`` (``vllm/distributed/parallel_state.py``): with ``nnodes > 1``
  every rank joins the torch.distributed world at ``tcp://master_addr:master_port``
  (``get_distributed_init_method``); the store's server is global rank 0's, on node rank 0 (the
  leader), and the other ranks' clients retry connecting until torch's timeout
  (``default_pg_timeout``, 30 min: vLLM passes none). So the order the nodes start in does not
  matter, and the leader's engine core finishes its start (so its API server listens, ``run_server``
  in ``vllm/entrypoints/launchers/api_server/entry.py``) only once every node has joined;
* ``run_headless`` (``vllm/entrypoints/cli/serve.py``): a node with ``node_rank_within_dp > 0``
  (``--headless``) builds ``MultiprocExecutor(vllm_config, monitor_workers=False)`` and no API
  server (it serves no HTTP at all); its SIGTERM/SIGINT handler raises ``SystemExit``; when a local
  worker dies, ``start_worker_monitor(inline=True)`` shuts the executor down and returns, and
  ``run_headless`` returns: the process exits **0**;
* a node that dies ends the instance everywhere: on the leader the executor's next collective (or
  the process group) fails, the engine core reports a fatal error and exits 1 (``EngineCoreProc``
  in ``vllm/v1/engine/core.py``), and the API server's watchdog (``terminate_if_errored``) stops
  the server: exit **0**, as for any engine death; on a headless node the workers lose the world
  and die, and ``run_headless`` returns: exit **0**. So every node's unit needs ``Restart=always``.

What is the stand-in's own (said so in its log lines): the join is a small protocol of its own over
one TCP connection per headless node to ``master_addr:master_port``, not torch's TCPStore wire
format: ``JOIN <rank> <nnodes>\\n``; the leader answers ``GO\\n`` once every node joined and keeps
the connection open; its end (EOF, a reset) is the other node gone, noticed at once (vLLM notices
at the next collective, or at the process group's timeout when idle). torch's store binds every
address; the stand-in binds ``master_addr`` only, because lab hosts share one network namespace.
The KV cache is sized per node from the node's own GPUs (vLLM takes every rank's minimum).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Callable

from vllm.standin.log import StartupError, logger

#: torch.distributed's ``default_pg_timeout`` (``torch/distributed/constants.py``): 30 min.
DEFAULT_JOIN_TIMEOUT_SECONDS = 1800.0


def join_timeout() -> float:
    value = os.environ.get("FLEET_LAB_JOIN_TIMEOUT_SECONDS")
    return float(value) if value not in (None, "") else DEFAULT_JOIN_TIMEOUT_SECONDS


def _line(sock: socket.socket, deadline: float | None) -> str:
    """One ``\\n``-ended line from ``sock`` ('' at EOF or a reset)."""
    data = b""
    while not data.endswith(b"\n"):
        if deadline is not None:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1)
        except (ConnectionError, OSError):
            return ""
        if not chunk:
            return ""
        data += chunk
    sock.settimeout(None)
    return data.decode(errors="replace").strip()


class Store:
    """The leader's side: rank 0's store server on ``master_addr:master_port``."""

    def __init__(self, address: str, port: int, nnodes: int) -> None:
        self.address, self.port, self.nnodes = address, port, nnodes
        self.peers: dict[int, socket.socket] = {}
        self.closed = False
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.server = socket.socket(family, socket.SOCK_STREAM)
        # torch's c10d sockets set SO_REUSEADDR (torch/csrc/distributed/c10d/socket.cpp): the
        # connections a store closed (TIME_WAIT) do not keep a restarted leader from binding
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.server.bind((address, port))
            self.server.listen(nnodes)
        except OSError as exc:
            self.server.close()
            name = errno.errorcode.get(exc.errno or 0, "?")
            raise StartupError(
                "torch.distributed.DistNetworkError",
                f"The server socket has failed to listen on any local network address. port: {port}, "
                f"useIpv6: {str(family == socket.AF_INET6).lower()}, code: -{exc.errno}, name: {name}, "
                f"message: {exc.strerror}",
            ) from None
        logger.info("lab stand-in: torch.distributed store of %d node(s) on %s:%d", nnodes, address, port)

    def wait_all(self, timeout: float, stopping: Callable[[], bool] = lambda: False) -> None:
        """Until every other node joined (then each is told ``GO``); raises at the timeout."""
        deadline = time.monotonic() + timeout
        self.server.settimeout(0.2)
        while len(self.peers) < self.nnodes - 1:
            if stopping():
                raise StartupError("KeyboardInterrupt", "terminated")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.nnodes)) - set(self.peers))
                raise StartupError(
                    "torch.distributed.DistStoreError",
                    f"Timed out after {int(timeout)} seconds waiting for clients. {len(self.peers) + 1}/"
                    f"{self.nnodes} clients joined (node rank(s) {missing} missing).",
                )
            try:
                conn, peer = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                continue
            words = _line(conn, time.monotonic() + 5.0).split()
            if len(words) != 3 or words[0] != "JOIN" or not words[1].isdigit() or words[2] != str(self.nnodes):
                logger.warning("lab stand-in: %s sent %r, not a join of this instance; closed", peer, " ".join(words))
                conn.close()
                continue
            rank = int(words[1])
            if not 0 < rank < self.nnodes or rank in self.peers:
                logger.warning("lab stand-in: node rank %d from %s is not expected; closed", rank, peer)
                conn.close()
                continue
            self.peers[rank] = conn
            logger.info("lab stand-in: node rank %d joined from %s (%d/%d)", rank, peer[0], len(self.peers) + 1,
                        self.nnodes)  # fmt: skip
        for conn in self.peers.values():
            with contextlib.suppress(OSError):
                conn.sendall(b"GO\n")
        self.server.close()

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call ``on_lost(rank)`` once, from a thread, when a joined node's connection ends."""
        fired = threading.Event()

        def one(rank: int, conn: socket.socket) -> None:
            _line(conn, None)  # the peer sends nothing more: this returns at EOF or a reset
            if not self.closed and not fired.is_set():
                fired.set()
                on_lost(rank)

        for rank, conn in self.peers.items():
            threading.Thread(target=one, args=(rank, conn), daemon=True, name=f"NodeWatch{rank}").start()

    def close(self) -> None:
        self.closed = True
        for conn in self.peers.values():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        with contextlib.suppress(OSError):
            self.server.close()


def join(address: str, port: int, rank: int, nnodes: int, timeout: float) -> socket.socket:
    """A headless node's side: connect to the leader's store (retrying, as torch's client does, until
    ``timeout``), join, and wait until every node has joined. Returns the open connection."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=min(5.0, max(0.1, deadline - time.monotonic())))
        except OSError as exc:
            last = f"{errno.errorcode.get(exc.errno or 0, type(exc).__name__)}: {exc.strerror or exc}"
            if time.monotonic() > deadline:
                raise StartupError(
                    "torch.distributed.DistNetworkError",
                    f"The client socket has timed out after {int(timeout * 1000)}ms while trying to connect to "
                    f"({address}, {port}). ({last})",
                ) from None
            time.sleep(0.5)
            continue
        sock.settimeout(None)
        try:
            sock.sendall(f"JOIN {rank} {nnodes}\n".encode())
        except OSError:
            sock.close()
            time.sleep(0.5)
            continue
        answer = _line(sock, deadline)
        if answer == "GO":
            logger.info("lab stand-in: joined the torch.distributed world at %s:%d as node rank %d", address, port,
                        rank)  # fmt: skip
            return sock
        sock.close()
        if time.monotonic() > deadline:
            raise StartupError(
                "torch.distributed.DistStoreError",
                f"Timed out after {int(timeout)} seconds waiting for the other nodes at ({address}, {port}).",
            )
        time.sleep(0.5)  # the leader went away before every node joined: it comes back, or the timeout ends it


def wait_closed(sock: socket.socket, stop: threading.Event) -> bool:
    """Block until the leader's connection ends (True) or ``stop`` is set (False)."""
    ended = threading.Event()

    def read() -> None:
        _line(sock, None)
        ended.set()

    threading.Thread(target=read, daemon=True, name="LeaderWatch").start()
    while not stop.is_set():
        if ended.wait(0.1):
            return True
    return False
