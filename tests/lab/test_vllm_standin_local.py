"""The vLLM stand-in on this machine: real wheel, real NVML shim, real pynvml, real processes.

No containers: the stand-in is installed from its built wheel into a fresh venv (``--no-index``)
and run as ``vllm serve`` subprocesses against fleet's simulated NVML library, with the
profile, live-state directory and HF cache in temporary directories. GPU memory is observed
from a separate process through the unmodified ``pynvml``, the way fleet's probe sees it.

Expected numbers come from the NVML profile (totals) and from the stand-in's own log lines
checked against each other, never from constants copied out of the implementation.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fleetlab.index import build_standin_wheel, fetch_wheels
from fleetlab.nvml import build_shim
from fleetlab.profiles import load_profile
from tests.lab.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "fleet" / "data" / "models"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
GiB = 1024**3
LOAD_S = 0.4

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build the NVML shim")

NVML_PROBE = """
import json, pynvml as N
N.nvmlInit()
out = []
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    m = N.nvmlDeviceGetMemoryInfo(h)
    v2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    procs = {p.pid: p.usedGpuMemory for p in N.nvmlDeviceGetComputeRunningProcesses(h)}
    out.append({"total": m.total, "used": m.used, "free": m.free, "procs": procs,
                "reserved": v2.reserved, "v2_free": v2.free})
print(json.dumps(out))
"""
#: A CUDA context on an H100/H200 with driver 580 (measured through NVML as process memory).
CUDA_CONTEXT = 527 * 1024**2


def cuda_total(gpu: dict[str, Any]) -> int:
    """What ``cudaMemGetInfo`` calls total: NVML's total less the driver's reserve (v2)."""
    return int(gpu["total"]) - int(gpu["reserved"])


def gib(nbytes: float) -> str:
    """vLLM's ``format_gib``."""
    return f"{round(nbytes / GiB, 2)}"


# ---- environment ------------------------------------------------------------------------------


@dataclass
class Lab:
    """One installed stand-in plus the simulated machine it runs on."""

    root: Path
    venv: Path
    shim_dir: Path
    hf_home: Path
    profiles: dict[str, Path]

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def _install_model(hf_home: Path, model_id: str, config: dict[str, Any]) -> None:
    repo = hf_home / "hub" / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    root = tmp_path_factory.mktemp("standin")
    shim = build_shim(root / "shim").parent
    wheels = root / "wheels"
    build_standin_wheel(wheels)
    fetch_wheels(wheels, python=sys.version_info[:2])
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(wheels), "vllm==0.33.0"],
        check=True,
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )
    hf_home = root / "hf"
    for config in MODELS.glob("*/*/config.json"):
        _install_model(hf_home, f"{config.parent.parent.name}/{config.parent.name}", json.loads(config.read_text()))
    # 40 heads / 8 KV heads: TP=5 divides the heads but not the KV heads.
    odd = json.loads((MODELS / LLAMA_8B / "config.json").read_text())
    odd.update(num_attention_heads=40, hidden_size=5120)
    _install_model(hf_home, "fleetlab/odd-heads", odd)
    profiles = {}
    for name in ("h100-sxm-8", "a10-1"):
        profiles[name] = root / f"{name}.profile"
        profiles[name].write_text(load_profile(name).render())
    return Lab(root, venv, shim, hf_home, profiles)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    state_dir: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout=timeout)

    def wait_ready(self, timeout: float = 30) -> float:
        """Poll ``/health`` until 200; returns seconds since start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                if http(self.url + "/health")[0] == 200:
                    return time.monotonic() - self.started
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout}s:\n{self.log()}")

    def workers(self) -> list[int]:
        """The API server's child processes (the engine core)."""
        return children(self.proc.pid)

    def tree(self) -> dict[int, str]:
        """Every descendant of the API server: pid → process title (``/proc/<pid>/cmdline``)."""
        found: dict[int, str] = {}
        todo = [self.proc.pid]
        while todo:
            for pid in children(todo.pop()):
                found[pid] = title(pid)
                todo.append(pid)
        return found


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def http(
    url: str, body: dict[str, Any] | None = None, key: str | None = None, timeout: float = 10
) -> tuple[int, bytes, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} not in metrics"
    return total


