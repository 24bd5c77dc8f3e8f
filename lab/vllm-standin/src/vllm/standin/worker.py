"""GPU worker processes: one per TP×PP rank, each "holding" its GPU's memory.

A worker holds memory by writing ``<its pid>.mem`` (one line ``<nvml_index> <bytes>``) into the
NVML shim's live-state directory (``$FLEET_NVML_STATE_DIR``, default ``/run/fleet-lab/nvml``);
the shim counts the file as used memory and a compute process while the pid is alive. The file
is replaced atomically (temp name, then rename) and removed when the worker exits normally. A
SIGKILLed worker leaves a stale file that the shim ignores because the pid is dead.

Like vLLM's multiprocessing workers:

* a worker checks its own GPU's free memory at init (vLLM's ``request_memory``);
* a worker exits at once on its own SIGTERM (``SystemExit``), releasing its memory;
* a worker does **not** watch its parent: if the API server is SIGKILLed the workers stay, as
  orphans that keep the GPU memory (vllm#55510). That is what systemd ``KillMode`` must handle.

Parent and worker talk over the worker's stdin/stdout, one JSON object per line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from vllm.standin import gpus, log
from vllm.standin.log import StartupError

DEFAULT_STATE_DIR = "/run/fleet-lab/nvml"


def state_dir() -> Path:
    return Path(os.environ.get("FLEET_NVML_STATE_DIR") or DEFAULT_STATE_DIR)


def _set_comm(name: str) -> None:
    """Set the kernel thread name (what ``ps -o comm`` shows), as vLLM's setproctitle does."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


class MemFile:
    """This process's ``<pid>.mem`` in the shim's state directory."""

    def __init__(self, directory: Path, nvml_index: int) -> None:
        self.path = directory / f"{os.getpid()}.mem"
        self.nvml_index = nvml_index

    def hold(self, nbytes: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{os.getpid()}.mem.tmp")
        tmp.write_text(f"{self.nvml_index} {int(nbytes)}\n")
        os.replace(tmp, self.path)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process (``python -m vllm.standin.worker``)."""
    parser = argparse.ArgumentParser(prog="vllm-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--cuda-index", type=int, required=True)
    parser.add_argument("--nvml-index", type=int, required=True)
    parser.add_argument("--utilization", type=float, required=True)
    parser.add_argument("--weights", type=int, required=True)
    opts = parser.parse_args(argv)

    name = f"VllmWorker TP{opts.rank}"
    logger = log.setup(name)
    _set_comm(f"VLLM::Worker_TP{opts.rank}")
    mem = MemFile(state_dir(), opts.nvml_index)

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    out = sys.stdout
    try:
        try:
            pynvml = gpus.nvml_init()
            gpu = gpus.gpu_info(pynvml, opts.nvml_index, opts.cuda_index)
            from vllm.standin.memory import check_free_memory

            requested = check_free_memory(gpu, opts.utilization)
        except StartupError as err:
            _send(out, {"error": err.kind, "message": err.message})
            return 1
        mem.hold(min(opts.weights, requested))  # weights arrive first
        _send(out, {"ok": True, "pid": os.getpid(), "requested": requested, "total": gpu.total})
        logger.info("Worker rank %d on cuda:%d (NVML %d, %s)", opts.rank, gpu.cuda_index, gpu.nvml_index, gpu.name)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("cmd") == "allocate":
                mem.hold(int(command["bytes"]))
                _send(out, {"ok": True})
            elif command.get("cmd") == "exit":
                return 0
        # stdin closed: the parent is gone. vLLM's workers do not notice; neither do we.
        while True:
            signal.pause()
    finally:
        mem.release()


class WorkerHandle:
    """The API server's side of one worker process."""

    def __init__(self, rank: int, gpu: gpus.Gpu, utilization: float, weights: int) -> None:
        self.rank = rank
        self.gpu = gpu
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.standin.worker",
                f"--rank={rank}",
                f"--cuda-index={gpu.cuda_index}",
                f"--nvml-index={gpu.nvml_index}",
                f"--utilization={utilization}",
                f"--weights={weights}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.requested = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise StartupError("RuntimeError", f"Worker TP{self.rank} (pid {self.pid}) died during startup: {code}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise StartupError(str(reply["error"]), str(reply["message"]))
        return reply

    def wait_ready(self, timeout: float = 60.0) -> int:
        """Wait for the worker's init; returns the bytes it requested (raises its error)."""
        reply = self._reply(timeout)
        self.requested = int(reply["requested"])
        return self.requested

    def allocate(self, nbytes: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "allocate", "bytes": nbytes}) + "\n")
        self.proc.stdin.flush()
        self._reply(30.0)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it does not go within ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()


if __name__ == "__main__":
    raise SystemExit(worker_main())
