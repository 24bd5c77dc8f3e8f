"""GPU workers: the part of vLLM that holds GPU memory, in-process (TP 1) or one process per rank.

Like vLLM 0.33.0's executors (``vllm/config/parallel.py`` picks ``uni`` when the world size is
1, ``mp`` otherwise):

* **TP×PP = 1** (``UniProcExecutor``): the worker lives inside the ``VLLM::EngineCore`` process,
  so the engine core's pid is the one NVML lists as holding the GPU.
* **TP×PP > 1** (``MultiprocExecutor``, ``vllm/v1/executor/multiproc_executor.py``): one process
  per rank, titled ``VLLM::Worker_TP<rank>`` (``WorkerProc.setup_proc_title_and_log_prefix``),
  child of the engine core. Each watches the engine core through a *death pipe*
  (``monitor_death_pipe``): when the engine core dies the pipe reaches EOF and the worker exits.
  A worker raises ``SystemExit`` on its own SIGTERM (``WorkerProc.worker_main``'s
  ``signal_handler``).

A worker "holds" memory by writing ``<pid>.mem`` (one line ``<nvml_index> <bytes>``) into the
NVML shim's live-state directory (``$FLEET_NVML_STATE_DIR``, default ``/run/fleet-lab/nvml``);
the shim counts it as used memory and a compute process while the pid is alive. The file is
replaced atomically and removed when the worker exits normally; a SIGKILLed worker leaves a
stale file that the shim ignores (dead pid).

Memory follows ``Worker.init_device`` (``vllm/v1/worker/gpu_worker.py``): CUDA context, NCCL
(TP > 1) and cuBLAS handles first, then the snapshot and ``request_memory``; then the weights;
then the KV cache up to the requested budget.

The engine core talks to a worker process over the worker's stdin/stdout, one JSON object a line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from vllm.standin import gpus, log, memory
from vllm.standin.log import StartupError, logger
from vllm.standin.proctitle import set_process_title

DEFAULT_STATE_DIR = "/run/fleet-lab/nvml"


def state_dir() -> Path:
    return Path(os.environ.get("FLEET_NVML_STATE_DIR") or DEFAULT_STATE_DIR)


class MemFile:
    """This process's ``<pid>.mem`` in the shim's state directory."""

    def __init__(self, directory: Path, nvml_index: int) -> None:
        self.path = directory / f"{os.getpid()}.mem"
        self.nvml_index = nvml_index

    def hold(self, nbytes: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{os.getpid()}.mem.tmp")
        tmp.write_text(f"{self.nvml_index} {int(nbytes)}\n")
        # What the driver accounts is visible to every user through NVML (nvidia-smi as any user),
        # whatever the unit's UMask: readable by all, like the driver's own state.
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class GpuMemory:
    """One rank's GPU memory, held by the current process."""

    def __init__(self, rank: int, cuda_index: int, nvml_index: int, utilization: float, world_size: int) -> None:
        self.rank = rank
        self.cuda_index = cuda_index
        self.nvml_index = nvml_index
        self.utilization = utilization
        self.baseline = memory.baseline_bytes(world_size)
        self.mem = MemFile(state_dir(), nvml_index)
        self.requested = 0
        self.total = 0

    def init_device(self) -> int:
        """Context + NCCL + cuBLAS, then the snapshot and ``request_memory``; the requested bytes."""
        pynvml = gpus.nvml_init()
        self.mem.hold(self.baseline)
        gpu = gpus.gpu_info(pynvml, self.nvml_index, self.cuda_index)
        self.total = gpu.total
        self.requested = memory.check_free_memory(gpu, self.utilization)
        return self.requested

    def load_weights(self, weights: int) -> None:
        self.mem.hold(self.baseline + min(weights, self.requested))

    def allocate(self, nbytes: int) -> None:
        """The KV cache is allocated: the process holds its baseline plus ``nbytes``."""
        self.mem.hold(self.baseline + nbytes)

    def release(self) -> None:
        self.mem.release()


# -- the worker process (TP×PP > 1) -------------------------------------------------------------


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _watch_death_pipe(fd: int, gpu: GpuMemory) -> None:
    """``WorkerProc.monitor_death_pipe``: block on the pipe; EOF means the engine core is gone."""
    with contextlib.suppress(OSError):
        while os.read(fd, 1):
            pass
    logger.info("Parent process exited, terminating worker queues")
    gpu.release()
    os._exit(0)


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process (``python -m vllm.standin.worker``)."""
    parser = argparse.ArgumentParser(prog="vllm-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--cuda-index", type=int, required=True)
    parser.add_argument("--nvml-index", type=int, required=True)
    parser.add_argument("--utilization", type=float, required=True)
    parser.add_argument("--death-fd", type=int, required=True)
    opts = parser.parse_args(argv)

    name = f"Worker_TP{opts.rank}"
    log.setup(name)
    set_process_title(name)
    gpu = GpuMemory(opts.rank, opts.cuda_index, opts.nvml_index, opts.utilization, opts.world_size)
    shutdown_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not shutdown_requested.is_set():
            shutdown_requested.set()
            raise SystemExit()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=_watch_death_pipe, args=(opts.death_fd, gpu), daemon=True,
                     name="DeathPipeMonitor").start()  # fmt: skip
    out = sys.stdout
    try:
        for line in sys.stdin:
            command = json.loads(line)
            cmd = command.get("cmd")
            try:
                if cmd == "init":
                    requested = gpu.init_device()
                    _send(out, {"ok": True, "requested": requested, "total": gpu.total})
                elif cmd == "load":
                    gpu.load_weights(int(command["weights"]))
                    _send(out, {"ok": True})
                elif cmd == "allocate":
                    logger.info("Available KV cache memory: %s GiB", memory.format_gib(int(command["available"])))
                    gpu.allocate(int(command["bytes"]))
                    _send(out, {"ok": True})
            except StartupError as err:
                logger.error("WorkerProc failed to start.")
                log.print_startup_error(err)
                _send(out, {"error": err.kind, "message": err.message})
                return 1
        # stdin closed without the death pipe closing: wait for the death pipe or a signal.
        while True:
            time.sleep(3600)
    finally:
        gpu.release()


class WorkerHandle:
    """The engine core's side of one worker process."""

    def __init__(self, rank: int, world_size: int, gpu: gpus.Gpu, utilization: float) -> None:
        self.rank = rank
        self.gpu = gpu
        death_read, self.death_write = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.standin.worker",
                f"--rank={rank}",
                f"--world-size={world_size}",
                f"--cuda-index={gpu.cuda_index}",
                f"--nvml-index={gpu.nvml_index}",
                f"--utilization={utilization}",
                f"--death-fd={death_read}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            pass_fds=(death_read,),
        )
        os.close(death_read)  # the worker holds the read end; we keep the write end until we die

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def name(self) -> str:
        return f"VllmWorker-{self.rank}"

    def call(self, message: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise StartupError("RuntimeError", f"Worker TP{self.rank} (pid {self.pid}) died during startup: {code}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise StartupError(str(reply["error"]), str(reply["message"]))
        return reply

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
        with contextlib.suppress(OSError):
            os.close(self.death_write)


if __name__ == "__main__":
    raise SystemExit(worker_main())