@pytest.fixture
def run(lab: Lab, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start ``vllm serve`` processes; every one (and its workers) is killed at teardown."""
    started: list[Server] = []
    state_dir = tmp_path / "nvml-state"

    def start(*args: str, profile: str = "h100-sxm-8", env: dict[str, str] | None = None, wait: bool = False) -> Server:
        port = free_port()
        log_path = tmp_path / f"serve-{len(started)}.log"
        full_env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(lab.shim_dir),
            "FLEET_NVML_PROFILE": str(lab.profiles[profile]),
            "FLEET_NVML_STATE_DIR": str(state_dir),
            "HF_HOME": str(lab.hf_home),
            "FLEET_LAB_FAULTS": str(tmp_path / "faults.json"),
            "FLEET_LAB_LOAD_SECONDS": str(LOAD_S),
            "FLEET_LAB_WATCHDOG_SECONDS": "0.5",
        }
        full_env.pop("VLLM_API_KEY", None)
        full_env.pop("CUDA_VISIBLE_DEVICES", None)
        full_env.update(env or {})
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(lab.vllm), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,  # its own process group: teardown reaches orphaned workers too
            )
        server = Server(proc, port, log_path, state_dir)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                server.proc.wait(timeout=5)


def nvml(lab: Lab, server: Server, profile: str = "h100-sxm-8") -> list[dict[str, Any]]:
    """GPU memory and compute processes as a separate pynvml process sees them."""
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(lab.shim_dir),
        "FLEET_NVML_PROFILE": str(lab.profiles[profile]),
        "FLEET_NVML_STATE_DIR": str(server.state_dir),
    }
    out = subprocess.run([str(lab.python), "-c", NVML_PROBE], env=env, capture_output=True, text=True, check=True)
    gpus: list[dict[str, Any]] = json.loads(out.stdout)
    for gpu in gpus:
        gpu["procs"] = {int(pid): used for pid, used in gpu["procs"].items()}
    return gpus


def health(server: Server) -> int:
    """``/health`` status, -1 when the connection is refused or reset."""
    try:
        return http(server.url + "/health", timeout=2)[0]
    except OSError:
        return -1


# ---- command line -----------------------------------------------------------------------------


def test_version(lab: Lab) -> None:
    out = subprocess.run([str(lab.vllm), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "0.33.0+fleetlab.1"
    assert "not vLLM" in out.stdout


@pytest.mark.parametrize(
    "flags",
    [
        ["--swap-space", "4"],
        ["--num-scheduler-steps", "8"],
        ["--speculative-model", "x"],
        ["--preemption-mode", "swap"],
        ["--no-such-flag"],
    ],
)
def test_removed_and_unknown_flags_exit_2(lab: Lab, flags: list[str]) -> None:
    out = subprocess.run([str(lab.vllm), "serve", LLAMA_8B, *flags], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"vllm: error: unrecognized arguments: {' '.join(flags)}" in out.stderr


PARSE_LIKE_SERVE_CHECK = """
import contextlib, io, sys
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
err = io.StringIO()
try:
    with contextlib.redirect_stderr(err):
        make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(sys.argv[1:])
except SystemExit as exc:
    print(err.getvalue().strip().splitlines()[-1] if exc.code else "ok")
else:
    print("ok")
"""


def test_the_unknown_flags_fault_makes_both_parsers_refuse_a_flag(lab: Lab, tmp_path: Path) -> None:
    """A host whose vLLM build lacks a flag: ``vllm serve`` and ``make_arg_parser`` (what fleet's
    preflight calls) refuse it like any unknown flag; without the fault both take it."""
    faults = tmp_path / "faults.json"
    argv = [LLAMA_8B, "--no-enable-prefix-caching", "--max-model-len", "4096"]
    env = {**os.environ, "FLEET_LAB_FAULTS": str(faults)}

    def parse() -> str:
        out = subprocess.run([str(lab.python), "-c", PARSE_LIKE_SERVE_CHECK, *argv], env=env,
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return out.stdout.strip()

    assert parse() == "ok"
    faults.write_text(json.dumps({"unknown_flags": ["--no-enable-prefix-caching"]}))
    assert parse() == "vllm serve: error: unrecognized arguments: --no-enable-prefix-caching"
    served = subprocess.run([str(lab.vllm), "serve", *argv], env=env, capture_output=True, text=True, timeout=60)
    assert served.returncode == 2
    assert "vllm: error: unrecognized arguments: --no-enable-prefix-caching" in served.stderr
    argv = [LLAMA_8B, "--max-model-len", "4096"]  # the rest of the surface is untouched
    assert parse() == "ok"


# ---- start refusals ---------------------------------------------------------------------------


def _refused(server: Server) -> str:
    assert server.wait_exit() != 0
    log = server.log()
    assert not server.workers()
    return log


def _engine_core_refused(server: Server) -> str:
    """A refusal met in the engine core: vLLM logs the root cause there, then the API server
    ends with ``RuntimeError: Engine core initialization failed`` (``wait_for_engine_startup``,
    ``vllm/v1/engine/utils.py``), exit 1."""
    assert server.wait_exit() == 1
    log = server.log()
    assert not server.workers()
    assert "EngineCore failed to start." in log
    assert log.rstrip().splitlines()[-1] == (
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"
    )
    return log


def test_max_model_len_above_model_limit(run: Callable[..., Server]) -> None:
    # --disable-log-requests is 0.33.0's inverse of --enable-log-requests: accepted, so we get
    # past parsing to the config check.
    log = _refused(run(LLAMA_8B, "--max-model-len", "200000", "--disable-log-requests"))
    assert (
        "ValueError: User-specified max_model_len (200000) is greater than the derived max_model_len "
        "(max_position_embeddings=131072 or model_max_length=None in model's config.json)"
    ) in log


def test_tp_larger_than_gpus(run: Callable[..., Server]) -> None:
    log = _refused(run(LLAMA_8B, "-tp", "2", profile="a10-1"))
    assert "ValueError: World size (2) is larger than the number of available GPUs (1) in this node." in log


def test_cuda_visible_devices_limits_gpus(run: Callable[..., Server]) -> None:
    log = _refused(run(LLAMA_8B, "-tp", "4", env={"CUDA_VISIBLE_DEVICES": "2,5"}))
    assert "World size (4) is larger than the number of available GPUs (2)" in log


def test_tp_must_divide_heads(run: Callable[..., Server]) -> None:
    log = _refused(run(LLAMA_8B, "--tensor-parallel-size", "3"))
    assert "ValueError: Total number of attention heads (32) must be divisible by tensor parallel size (3)." in log


def test_tp_must_divide_kv_heads(run: Callable[..., Server]) -> None:
    log = _engine_core_refused(run("fleetlab/odd-heads", "-tp", "5", "--max-model-len", "4096"))
    assert "\nAssertionError: 8 is not divisible by 5\n" in log


def test_weights_do_not_fit(run: Callable[..., Server]) -> None:
    log = _engine_core_refused(run(LLAMA_70B, profile="a10-1"))
    assert "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`" in log


def test_max_model_len_does_not_fit_and_estimate_is_right(run: Callable[..., Server]) -> None:
    log = _engine_core_refused(run(LLAMA_8B, profile="a10-1"))
    match = re.search(
        r"To serve at least one request with the model's max seq len \(131072\), \((\d+\.\d+) GiB KV cache is needed, "
        r"which is larger than the available KV cache memory \((\d+\.\d+) GiB\)\. Based on the available memory, "
        r"the estimated maximum model length is (\d+)\.",
        log,
    )
    assert match, log
    needed, available, estimate = float(match[1]), float(match[2]), int(match[3])
    per_token = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16 KV, TP1 (vllm.md §5.1)
    assert needed == pytest.approx(131072 * per_token / GiB, abs=0.006)
    assert abs(estimate - available * GiB / per_token) <= 16 + 0.006 * GiB / per_token
    assert estimate % 16 == 0
    # The estimate is a real boundary: it starts; one block more does not.
    ok = run(LLAMA_8B, "--max-model-len", str(estimate), profile="a10-1", wait=True)
    assert "GPU KV cache size:" in ok.log()
    ok.proc.send_signal(signal.SIGTERM)
    assert ok.wait_exit() == 0
    too_long = _engine_core_refused(run(LLAMA_8B, "--max-model-len", str(estimate + 16), profile="a10-1"))
    assert f"estimated maximum model length is {estimate}." in too_long


FREE_MEMORY_RE = re.compile(
    r"ValueError: Free memory on device cuda:0 \((\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\) on startup is less than "
    r"desired GPU memory utilization \(([0-9.]+), (\d+(?:\.\d+)?) GiB\)\. Decrease GPU memory utilization or "
    r"reduce GPU memory used by other processes\."
)


def test_second_instance_on_same_gpu_lacks_free_memory(lab: Lab, run: Callable[..., Server]) -> None:
    """``request_memory`` (``vllm/v1/worker/utils.py``): ``ceil(total × util)`` against free memory,
    both as CUDA reports them (total = NVML total − the driver's reserve, NVML v2)."""
    first = run(LLAMA_8B, "--max-model-len", "8192", profile="a10-1", wait=True)
    gpu = nvml(lab, first, "a10-1")[0]
    second = run(LLAMA_8B, "--max-model-len", "8192", "--gpu-memory-utilization", "0.5", profile="a10-1")
    log = _engine_core_refused(second)
    match = FREE_MEMORY_RE.search(log)
    assert match, log
    requested = math.ceil(cuda_total(gpu) * 0.5)
    assert (match[2], match[3], match[4]) == (gib(cuda_total(gpu)), "0.5", gib(requested))
    # Free memory is measured after the second engine core's own CUDA context exists.
    assert float(match[1]) * GiB <= gpu["v2_free"] - CUDA_CONTEXT + 0.01 * GiB
    assert first.proc.poll() is None


def test_free_memory_is_measured_after_the_cuda_context(lab: Lab, run: Callable[..., Server]) -> None:
    """vLLM takes its memory snapshot after the worker's CUDA context, NCCL and cuBLAS exist
    (``Worker.init_device``, ``vllm/v1/worker/gpu_worker.py``): a utilization that fits the free
    memory seen before start, but not once the context (527 MiB) is there, is refused."""
    first = run(LLAMA_8B, "--max-model-len", "8192", "--gpu-memory-utilization", "0.5", wait=True)
    gpu = nvml(lab, first)[0]
    total = cuda_total(gpu)
    # Fits what NVML shows free now by 100 MiB; does not fit once a context is subtracted.
    util = math.floor((gpu["v2_free"] - 100 * 1024**2) / total * 10_000) / 10_000
    assert math.ceil(total * util) <= gpu["v2_free"]
    log = _engine_core_refused(run(LLAMA_8B, "--max-model-len", "1024", "--gpu-memory-utilization", str(util)))
    match = FREE_MEMORY_RE.search(log)
    assert match, log
    assert match[3] == str(util)
    assert float(match[1]) * GiB < gpu["v2_free"] - CUDA_CONTEXT + 0.01 * GiB


# ---- serving ----------------------------------------------------------------------------------


def test_readiness_endpoints_metrics_and_gpu_memory(lab: Lab, run: Callable[..., Server]) -> None:
    key = "lab-secret-key"
    server = run(LLAMA_8B, "--served-model-name", "llama-8b", "--max-model-len", "32768",
                 env={"VLLM_API_KEY": key, "FLEET_LAB_LOAD_SECONDS": "1.5"})  # fmt: skip
    # Loading: the port is bound (we cannot bind it) but refuses connections.
    assert wait_for(lambda: bool(server.workers()), timeout=10)
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", server.port))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    ready_after = server.wait_ready()
    assert ready_after >= 1.5
    assert key not in server.log()

    status, body, _ = http(server.url + "/health")
    assert (status, body) == (200, b"")
    assert http(server.url + "/ping")[0] == 200
    assert json.loads(http(server.url + "/version")[1])["version"].startswith("0.33.0")
    assert http(server.url + "/v1/models")[:2] == (401, b'{"error":"Unauthorized"}')
    assert http(server.url + "/v1/models", key="wrong")[0] == 401
    status, body, _ = http(server.url + "/v1/models", key=key)
    card = json.loads(body)["data"][0]
    assert status == 200
    assert (card["id"], card["max_model_len"], card["owned_by"]) == ("llama-8b", 32768, "vllm")
    assert card["root"] == LLAMA_8B  # the model argument as given

    metrics0 = http(server.url + "/metrics")[1].decode()
    assert_parses(metrics0)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
                 "vllm:cache_config_info"):  # fmt: skip
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="llama-8b"', metrics0, re.M) or (
            name == "vllm:cache_config_info" and name in metrics0
        ), name
    assert "gpu_cache_usage_perc" not in metrics0

    request = {"model": "llama-8b", "prompt": "The quick brown fox jumps", "max_tokens": 7}
    t0 = time.monotonic()
    status, body, _ = http(server.url + "/v1/completions", request, key=key)
    latency = time.monotonic() - t0
    first = json.loads(body)
    assert status == 200, body
    assert first["usage"]["completion_tokens"] == 7
    assert len(first["choices"][0]["text"].split()) == 7
    assert (
        json.loads(http(server.url + "/v1/completions", request, key=key)[1])["choices"][0]["text"]
        == (first["choices"][0]["text"])
    )
    other = json.loads(http(server.url + "/v1/completions", {**request, "prompt": "Something else"}, key=key)[1])
    assert other["choices"][0]["text"] != first["choices"][0]["text"]
    chat = json.loads(
        http(
            server.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            key=key,
        )[1]
    )
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    assert http(server.url + "/v1/completions", {**request, "model": "nope"}, key=key)[0] == 404
    assert http(server.url + "/v1/completions", {**request, "max_tokens": 40000}, key=key)[0] == 400

    metrics1 = http(server.url + "/metrics")[1].decode()
    prompt_tokens = (
        2 * first["usage"]["prompt_tokens"] + other["usage"]["prompt_tokens"] + chat["usage"]["prompt_tokens"]
    )
    assert metric(metrics1, "vllm:prompt_tokens_total") - metric(metrics0, "vllm:prompt_tokens_total") == prompt_tokens
    assert metric(metrics1, "vllm:generation_tokens_total") - metric(metrics0, "vllm:generation_tokens_total") == 24
    assert metric(metrics1, "vllm:request_success_total", finished_reason="length") == 4
    assert metric(metrics1, "vllm:time_to_first_token_seconds_count") == 4

    # GPU memory, seen from another process through pynvml. TP 1: the worker runs inside the
    # engine core (UniProcExecutor), which holds its context plus ceil(0.92 × CUDA's total).
    gpus = nvml(lab, server)
    (worker,) = server.workers()
    assert title(worker) == "VLLM::EngineCore"
    requested = math.ceil(cuda_total(gpus[0]) * 0.92)
    held = gpus[0]["procs"][worker]
    assert list(gpus[0]["procs"]) == [worker]
    assert requested + CUDA_CONTEXT <= held < requested + GiB
    assert "Available KV cache memory: " in server.log()
    assert gpus[0]["free"] == gpus[0]["total"] - gpus[0]["used"]
    assert all(not g["procs"] for g in gpus[1:])
    print(f"\nstart-to-ready {ready_after:.2f}s (load {1.5}s); 7-token completion {latency * 1000:.0f} ms")

    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    after = nvml(lab, server)
    assert not after[0]["procs"] and after[0]["used"] == gpus[0]["used"] - held
    assert not alive(worker)  # --shutdown-timeout 0: the engine core is SIGKILLed at once
    assert not list(server.state_dir.glob("*.mem"))


