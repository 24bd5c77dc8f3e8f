"""``vllm serve``: start-up sequence, serving loop, watchdog and SIGTERM shutdown.

Start-up follows vLLM 0.33 (vllm.md §4.1):

1. bind the port (no ``listen()``), so the port is taken but connections are refused;
2. build the config: model, ``--max-model-len`` limit, world size vs GPUs, heads vs TP;
3. start one worker per rank; each checks free memory on its GPU and holds the weights;
4. "load" for ``load_seconds`` (fault file > ``$FLEET_LAB_LOAD_SECONDS`` > weights per GPU in
   GiB × ``LOAD_SECONDS_PER_GIB`` + ``LOAD_BASE_SECONDS``, ~2 s for an 8B model on one GPU);
5. size the KV cache (errors as vLLM), workers grow to the requested memory, log the sizes;
6. ``listen()``: ``/health`` answers 200.

Shutdown on SIGTERM/SIGINT (§4.4): ``--shutdown-timeout 0`` aborts in-flight requests at once;
``N > 0`` rejects new requests (503) and lets in-flight ones finish for up to N seconds, then
aborts the rest. Then the listener closes, workers get SIGTERM and the process exits 0. A
second signal cuts a drain short. If the engine dies (fault, or a worker exits) ``/health``
answers 503 and the watchdog exits the process with status 1 after
``$FLEET_LAB_WATCHDOG_SECONDS`` (default 5, vLLM's watchdog period).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from vllm.standin import faults as faults_mod
from vllm.standin import gpus as gpus_mod
from vllm.standin import memory, model
from vllm.standin.args import model_of
from vllm.standin.engine import Engine
from vllm.standin.log import StartupError, logger, print_startup_error
from vllm.standin.memory import GiB
from vllm.standin.server import App, make_server, start_serving
from vllm.standin.worker import WorkerHandle
from vllm.version import __version__

LOAD_SECONDS_PER_GIB = 0.1
LOAD_BASE_SECONDS = 0.5
DEFAULT_TOKEN_SECONDS = 0.005
DEFAULT_PREFILL_SECONDS_PER_TOKEN = 0.0002
SECRET_ARGS = ("api_key",)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


class Stop:
    """Signals received: the first asks for a shutdown, a second one forces it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.count = 0

    def handler(self, signum: int, frame: object) -> None:
        self.count += 1
        self.event.set()


def _non_default_args(args: argparse.Namespace, parser_defaults: dict[str, object]) -> dict[str, object]:
    shown: dict[str, object] = {}
    for key, value in sorted(vars(args).items()):
        if key in parser_defaults and parser_defaults[key] != value:
            shown[key] = "<redacted>" if key in SECRET_ARGS else value
    return shown


