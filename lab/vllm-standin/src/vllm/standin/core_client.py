"""The API server's handle on the ``VLLM::EngineCore`` process.

Mirrors, in vLLM 0.33.0:

* ``CoreEngineProcManager`` and ``wait_for_engine_startup`` (``vllm/v1/engine/utils.py``): the
  engine core is a child process; if it exits before it is ready the API server raises
  ``RuntimeError: Engine core initialization failed. See root cause above. Failed core
  proc(s): {'EngineCore': 1}``;
* ``MPClient``'s ``monitor_engine_cores`` (``vllm/v1/engine/core_client.py``): an engine core
  that exits while serving marks the engine dead (``/health`` 503 from then on);
* ``shutdown(procs, timeout)`` (``vllm/v1/utils.py``): SIGTERM to the engine core, wait up to the
  timeout (``--shutdown-timeout``; 0 waits not at all, see
  ``get_engine_process_shutdown_timeout``), then ``kill_process_tree``
  (``vllm/utils/system_utils.py``): SIGKILL to every descendant, then to the engine core.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm.standin.engine_core import PROCESS_NAME
from vllm.standin.log import StartupError, logger
from vllm.standin.worker import state_dir


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_process_tree(pid: int) -> None:
    """``kill_process_tree``: SIGKILL all descendants, then the process itself.

    A real driver frees a killed process's memory; here the killed processes' ``<pid>.mem``
    records are removed too, so a later process that reuses a pid is not taken for a holder.
    """
    killed = descendants(pid)
    for child in killed:
        with contextlib.suppress(ProcessLookupError):
            logger.warning("[shutdown] force killing sub process pid %d", child)
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for gone in [pid, *killed]:
        with contextlib.suppress(OSError):
            (state_dir() / f"{gone}.mem").unlink()


class EngineCoreClient:
    """Start, watch and stop the engine core process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.standin.engine_core"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.stopping = False
        self._lock = threading.Lock()
        self._send(config)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self._lock, contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()

    def wait_ready(self) -> dict[str, Any]:
        """The engine core's ready message; ``RuntimeError`` if it exited first.

        The wait is in short slices so a signal handler's exception (SIGTERM while loading
        raises ``KeyboardInterrupt``) interrupts it.
        """
        assert self.proc.stdout is not None
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise StartupError(
                    "RuntimeError",
                    "Engine core initialization failed. See root cause above. "
                    f"Failed core proc(s): {{{PROCESS_NAME!r}: {code}}}",
                )
            message = json.loads(line)
            if "ready" in message:
                result: dict[str, Any] = message["ready"]
                return result

    def monitor(self, on_death: Callable[[], None]) -> None:
        """Call ``on_death`` once if the engine core exits while we did not ask it to."""

        def watch() -> None:
            assert self.proc.stdout is not None
            with contextlib.suppress(OSError, ValueError):
                while self.proc.stdout.readline():
                    pass
            self.proc.wait()
            if not self.stopping:
                logger.warning("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
                on_death()

        threading.Thread(target=watch, daemon=True, name="MPClientEngineMonitor").start()

    def report_unfinished(self, count: int) -> None:
        self._send({"cmd": "unfinished", "n": count})

    def inject_fatal(self, kind: str, message: str) -> None:
        self._send({"cmd": "fatal", "kind": kind, "message": message})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout: float, unfinished: Callable[[], int] | None = None) -> None:
        """SIGTERM, wait up to ``timeout`` s (reporting unfinished requests), then kill the tree."""
        self.stopping = True
        if self.alive():
            logger.info("[shutdown] Process manager: send sigterm to process %s", PROCESS_NAME)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            self.report_unfinished(unfinished() if unfinished is not None else 0)
            time.sleep(0.05)
        if self.alive():
            logger.warning("[shutdown] Process manager: force killing remaining processes count=1")
            logger.warning("[shutdown] Process manager: force killing remaining process %s pid %d",
                           PROCESS_NAME, self.pid)  # fmt: skip
            kill_process_tree(self.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