def test_streaming_and_uuid_selection(lab: Lab, run: Callable[..., Server]) -> None:
    uuid = nvml_uuid(lab, 3)
    server = run(LLAMA_8B, "--max-model-len", "4096", env={"CUDA_VISIBLE_DEVICES": uuid}, wait=True)
    gpus = nvml(lab, server)
    assert [i for i, g in enumerate(gpus) if g["procs"]] == [3]
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({"prompt": "stream me", "max_tokens": 5, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["text"]) == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def nvml_uuid(lab: Lab, index: int) -> str:
    text = lab.profiles["h100-sxm-8"].read_text()
    match = re.search(rf"^gpu\.{index}\.uuid=(\S+)$", text, re.M)
    assert match
    return match[1]


# ---- shutdown ---------------------------------------------------------------------------------


def _slow_request(server: Server, tokens: int, results: list[Any]) -> threading.Thread:
    def go() -> None:
        try:
            results.append(http(server.url + "/v1/completions", {"prompt": "slow", "max_tokens": tokens}, timeout=30))
        except Exception as exc:  # connection reset etc.
            results.append(exc)

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def _running(server: Server) -> float:
    return metric(http(server.url + "/metrics")[1].decode(), "vllm:num_requests_running")


def _late(server: Server) -> tuple[int, Any]:
    status, body, _ = http(server.url + "/v1/completions", {"prompt": "late", "max_tokens": 5}, timeout=5)
    return status, json.loads(body)


def test_drain_keeps_health_and_answers_new_requests_500(lab: Lab, run: Callable[..., Server]) -> None:
    """``serve_http``'s shutdown (``vllm/entrypoints/launchers/launcher.py``) with a timeout > 0:
    ``/health`` stays 200 while the engine client drains; a request that arrives meanwhile fails
    with HTTP 500 ``cannot schedule new futures after shutdown`` (``AsyncLLM.shutdown``,
    ``vllm/v1/engine/async_llm.py``, shuts the renderer's executor down before it drains), not a
    503, streaming or not; the in-flight request completes; a second SIGTERM is ignored (``signal_handler`` returns when
    the shutdown event is already set); exit 0."""
    server = run(LLAMA_8B, "--max-model-len", "4096", "--shutdown-timeout", "20",
                 env={"FLEET_LAB_TOKEN_SECONDS": "0.02"}, wait=True)  # fmt: skip
    results: list[Any] = []
    thread = _slow_request(server, 100, results)
    assert wait_for(lambda: _running(server) == 1)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGTERM)  # ignored
    assert health(server) == 200
    status, late = _late(server)
    assert status == 500, late
    assert late["error"]["message"] == "cannot schedule new futures after shutdown"
    assert late["error"]["type"] == "InternalServerError"
    status, body, _ = http(server.url + "/v1/completions", {"prompt": "late", "max_tokens": 5, "stream": True},
                           timeout=5)  # fmt: skip
    assert status == 500 and b"cannot schedule new futures after shutdown" in body
    assert health(server) == 200
    thread.join(30)
    assert server.wait_exit() == 0
    drain_s = time.monotonic() - t0
    status, body, _ = results[0]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 100
    assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    assert drain_s >= 1.0  # it really waited for ~100 × 20 ms
    log = server.log()
    assert "[shutdown] API server: stopping engine client mode=drain timeout=20s" in log
    assert log.count("[shutdown] API server: shutdown triggered") == 1
    assert "[shutdown] EngineCore: start mode=drain timeout=20s" in log
    assert "force killing" not in log
    assert not list(server.state_dir.glob("*.mem"))
    print(f"\ndrain of a 100-token request: SIGTERM to exit {drain_s:.2f}s")


