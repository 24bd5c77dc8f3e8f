"""The ``VLLM::EngineCore`` process: owns the executor (and so the GPU memory) and its lifetime.

Mirrors ``EngineCoreProc.run_engine_core`` in ``vllm/v1/engine/core.py`` (vLLM 0.33.0):

* titled ``VLLM::EngineCore`` (``set_process_title("EngineCore")`` without data parallelism);
* SIGTERM/SIGINT only *record* a shutdown request (``signal_handler``: ``[shutdown] EngineCore:
  trigger received signal=SIGTERM``); ``_handle_shutdown`` then logs ``start mode=drain|abort``
  and the core leaves its busy loop once no request is unfinished, tearing the executor down;
* it does **not** watch the API server: if the API server dies (even SIGKILL) the engine core
  and its workers stay, holding GPU memory, until someone kills them;
* a worker that dies is a fatal executor failure (``MultiprocExecutor``'s ``monitor_workers``:
  ``Worker proc ... died unexpectedly``), as is a fatal error the lab injects (a crash, or a
  TP > 1 step past ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``): ``EngineCore encountered a fatal
  error.``, the executor is shut down, exit 1;
* a failure while starting is logged as ``EngineCore failed to start.`` with its traceback; the
  API server then raises ``RuntimeError: Engine core initialization failed...``.

The scheduler itself is simulated in the API server process (``engine.py``); the API server
tells the engine core how many requests are unfinished so it knows when a drain is done. The
two talk over the engine core's stdin/stdout, one JSON object a line (vLLM uses ZMQ sockets).
"""

from __future__ import annotations

import json
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.standin import gpus, log, memory, nodes
from vllm.standin.log import StartupError, logger, print_startup_error
from vllm.standin.proctitle import set_process_title
from vllm.standin.worker import GpuMemory, WorkerHandle

PROCESS_NAME = "EngineCore"


@dataclass
class Config:
    """What the API server hands the engine core (``VllmConfig``, in short)."""

    gpus: list[dict[str, int]]
    utilization: float
    plan: dict[str, Any]
    shutdown_timeout: int
    load_seconds: float
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    model_error: list[str] | None = None  #: ``[kind, message]`` raised while building the model
    load_error: list[str] | None = None  #: ``[kind, message]`` raised while loading weights
    #: the leader of an instance over several nodes (``nodes.py``): ``nnodes``, ``master_addr``,
    #: ``master_port``, ``join_timeout``; None: one node
    nodes: dict[str, Any] | None = None


class Executor:
    """``UniProcExecutor`` (world size 1: in this process) or ``MultiprocExecutor``."""

    def __init__(self, config: Config) -> None:
        world = len(config.gpus)
        self.local: GpuMemory | None = None
        self.workers: list[WorkerHandle] = []
        self.shutting_down = False
        if world == 1:
            g = config.gpus[0]
            self.local = GpuMemory(0, g["cuda_index"], g["nvml_index"], config.utilization, 1)
        else:
            for rank, g in enumerate(config.gpus):
                gpu = gpus.Gpu(g["cuda_index"], g["nvml_index"], "", "", 0, 0, (9, 0))
                self.workers.append(WorkerHandle(rank, world, gpu, config.utilization))

    def init_device(self) -> list[int]:
        if self.local is not None:
            return [self.local.init_device()]
        return [int(w.call({"cmd": "init"})["requested"]) for w in self.workers]

    def load_weights(self, weights: int) -> None:
        if self.local is not None:
            self.local.load_weights(weights)
        for w in self.workers:
            w.call({"cmd": "load", "weights": weights})

    def allocate(self, hold: int, available: list[int]) -> None:
        if self.local is not None:
            logger.info("Available KV cache memory: %s GiB", memory.format_gib(available[0]))
            self.local.allocate(hold)
        for w, avail in zip(self.workers, available if self.workers else [], strict=True):
            w.call({"cmd": "allocate", "bytes": hold, "available": avail})

    def dead_worker(self) -> WorkerHandle | None:
        return next((w for w in self.workers if not w.alive()), None)

    def shutdown(self) -> None:
        self.shutting_down = True
        for w in self.workers:
            w.stop()
        if self.local is not None:
            self.local.release()