class Serve:
    """One ``vllm serve`` process."""

    def __init__(self, args: argparse.Namespace, defaults: dict[str, object]) -> None:
        self.args = args
        self.defaults = defaults
        self.workers: list[WorkerHandle] = []
        self.stop = Stop()

    # -- start-up ----------------------------------------------------------------------
    def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep; ``True`` if a stop signal arrived meanwhile."""
        return self.stop.event.wait(seconds)

    def run(self) -> int:
        args = self.args
        signal.signal(signal.SIGTERM, self.stop.handler)
        signal.signal(signal.SIGINT, self.stop.handler)
        logger.info("vLLM API server version %s", __version__)
        logger.info("non-default args: %s", _non_default_args(args, self.defaults))
        try:
            return self._run()
        except StartupError as err:
            self._stop_workers()
            print_startup_error(err)
            return 1
        finally:
            self._stop_workers()

    def _run(self) -> int:
        args = self.args
        for unsupported in ("data_parallel_size", "nnodes"):
            if int(getattr(args, unsupported) or 1) > 1:
                raise StartupError(
                    "NotImplementedError", f"--{unsupported.replace('_', '-')} > 1: not in the lab stand-in"
                )
        if args.headless:
            raise StartupError("NotImplementedError", "--headless is not implemented by the lab stand-in")
        if args.model_tag is None and args.model != self.defaults.get("model"):
            logger.warning("The `--model` option will be removed in a future version. Use `vllm serve MODEL`.")
        name = model_of(args)
        server, url = make_server(args.host, int(args.port), args.uds)
        faults = faults_mod.read_faults()
        for problem in faults.problems:
            logger.warning("Ignoring fault file: %s", problem)

        model_dir = model.resolve_model_dir(name, args.revision)
        arch = model.read_arch(model_dir)
        allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() in ("1", "true")
        max_len = memory.check_max_model_len(arch, args.max_model_len, allow_long)
        visible = gpus_mod.visible_gpus()
        tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
        memory.check_parallel(arch, tp, pp, len(visible))
        used = visible[: tp * pp]
        plan = memory.make_plan(args, arch, used, max_len)
        served = (args.served_model_name or [name])[0]
        logger.info(
            "Initializing engine (v0.33.0 lab stand-in) with config: model=%r, dtype=%s, max_seq_len=%s, "
            "tensor_parallel_size=%d, pipeline_parallel_size=%d, served_model_name=%s",
            name, plan.model_dtype, plan.max_model_len, tp, pp, served,
        )  # fmt: skip

        util = plan.utilization
        self.workers = [WorkerHandle(rank, gpu, util, plan.weight_bytes) for rank, gpu in enumerate(used)]
        requested = [w.wait_ready() for w in self.workers]
        for w in self.workers:
            logger.info(
                "Worker TP%d pid=%d on cuda:%d (NVML index %d)", w.rank, w.pid, w.gpu.cuda_index, w.gpu.nvml_index
            )

        memory.check_kv_heads(arch, tp)
        if faults.fails_load(name, str(model_dir), served):
            raise StartupError(
                "safetensors_rust.SafetensorError",
                "Error while deserializing header: MetadataIncompleteBuffer (fault injected by the fleet lab)",
            )
        default_load = LOAD_BASE_SECONDS + LOAD_SECONDS_PER_GIB * plan.weight_bytes / GiB
        load_seconds = faults.load_seconds
        if load_seconds is None:
            load_seconds = _env_float("FLEET_LAB_LOAD_SECONDS", default_load)
        if self._sleep_or_stop(load_seconds):
            logger.info("[shutdown] Interrupted during start-up; stopping workers")
            return 0
        logger.info("Loading weights took %.2f seconds", load_seconds)
        logger.info("Model loading took %.4f GiB memory", plan.weight_bytes / GiB)

        memory.size_kv_cache(plan, requested, args.kv_cache_memory_bytes, args.num_gpu_blocks_override)
        assert plan.max_model_len is not None
        hold = plan.requested
        if args.kv_cache_memory_bytes is not None:
            hold = plan.weight_bytes + plan.non_kv_bytes + plan.cudagraph_bytes + int(args.kv_cache_memory_bytes)
        for w in self.workers:
            w.allocate(hold)
        logger.info("Available KV cache memory: %.2f GiB", plan.available_kv / GiB)
        logger.info(
            "GPU KV cache size: %s tokens, Maximum concurrency for %s tokens per request: %.2fx",
            f"{plan.kv_tokens:,}", f"{plan.max_model_len:,}", plan.max_concurrency,
        )  # fmt: skip
        return self._serve(server, url, plan, served, str(model_dir if name != str(model_dir) else name), faults)

    # -- serving -----------------------------------------------------------------------
    def _serve(
        self,
        server: object,
        url: str,
        plan: memory.Plan,
        served: str,
        root: str,
        faults: faults_mod.Faults,
    ) -> int:
        args = self.args
        assert plan.max_model_len is not None
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
        keys = list(args.api_key or [])
        if not keys and os.environ.get("VLLM_API_KEY"):
            keys = [os.environ["VLLM_API_KEY"]]
        cache_info = {
            "block_size": str(plan.block_size),
            "cache_dtype": str(args.kv_cache_dtype),
            "enable_prefix_caching": str(args.enable_prefix_caching is not False),
            "gpu_memory_utilization": str(plan.utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(plan.num_blocks),
        }
        app = App(engine, served, root, plan.max_model_len, keys, cache_info,
                  access_log=not args.disable_uvicorn_access_log)  # fmt: skip
        from http.server import ThreadingHTTPServer

        assert isinstance(server, ThreadingHTTPServer)
        start_serving(server, app)
        logger.info("Starting vLLM server on %s", url)
        logger.info("Application startup complete.")
        ready_at = time.monotonic()

        watchdog = _env_float("FLEET_LAB_WATCHDOG_SECONDS", 5.0)
        crash_at = ready_at + faults.crash_after_seconds if faults.crash_after_seconds is not None else None
        dead_since: float | None = None
        next_fault_read = time.monotonic() + 1.0
        while True:
            if self.stop.event.wait(0.1):
                return self._shutdown(server, app)
            now = time.monotonic()
            if now >= next_fault_read:
                next_fault_read = now + 1.0
                current = faults_mod.read_faults()
                engine.hung = current.hang_after_load
                if crash_at is None and current.crash_after_seconds is not None:
                    crash_at = now + current.crash_after_seconds
            if dead_since is None:
                if crash_at is not None and now >= crash_at:
                    logger.error("EngineCore encountered a fatal error (fault injected by the fleet lab).")
                    engine.kill()
                    dead_since = now
                for w in self.workers:
                    if not w.alive():
                        logger.error("Worker proc VllmWorker-%d died unexpectedly, shutting down executor.", w.rank)
                        engine.kill()
                        dead_since = now
                        break
            elif now - dead_since >= watchdog:
                logger.error("Engine core is dead; the API server shuts down (watchdog).")
                server.shutdown()
                server.server_close()
                self._stop_workers()
                sys.stderr.write("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
                return 1

    def _shutdown(self, server: object, app: App) -> int:
        from http.server import ThreadingHTTPServer

        assert isinstance(server, ThreadingHTTPServer)
        timeout = int(self.args.shutdown_timeout or 0)
        mode = "drain" if timeout > 0 else "abort"
        logger.info("[shutdown] API server: stopping engine client mode=%s timeout=%ds", mode, timeout)
        app.shutting_down = True
        app.engine.rejecting = True
        if timeout > 0:
            logger.info("[shutdown] Engine core: draining %d in-flight request(s)", app.engine.in_flight())
            deadline = time.monotonic() + timeout
            self.stop.count = 1
            while time.monotonic() < deadline and self.stop.count < 2:
                if app.wait_idle(0.1):
                    break
                dead = [w for w in self.workers if not w.alive()]
                if dead:  # e.g. KillMode=control-group: the workers got SIGTERM too
                    logger.error("Worker proc VllmWorker-%d died unexpectedly during drain.", dead[0].rank)
                    app.engine.kill()
                    break
        remaining = app.engine.abort_all()
        if remaining:
            logger.info("[shutdown] Engine core: aborted %d unfinished request(s)", remaining)
        else:
            logger.info("[shutdown] Engine core: no unfinished requests")
        app.wait_idle(2.0)
        server.shutdown()
        server.server_close()
        self._stop_workers()
        logger.info("[shutdown] Workers stopped; shutdown complete")
        return 0

    def _stop_workers(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


def serve(args: argparse.Namespace, defaults: dict[str, object]) -> int:
    """Run ``vllm serve`` with parsed arguments; returns the exit status."""
    return Serve(args, defaults).run()