def test_sigterm_without_timeout_aborts_in_flight(lab: Lab, run: Callable[..., Server]) -> None:
    """``--shutdown-timeout 0`` (default): in-flight requests finish as aborts (HTTP 200,
    ``finish_reason: "abort"``), then the engine core is killed without a grace period
    (``get_engine_process_shutdown_timeout`` keeps 0, ``shutdown`` in ``vllm/v1/utils.py``)."""
    server = run(LLAMA_8B, "--max-model-len", "4096", env={"FLEET_LAB_TOKEN_SECONDS": "0.02"}, wait=True)
    results: list[Any] = []
    thread = _slow_request(server, 100, results)
    assert wait_for(lambda: _running(server) == 1)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert server.wait_exit() == 0
    print(f"\nabort mode: SIGTERM to exit {time.monotonic() - t0:.2f}s")
    status, body, _ = results[0]
    answer = json.loads(body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "abort"
    assert answer["usage"]["completion_tokens"] < 100
    assert "[shutdown] API server: stopping engine client mode=abort timeout=0s" in server.log()
    assert not any(g["procs"] for g in nvml(lab, server))


def test_drain_deadline_force_kills_the_engine_core(lab: Lab, run: Callable[..., Server]) -> None:
    """At the ``--shutdown-timeout`` deadline the process manager SIGKILLs the engine core's
    process tree (``shutdown`` → ``kill_process_tree``); what was still running fails."""
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096", "--shutdown-timeout", "1",
                 env={"FLEET_LAB_TOKEN_SECONDS": "0.05"}, wait=True)  # fmt: skip
    tree = server.tree()
    results: list[Any] = []
    thread = _slow_request(server, 1000, results)
    assert wait_for(lambda: _running(server) == 1)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    thread.join(10)
    assert 0.9 <= time.monotonic() - t0 < 10
    assert isinstance(results[0], Exception) or results[0][0] != 200
    assert "[shutdown] Process manager: force killing remaining process EngineCore" in server.log()
    assert not any(alive(pid) for pid in tree)
    assert not any(g["procs"] for g in nvml(lab, server))