@dataclass
class State:
    shutdown: threading.Event = field(default_factory=threading.Event)
    signal_name: str = ""
    unfinished: int = 0
    reports: int = 0  #: how many counts the API server sent
    eof: bool = False  #: the API server is gone: nobody is waiting for an answer
    fatal: list[str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _read_commands(state: State) -> None:
    """Commands from the API server. At EOF (API server gone) the engine core carries on."""
    for line in sys.stdin:
        with state.lock:
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if command.get("cmd") == "unfinished":
                state.unfinished = int(command["n"])
                state.reports += 1
            elif command.get("cmd") == "fatal":
                state.fatal = [str(command["kind"]), str(command["message"])]
    with state.lock:
        state.eof = True


def _send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _interruptible_sleep(seconds: float, state: State) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not state.shutdown.is_set():
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def start_engine(config: Config, executor: Executor, state: State) -> memory.Plan:
    """The engine core's start after the world is formed: devices, weights, KV cache (also a
    headless node's, ``serve.Headless``)."""
    requested = executor.init_device()
    plan = memory.Plan(**config.plan)
    if config.model_error:
        raise StartupError(*config.model_error)
    if config.load_error:
        raise StartupError(*config.load_error)
    executor.load_weights(plan.weight_bytes)
    _interruptible_sleep(config.load_seconds, state)
    logger.info("Loading weights took %.2f seconds", config.load_seconds)
    logger.info("Model loading took %.4f GiB memory", plan.weight_bytes / memory.GiB)
    memory.size_kv_cache(plan, requested, config.kv_cache_memory_bytes, config.num_gpu_blocks_override)
    assert plan.max_model_len is not None
    overhead = plan.weight_bytes + plan.non_kv_bytes + plan.cudagraph_bytes
    if config.kv_cache_memory_bytes is not None:
        hold = overhead + int(config.kv_cache_memory_bytes)
        available = [int(config.kv_cache_memory_bytes)] * len(requested)
    else:
        hold = plan.requested
        available = [r - overhead for r in requested]
    executor.allocate(hold, available)
    logger.info(
        "GPU KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
        f"{plan.kv_tokens:,}", f"{plan.max_model_len:,}", plan.max_concurrency,
    )  # fmt: skip
    return plan


def run(config: Config) -> int:
    state = State()

    def on_signal(signum: int, frame: object) -> None:
        state.signal_name = signal.Signals(signum).name
        logger.info("[shutdown] EngineCore: trigger received signal=%s", state.signal_name)
        state.shutdown.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    executor = Executor(config)
    store: nodes.Store | None = None
    try:
        if config.nodes is not None:  # init_device → init_distributed_environment: every node joins first
            n = config.nodes
            store = nodes.Store(str(n["master_addr"]), int(n["master_port"]), int(n["nnodes"]))
            store.wait_all(float(n["join_timeout"]), stopping=state.shutdown.is_set)
        plan = start_engine(config, executor, state)
    except StartupError as err:
        logger.error("EngineCore failed to start.")
        print_startup_error(err)
        executor.shutdown()
        if store is not None:
            store.close()
        return 1
    if store is not None:

        def lost(rank: int) -> None:
            with state.lock:
                state.fatal = [
                    "RuntimeError",
                    f"node rank {rank} left the torch.distributed world (lab stand-in: its connection to the "
                    "store closed); the collectives of this instance cannot go on",
                ]

        store.watch(lost)
    _send({"ready": {"max_model_len": plan.max_model_len, "num_blocks": plan.num_blocks,
                     "available_kv": plan.available_kv, "requested": plan.requested}})  # fmt: skip
    threading.Thread(target=_read_commands, args=(state,), daemon=True, name="EngineCoreInput").start()

    mode_logged = False
    reports_at_signal = 0
    try:
        while True:
            time.sleep(0.05)
            dead = executor.dead_worker()
            if dead is not None and not executor.shutting_down:
                logger.error(
                    "Worker proc %s died unexpectedly (exit code: %s), shutting down executor.",
                    dead.name, dead.proc.returncode,
                )  # fmt: skip
                executor.shutdown()
                logger.error("EngineCore encountered a fatal error.")
                print_startup_error(StartupError("RuntimeError", "Executor failed."))
                return 1
            with state.lock:
                fatal, unfinished, reports, eof = state.fatal, state.unfinished, state.reports, state.eof
            if fatal is not None:
                logger.error("EngineCore encountered a fatal error.")
                print_startup_error(StartupError(*fatal))
                executor.shutdown()
                return 1
            if state.shutdown.is_set():
                if not mode_logged:
                    mode = "abort" if config.shutdown_timeout == 0 else "drain"
                    logger.info("[shutdown] EngineCore: start mode=%s timeout=%ds", mode, config.shutdown_timeout)
                    if unfinished and mode == "drain":
                        logger.info(
                            "[shutdown] EngineCore: draining in-flight requests count=%d timeout=%ds",
                            unfinished, config.shutdown_timeout,
                        )  # fmt: skip
                    mode_logged = True
                    reports_at_signal = reports
                # Done once a count sent after the signal says nothing is left (the scheduler
                # runs in the API server), or when the API server is gone.
                if (unfinished == 0 and reports > reports_at_signal) or eof:
                    logger.info("[shutdown] EngineCore: request processing complete; starting resource teardown")
                    executor.shutdown()
                    logger.info("[shutdown] EngineCore: exiting busy loop")
                    return 0
    finally:
        executor.shutdown()
        if store is not None:
            store.close()


def main() -> int:
    log.setup(PROCESS_NAME)
    set_process_title(PROCESS_NAME)
    ready, _, _ = select.select([sys.stdin], [], [], 60)
    line = sys.stdin.readline() if ready else ""
    if not line:
        return 1
    return run(Config(**json.loads(line)))


if __name__ == "__main__":
    raise SystemExit(main())