@pytest.mark.parametrize("outcome", ["killed", "deadlock", "ignored", None])
def test_sigterm_while_loading_takes_one_of_the_real_engines_three_ways(
    lab: Lab, tmp_path: Path, run: Callable[..., Server], outcome: str | None
) -> None:
    """A SIGTERM while the server loads: ``run_server``'s ``_interrupt_init``
    (``entrypoints/launchers/api_server/entry.py``) raises ``KeyboardInterrupt``, but the real
    engine never ends promptly with it (``docs/real-engine.md``): it is killed by the signal
    (before the handler exists), deadlocks (API server in the engine handshake, engine core
    waiting, ``HANDSHAKE_TIMEOUT_MINS`` in ``vllm/v1/engine/core.py``) or ignores it and serves.
    The fault ``sigterm_while_loading`` picks one; without it: killed."""
    if outcome is not None:
        _faults(tmp_path, {"sigterm_while_loading": outcome})
    server = run(LLAMA_8B, "--max-model-len", "4096", env={"FLEET_LAB_LOAD_SECONDS": "3"})
    assert wait_for(lambda: any(g["procs"] for g in nvml(lab, server)), timeout=20)
    tree = server.tree()
    assert list(tree.values()) == ["VLLM::EngineCore"]
    server.proc.send_signal(signal.SIGTERM)
    if outcome in ("killed", None):
        assert server.wait_exit(timeout=20) == -signal.SIGTERM
        assert wait_for(lambda: not any(alive(pid) for pid in tree))
        assert not any(g["procs"] for g in nvml(lab, server))
    elif outcome == "deadlock":
        time.sleep(5)  # past the 3 s load: still not listening, still not gone
        assert server.proc.poll() is None and health(server) == -1
        assert all(alive(pid) for pid in tree)
        assert "SIGTERM while loading deadlocks" in server.log()
    else:
        assert server.wait_ready(timeout=20) > 0
        assert http(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_process_tree_and_titles(lab: Lab, run: Callable[..., Server]) -> None:
    """API server → ``VLLM::EngineCore`` → ``VLLM::Worker_TP<n>`` (``set_process_title`` in
    ``vllm/utils/system_utils.py``, called by ``EngineCoreProc.run_engine_core`` and
    ``WorkerProc.setup_proc_title_and_log_prefix``); with TP > 1 the workers hold the GPUs and
    each logs its own ``Available KV cache memory``."""
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096", wait=True)
    (core,) = server.workers()
    assert title(core) == "VLLM::EngineCore"
    workers = children(core)
    assert sorted(title(pid) for pid in workers) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    holders = {pid for g in nvml(lab, server) for pid in g["procs"]}
    assert holders == set(workers)
    kv_lines = [line for line in server.log().splitlines() if "Available KV cache memory:" in line]
    assert sorted(line.split()[0] for line in kv_lines) == ["(Worker_TP0", "(Worker_TP1"]


def test_worker_dies_engine_dies_api_server_exits_0(lab: Lab, run: Callable[..., Server]) -> None:
    """A worker that dies fails the executor (``monitor_workers``,
    ``vllm/v1/executor/multiproc_executor.py``), the engine core dies, ``/health`` answers 503 and
    the watchdog (``terminate_if_errored``, ``launcher.py``) only sets ``should_exit``: exit 0."""
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096", wait=True)
    (core,) = server.workers()
    workers = children(core)
    t0 = time.monotonic()
    os.kill(workers[0], signal.SIGTERM)
    assert wait_for(lambda: not alive(workers[0]), timeout=2, step=0.01)
    print(f"\nworker exit after SIGTERM: {(time.monotonic() - t0) * 1000:.0f} ms")
    assert not (server.state_dir / f"{workers[0]}.mem").exists()
    assert wait_for(lambda: health(server) == 503, timeout=5)
    assert server.wait_exit() == 0
    assert "died unexpectedly" in server.log() and "EngineCore encountered a fatal error." in server.log()
    assert not any(alive(pid) for pid in [core, *workers])
    assert not any(g["procs"] for g in nvml(lab, server))


def test_engine_core_killed_workers_follow_api_server_exits_0(lab: Lab, run: Callable[..., Server]) -> None:
    """Workers watch the engine core through a death pipe (``WorkerProc.monitor_death_pipe``):
    SIGKILL the engine core and they exit; the API server sees the engine core gone
    (``MPClient``'s ``monitor_engine_cores``), answers 503, and exits 0."""
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096", wait=True)
    (core,) = server.workers()
    workers = children(core)
    os.kill(core, signal.SIGKILL)
    assert wait_for(lambda: not any(alive(pid) for pid in workers), timeout=5)
    assert wait_for(lambda: health(server) == 503, timeout=5)
    assert server.wait_exit() == 0
    assert not any(g["procs"] for g in nvml(lab, server))


def test_engine_core_and_workers_survive_a_sigkilled_api_server(lab: Lab, run: Callable[..., Server]) -> None:
    """The engine core does not watch the API server: after ``kill -9`` of the API server the
    engine core and its workers stay, holding GPU memory, until they are killed."""
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096", wait=True)
    tree = server.tree()
    (core,) = server.workers()
    before = nvml(lab, server)
    server.proc.kill()
    server.proc.wait()
    time.sleep(1.0)
    assert all(alive(pid) for pid in tree)
    orphaned = nvml(lab, server)
    assert {pid for g in orphaned for pid in g["procs"]} == set(tree) - {core}
    assert [g["used"] for g in orphaned] == [g["used"] for g in before]
    os.kill(core, signal.SIGKILL)  # the workers follow through the death pipe
    assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=5)
    assert not any(g["procs"] for g in nvml(lab, server))


# ---- faults -----------------------------------------------------------------------------------


def _faults(server_dir: Path, data: dict[str, Any]) -> None:
    (server_dir / "faults.json").write_text(json.dumps(data))


def test_fault_fail_load(tmp_path: Path, run: Callable[..., Server]) -> None:
    _faults(tmp_path, {"fail_load": [LLAMA_8B]})
    log = _engine_core_refused(run(LLAMA_8B, "--max-model-len", "4096"))
    assert "\nsafetensors_rust.SafetensorError: " in log
    assert not list((tmp_path / "nvml-state").glob("*.mem"))


def test_fault_load_seconds(tmp_path: Path, run: Callable[..., Server]) -> None:
    _faults(tmp_path, {"load_seconds": 2.0})
    server = run(LLAMA_8B, "--max-model-len", "4096")
    assert server.wait_ready() >= 2.0


def test_hung_tp1_stays_hung_with_health_200(tmp_path: Path, run: Callable[..., Server]) -> None:
    """TP 1 runs the model in the engine core (``UniProcExecutor``): a hung step has no timeout,
    ``/health`` stays 200 and requests never finish."""
    _faults(tmp_path, {"hang_after_load": True})
    server = run(LLAMA_8B, "--max-model-len", "4096", env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1"}, wait=True)
    assert http(server.url + "/health")[0] == 200
    with pytest.raises(TimeoutError):
        http(server.url + "/v1/completions", {"prompt": "anyone?", "max_tokens": 2}, timeout=2.5)
    assert http(server.url + "/health")[0] == 200
    text = http(server.url + "/metrics")[1].decode()
    assert metric(text, "vllm:num_requests_running") == 1
    assert metric(text, "vllm:generation_tokens_total") == 0
    assert server.proc.poll() is None


def test_hung_tp2_step_past_execute_timeout_kills_the_engine(tmp_path: Path, run: Callable[..., Server]) -> None:
    """TP > 1 (``MultiprocExecutor.collective_rpc``) waits ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
    for a step, then ``TimeoutError`` kills the engine core: ``/health`` 503, then exit 0."""
    _faults(tmp_path, {"hang_after_load": True})
    server = run(LLAMA_8B, "-tp", "2", "--max-model-len", "4096",
                 env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1"}, wait=True)  # fmt: skip
    results: list[Any] = []
    thread = _slow_request(server, 2, results)
    # Under traffic the failed request ends the API server about 1 s after the engine's death
    # (engine_error_handler, as vLLM's does: 503 only in between); a poll slowed by a loaded machine
    # can miss that second and find the server gone (-1). Either way it never answers 200 again.
    seen: list[int] = []
    assert wait_for(lambda: seen.append(health(server)) or seen[-1] in (503, -1), timeout=10), seen
    assert server.wait_exit() == 0
    thread.join(10)
    assert isinstance(results[0], Exception) or results[0][0] != 200
    assert "TimeoutError: RPC call to execute_model timed out." in server.log()


def test_fault_crash_after_seconds_exits_0(lab: Lab, tmp_path: Path, run: Callable[..., Server]) -> None:
    _faults(tmp_path, {"crash_after_seconds": 1})
    server = run(LLAMA_8B, "--max-model-len", "4096", wait=True)
    assert http(server.url + "/health")[0] == 200
    assert wait_for(lambda: health(server) == 503, timeout=5)
    assert server.wait_exit() == 0  # like vLLM: the watchdog only stops the HTTP server
    assert "EngineCore encountered a fatal error." in server.log()
    assert not any(g["procs"] for g in nvml(lab, server))


def test_fault_stall_window_then_recovery_with_health_200(tmp_path: Path, run: Callable[..., Server]) -> None:
    """A stall window: no token for a while, ``/health`` 200 throughout, then tokens again (the
    half-alive server of ray-project/ray#61263). A request made during the stall finishes once the
    stall is over; a client that gives up sooner sees a timeout."""
    _faults(tmp_path, {"stall_after_seconds": 1.0, "stall_seconds": 2.0})
    server = run(LLAMA_8B, "--max-model-len", "4096", env={"FLEET_LAB_TOKEN_SECONDS": "0.001"}, wait=True)
    assert http(server.url + "/v1/completions", {"prompt": "before", "max_tokens": 2}, timeout=2)[0] == 200
    assert wait_for(lambda: "lab fault: engine steps stall" in server.log(), timeout=5)
    stalled_at = time.monotonic()
    assert http(server.url + "/health")[0] == 200
    with pytest.raises(TimeoutError):
        http(server.url + "/v1/completions", {"prompt": "during", "max_tokens": 2}, timeout=0.5)
    status, body, _ = http(server.url + "/v1/completions", {"prompt": "waits it out", "max_tokens": 2}, timeout=10)
    done = time.monotonic()
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    assert 1.5 <= done - stalled_at < 3.0  # answered once the 2 s stall was over, not before
    assert "lab fault: engine steps resume" in server.log()
    assert http(server.url + "/v1/completions", {"prompt": "after", "max_tokens": 2}, timeout=2)[0] == 200
    assert http(server.url + "/health")[0] == 200 and server.proc.poll() is None


# ---- smaller API behaviours --------------------------------------------------------------------


def test_models_load_and_chat_defaults(run: Callable[..., Server]) -> None:
    """``/v1/models`` lists every served name with ``root`` = the model argument
    (``app_state.py``: ``BaseModelPath(name=name, model_path=args.model)``); ``/load`` stays 0
    without ``--enable-server-load-tracking`` (``load_aware_call``); a chat without ``max_tokens``
    may use the rest of the context (``get_max_tokens``, ``entrypoints/serve/utils/api_utils.py``)."""
    env = {"FLEET_LAB_TOKEN_SECONDS": "0.001", "FLEET_LAB_PREFILL_SECONDS_PER_TOKEN": "0"}
    server = run(LLAMA_8B, "--served-model-name", "a", "b", "--max-model-len", "64", env=env, wait=True)
    slow_env = {"FLEET_LAB_TOKEN_SECONDS": "0.02", "CUDA_VISIBLE_DEVICES": "1"}
    cards = json.loads(http(server.url + "/v1/models")[1])["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("a", LLAMA_8B), ("b", LLAMA_8B)]
    chat = {"model": "b", "messages": [{"role": "user", "content": "hello there"}]}
    answer = json.loads(http(server.url + "/v1/chat/completions", chat)[1])
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert answer["choices"][0]["finish_reason"] == "length"
    results: list[Any] = []
    slow = run(LLAMA_8B, "--max-model-len", "4096", env=slow_env, wait=True)
    thread = _slow_request(slow, 50, results)
    assert wait_for(lambda: _running(slow) == 1)
    assert json.loads(http(slow.url + "/load")[1]) == {"server_load": 0}
    thread.join(10)
    tracked = run(LLAMA_8B, "--max-model-len", "4096", "--enable-server-load-tracking",
                  env={**slow_env, "CUDA_VISIBLE_DEVICES": "2"}, wait=True)  # fmt: skip
    thread = _slow_request(tracked, 50, results)
    assert wait_for(lambda: json.loads(http(tracked.url + "/load")[1]) == {"server_load": 1})
    thread.join(10)
    assert json.loads(http(tracked.url + "/load")[1]) == {"server_load": 0}


def assert_parses(text: str) -> dict[str, Any]:
    """prometheus_client's own parser reads every family, each with samples."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families and all(f.samples for f in families.values()), [n for n, f in families.items() if not f.samples]
    return families


def test_metrics_are_prometheus_client_output(run: Callable[..., Server]) -> None:
    """Written by prometheus_client like vLLM's ``PrometheusStatLogger``
    (``vllm/v1/metrics/loggers.py``): counters typed ``counter`` under their base name, exposed as
    ``_total`` plus a ``_created`` series; ``request_success`` has every ``FinishReason``
    (``vllm/v1/engine/__init__.py``), ``repetition`` included."""
    server = run(LLAMA_8B, "--served-model-name", "m", "--max-model-len", "4096", wait=True)
    http(server.url + "/v1/completions", {"prompt": "count me", "max_tokens": 3})
    text = http(server.url + "/metrics")[1].decode()
    assert "# TYPE vllm:num_preemptions_total counter" in text  # prometheus_client's text format
    families = assert_parses(text)
    counters = {"vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}  # fmt: skip
    for name in counters:
        family = families[name]
        assert family.type == "counter", name
        assert {sample.name for sample in family.samples} == {name + "_total"}, name
        assert families[name + "_created"].samples, name  # prometheus_client's _created series
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
        assert families[name].samples[0].labels == {"model_name": "m", "engine": "0"}
    total = [s for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert total[0].value == 3


# ---- LoRA adapters and --speculative-config (vLLM 0.33's cli_args.py, lora/, config/speculative.py) ----


def _adapter(where: Path, r: int) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": r, "bias": "none", "base_model_name_or_path": LLAMA_8B})
    )
    (where / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return where


def _kv_tokens(server: Server) -> int:
    found = re.search(r"GPU KV cache size: ([\d,]+) tokens", server.log())
    assert found, server.log()
    return int(found.group(1).replace(",", ""))


def test_lora_adapters_are_listed_and_served_with_a_speculative_config(
    lab: Lab, run: Callable[..., Server], tmp_path: Path
) -> None:
    repo = lab.hf_home / "hub" / "models--fleet-lora--sql"
    if not repo.exists():  # staged as fleet stages it: snapshots/<rev>, refs/main
        _adapter(repo / "snapshots" / "abc", 16)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc")
    local = _adapter(tmp_path / "chat-lora", 8)
    flags = ["--served-model-name", "llama", "--max-model-len", "8192"]
    plain = run(LLAMA_8B, *flags, wait=True)
    server = run(
        LLAMA_8B, *flags, "--enable-lora", "--lora-modules", "sql=fleet-lora/sql", f"chat={local}",
        "--max-loras", "2", "--max-lora-rank", "256", "--max-cpu-loras", "2",
        "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}', wait=True,
        env={"CUDA_VISIBLE_DEVICES": "1"},  # the plain one holds GPU 0
    )  # fmt: skip
    cards = json.loads(http(server.url + "/v1/models")[1])["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("llama", LLAMA_8B, None), ("sql", "fleet-lora/sql", "llama"), ("chat", str(local), "llama"),
    ]  # fmt: skip
    assert cards[1]["max_model_len"] is None
    status, body, _ = http(server.url + "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 3})
    assert status == 200 and json.loads(body)["model"] == "sql"
    assert http(server.url + "/v1/completions", {"model": "nope", "prompt": "hi"})[0] == 404
    assert "Loaded new LoRA adapter: name 'sql', path 'fleet-lora/sql'" in server.log()
    assert "'prompt_lookup_min': 5" in server.log()
    # 2 slots of rank 256 on Llama-3.1-8B (fleet.plan.lora, equal to vLLM's buffers in tests/oracle): one
    # slot is 41,943,040 B per layer, and (vocab + hidden) × rank × 2 B for the embedding and the logits
    slots = 2 * (32 * 41_943_040 + 2 * (128256 + 4096) * 256 * 2)
    per_token = 2 * 32 * 8 * 128 * 2
    assert _kv_tokens(plain) - _kv_tokens(server) == pytest.approx(slots / per_token, abs=64)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--max-lora-rank", "16", "--lora-modules", "big=BIG"],
            "ValueError: LoRA rank 64 is greater than max_lora_rank 16.",
        ),
        (
            ["--lora-modules", "gone=/nowhere/gone"],
            "ValueError: Loading lora gone failed: No adapter found for /nowhere/gone",
        ),
        (["--max-loras", "4", "--max-cpu-loras", "2"], "ValueError: max_cpu_loras (2) must be >= max_loras (4)."),
    ],
)
def test_bad_adapters_end_the_start_up(
    run: Callable[..., Server], tmp_path: Path, flags: list[str], expected: str
) -> None:
    big = _adapter(tmp_path / "big", 64)
    argv = [f.replace("BIG", str(big)) for f in flags]
    log = _refused(run(LLAMA_8B, "--max-model-len", "8192", "--enable-lora", *argv))
    assert expected in log


def test_a_bad_speculative_config_ends_the_start_up(run: Callable[..., Server]) -> None:
    log = _refused(run(LLAMA_8B, "--speculative-config", '{"method":"ngram","num_speculative_tokens":0}'))
    assert "num_speculative_tokens to be greater than zero" in log


# ---- one instance over two nodes (vllm/standin/nodes.py) -------------------------------------


def listening_ports(pid: int) -> set[int]:
    """TCP ports ``pid``'s process tree listens on (``/proc/<pid>/net/tcp`` + the tree's socket inodes)."""
    pids = [pid, *_tree(pid)]
    inodes = set()
    for p in pids:
        for fd in Path(f"/proc/{p}/fd").glob("*") if Path(f"/proc/{p}/fd").exists() else []:
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _two_nodes(run: Callable[..., Server], master: int, tp: int = 1) -> tuple[Server, Server]:
    common = [LLAMA_8B, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", "2",
              "--distributed-executor-backend", "mp", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master), "--max-model-len", "4096"]  # fmt: skip
    # the worker first: its store client retries until the leader's store is up (any order works)
    worker = run(*common, "--node-rank", "1", "--headless", env={"CUDA_VISIBLE_DEVICES": ",".join(
        str(4 + i) for i in range(tp))})  # fmt: skip
    leader = run(*common, "--node-rank", "0", env={"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(tp))})
    return leader, worker


def test_the_leader_listens_only_once_every_node_joined_and_headless_nodes_serve_no_http(
    run: Callable[..., Server],
) -> None:
    """init_distributed_environment (vllm/distributed/parallel_state.py): the leader's engine core
    waits in rank 0's store for every node; run_headless (vllm/entrypoints/cli/serve.py): a
    headless node starts no API server."""
    master = free_port()
    common = [LLAMA_8B, "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(master), "--max-model-len", "4096"]  # fmt: skip
    leader = run(*common, "--node-rank", "0", env={"CUDA_VISIBLE_DEVICES": "0"})
    time.sleep(3 * LOAD_S + 1.0)  # far longer than a load: it would be up by now if it did not wait
    assert leader.proc.poll() is None, leader.log()
    with pytest.raises(OSError):
        http(leader.url + "/health", timeout=2)
    assert "torch.distributed store of 2 node(s)" in leader.log()
    worker = run(*common, "--node-rank", "1", "--headless", env={"CUDA_VISIBLE_DEVICES": "1"})
    leader.wait_ready()
    status, body, _h = http(leader.url + "/v1/completions", {"model": LLAMA_8B, "prompt": "hi", "max_tokens": 4})
    assert status == 200 and json.loads(body)["choices"][0]["text"], body
    assert worker.proc.poll() is None, worker.log()
    assert leader.port in listening_ports(leader.proc.pid)  # the reader sees listeners where there are some
    assert listening_ports(worker.proc.pid) == set(), worker.log()  # no HTTP, no store: nothing listens
    with pytest.raises(OSError):
        http(worker.url + "/health", timeout=2)
    assert "headless multiproc executor, with head node address 127.0.0.1:" in worker.log()
    assert "joined the torch.distributed world" in worker.log()


def test_a_dead_worker_node_ends_the_leader_with_status_0(run: Callable[..., Server]) -> None:
    """The leader's engine core fails (EngineCoreProc, vllm/v1/engine/core.py) and the API server's
    watchdog (terminate_if_errored) ends it: exit 0, as for any engine death."""
    leader, worker = _two_nodes(run, free_port())
    leader.wait_ready()
    os.killpg(worker.proc.pid, signal.SIGKILL)
    assert leader.wait_exit(30) == 0, leader.log()
    assert "node rank 1 left the torch.distributed world" in leader.log()
    assert not [p for p in _tree(leader.proc.pid) if alive(p)]


def test_a_dead_leader_ends_the_headless_node_with_status_0(run: Callable[..., Server]) -> None:
    """run_headless (vllm/entrypoints/cli/serve.py) returns once its workers end: exit 0."""
    leader, worker = _two_nodes(run, free_port(), tp=2)
    leader.wait_ready()
    assert len([t for t in worker.tree().values() if "Worker_TP" in t]) == 2, worker.tree()
    os.killpg(leader.proc.pid, signal.SIGKILL)
    assert worker.wait_exit(30) == 0, worker.log()
    assert "the leader node left the torch.distributed world" in worker.log()


def test_a_taken_rendezvous_port_fails_the_leader_as_torch_does(run: Callable[..., Server]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        leader = run(LLAMA_8B, "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp", "--nnodes",
                     "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                     str(taken.getsockname()[1]), "--max-model-len", "4096")  # fmt: skip
        assert leader.wait_exit(30) == 1
    assert "name: EADDRINUSE" in leader.log() and "Engine core initialization failed" in leader.log()
