"""The vLLM stand-in inside a lab host, installed from the lab's package index, run by systemd.

What a deploy does on a real host, minus the GPU: ``pip install --index-url <mirror>
vllm==0.33.0`` into a venv, a unit that runs ``vllm serve``, readiness polled on ``/health``,
GPU memory seen through nvidia-ml-py inside the host, and ``systemctl stop``. It shows:

* why the unit needs ``KillMode=mixed``: the drain completes and nothing outlives the unit, while
  with ``KillMode=process`` a SIGKILLed API server leaves the ``VLLM::EngineCore`` and its
  ``VLLM::Worker_TP<n>`` processes holding the GPUs (vLLM's engine core does not watch the API
  server, ``EngineCoreProc.run_engine_core`` in ``vllm/v1/engine/core.py``);
* why it needs ``Restart=always``: when the engine dies, vLLM's API server exits 0 (the watchdog in
  ``vllm/entrypoints/launchers/launcher.py`` only sets ``should_exit``), which ``on-failure``
  would not restart; ``systemctl stop`` is not restarted; a crash loop hits the start limit.
  The restart lines come from fleet's own unit template.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paramiko
import pytest

from fleetlab import ssh
from fleetlab.state import HostRecord
from tests.lab.polling import wait_for

from .conftest import LabFleet

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B_CONFIG = REPO / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HOME = "/home/fleet"
#: A CUDA context on an H100 with driver 580, held by the process that owns the GPU.
CUDA_CONTEXT = 527 * 1024**2
VENV = f"{HOME}/vllm-venv"
MODEL_DIR = f"{HOME}/models/llama-8b"
LOAD_S = 1.5

NVML_PROBE = textwrap.dedent("""\
    import json, pynvml as N
    N.nvmlInit()
    out = []
    for i in range(N.nvmlDeviceGetCount()):
        h = N.nvmlDeviceGetHandleByIndex(i)
        m = N.nvmlDeviceGetMemoryInfo(h)
        v2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
        out.append({"total": m.total, "used": m.used, "reserved": v2.reserved,
                    "procs": {str(p.pid): p.usedGpuMemory for p in N.nvmlDeviceGetComputeRunningProcesses(h)}})
    print(json.dumps(out))
    """)

pytestmark = pytest.mark.lab


class Host:
    """SSH to one lab host (a fresh connection per command keeps failures independent)."""

    def __init__(self, lab: LabFleet, record: HostRecord) -> None:
        self.lab = lab
        self.record = record

    def client(self) -> paramiko.SSHClient:
        d = self.lab.dir
        return ssh.connect(self.record.address, self.lab.state.ssh_port, d.control_key, d.known_hosts)

    def run(self, command: str, timeout: float = 120.0, check: bool = True) -> str:
        client = self.client()
        try:
            rc, out, err = ssh.run(client, command, timeout=timeout)
        finally:
            client.close()
        if check:
            assert rc == 0, f"{command!r} on {self.record.name}: exit {rc}\n{out}\n{err}"
        return out

    def put(self, path: str, content: str) -> None:
        client = self.client()
        try:
            with client.open_sftp() as sftp, sftp.open(path, "w") as f:
                f.write(content)
        finally:
            client.close()

    def gpus(self) -> list[dict[str, Any]]:
        """GPU memory and compute processes as nvidia-ml-py sees them inside the host."""
        data: list[dict[str, Any]] = json.loads(self.run(f"{VENV}/bin/python {HOME}/nvml_probe.py").strip())
        return data

    def pids(self, unit: str) -> list[int]:
        """Processes whose cgroup is the unit's (read from /proc, whatever the cgroup layout)."""
        out = self.run(f"grep -l '/{unit}$' /proc/[0-9]*/cgroup 2>/dev/null || true")
        return sorted(int(line.split("/")[2]) for line in out.split())

    def workers(self) -> list[int]:
        """The engine core and worker processes, found by the titles vLLM gives them."""
        out = self.run("pgrep -f '^VLLM::(EngineCore|Worker_TP)' || true")
        return sorted(int(p) for p in out.split())

    def titled(self, name: str) -> list[int]:
        out = self.run(f"pgrep -f '^VLLM::{name}' || true")
        return sorted(int(p) for p in out.split())

    def show(self, unit: str, prop: str) -> str:
        return self.run(f"systemctl show -p {prop} --value {unit}").strip()


@pytest.fixture(scope="module")
def index_url(lab_fleet: LabFleet) -> str:
    """The lab's own index (the only one the air-gapped hosts can reach), as its inventory names it."""
    from fleet.inventory.spec import load_inventory

    url = load_inventory(lab_fleet.opts.inventory).hosts[0].pip_index_url
    assert url, "the lab inventory names no pip_index_url"
    return url


@pytest.fixture(scope="module")
def host(lab_fleet: LabFleet, index_url: str) -> Host:
    """Host 1 of the test lab, with the stand-in installed from the lab index and a model dir."""
    h = Host(lab_fleet, lab_fleet.state.hosts[0])
    h.run(
        f"rm -rf {VENV} && python3 -m venv {VENV} && "
        f"{VENV}/bin/pip install --quiet --disable-pip-version-check --index-url {index_url} vllm==0.33.0",
        timeout=300,
    )
    assert h.run(f"{VENV}/bin/vllm --version").split()[0] == "0.33.0+fleetlab.1"
    h.run(f"mkdir -p {MODEL_DIR}")
    h.put(f"{MODEL_DIR}/config.json", LLAMA_8B_CONFIG.read_text())
    h.put(f"{HOME}/nvml_probe.py", NVML_PROBE)
    return h


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        port: int = sock.getsockname()[1]
        return port


def template_lines(*keys: str) -> list[str]:
    """``Key=value`` lines of fleet's vLLM unit template (the restart policy under test)."""
    text = (REPO / "templates" / "vllm.service.j2").read_text()
    return [line for line in text.splitlines() if line.split("=", 1)[0] in keys]


def unit_text(
    address: str, port: int, kill_mode: str, tp: int = 1, restart: bool = False, env: str = "", timeout_stop: int = 40
) -> str:
    unit_extra = service_extra = ""
    if restart:
        unit_extra = "\n".join(template_lines("StartLimitIntervalSec", "StartLimitBurst"))
        # The template's Restart= policy; RestartSec shortened from its 10 s to keep the test short.
        service_extra = "\n".join([*template_lines("Restart"), "RestartSec=1"])
    return textwrap.dedent(f"""\
        [Unit]
        Description=fleet lab: vLLM stand-in under test
        {unit_extra}

        [Service]
        Type=simple
        Environment=FLEET_LAB_LOAD_SECONDS={LOAD_S} FLEET_LAB_TOKEN_SECONDS=0.01 FLEET_LAB_WATCHDOG_SECONDS=1 {env}
        ExecStart={VENV}/bin/vllm serve {MODEL_DIR} --served-model-name llama-8b --host {address} \\
            --port {port} --tensor-parallel-size {tp} --max-model-len 8192 --shutdown-timeout 10
        KillMode={kill_mode}
        KillSignal=SIGTERM
        TimeoutStopSec={timeout_stop}
        {service_extra}
        """)


@pytest.fixture
def unit(host: Host) -> Iterator[Callable[..., tuple[str, str]]]:
    """Install and start a unit; returns ``(name, base url)``. Removed, processes killed, at teardown."""
    names: list[str] = []

    def install(
        kill_mode: str, tp: int = 1, restart: bool = False, env: str = "", timeout_stop: int = 40
    ) -> tuple[str, str]:
        name = f"standin-{kill_mode}-{len(names)}.service"
        port = free_port(host.record.address)
        host.put(f"{HOME}/{name}", unit_text(host.record.address, port, kill_mode, tp, restart, env, timeout_stop))
        host.run(f"sudo -n mv {HOME}/{name} /etc/systemd/system/{name} && sudo -n systemctl daemon-reload")
        names.append(name)
        host.run(f"sudo -n systemctl start {name}")
        return name, f"http://{host.record.address}:{port}"

    try:
        yield install
    finally:
        for name in names:
            host.run(f"sudo -n systemctl stop {name}; sudo -n systemctl kill --signal=SIGKILL {name}; "
                     f"sudo -n systemctl reset-failed {name}", check=False)  # fmt: skip
            host.run(f"sudo -n rm -f /etc/systemd/system/{name}; sudo -n systemctl daemon-reload", check=False)
        leftover = host.workers()
        if leftover:
            host.run("sudo -n kill -9 " + " ".join(map(str, leftover)), check=False)


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return -1


def complete(url: str, max_tokens: int, results: list[Any]) -> threading.Thread:
    def go() -> None:
        body = json.dumps({"model": "llama-8b", "prompt": "drain me", "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                results.append((resp.status, json.loads(resp.read())))
        except urllib.error.HTTPError as err:
            results.append((err.code, None))
        except OSError as exc:
            results.append((-1, str(exc)))

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def test_standin_under_systemd_killmode_mixed(host: Host, unit: Callable[..., tuple[str, str]]) -> None:
    started = time.monotonic()
    name, url = unit("mixed")
    # Loading: connections refused (no "loading" 503), then ready.
    assert health(url) == -1
    assert wait_for(lambda: health(url) == 200, timeout=60), host.run(
        f"sudo -n journalctl -u {name} --no-pager", check=False
    )
    assert time.monotonic() - started >= LOAD_S
    journal = host.run(f"sudo -n journalctl -u {name} --no-pager -o cat")
    assert "GPU KV cache size:" in journal and "Application startup complete." in journal

    gpus = host.gpus()
    unit_pids = host.pids(name)
    (core,) = host.workers()  # TP 1: the model runs inside VLLM::EngineCore
    assert host.titled("EngineCore") == [core]
    assert core in unit_pids  # the engine core lives in the unit's cgroup
    assert [i for i, g in enumerate(gpus) if g["procs"]] == [0]
    requested = math.ceil((gpus[0]["total"] - gpus[0]["reserved"]) * 0.92)
    assert list(gpus[0]["procs"]) == [str(core)]
    assert requested + CUDA_CONTEXT <= gpus[0]["procs"][str(core)] < requested + 1024**3

    # systemctl stop during a request: SIGTERM reaches only the API server, which drains.
    results: list[Any] = []
    thread = complete(url, 200, results)  # ~2 s of tokens
    time.sleep(0.5)
    host.run(f"sudo -n systemctl stop {name}", timeout=60)
    thread.join(60)
    status, body = results[0]
    assert status == 200 and body["usage"]["completion_tokens"] == 200
    assert host.run(f"systemctl is-active {name}", check=False).strip() == "inactive"
    assert host.pids(name) == [] and host.workers() == []
    assert not any(g["procs"] for g in host.gpus())
    journal = host.run(f"sudo -n journalctl -u {name} --no-pager -o cat")
    assert "[shutdown] API server: stopping engine client mode=drain timeout=10s" in journal


def test_killmode_process_leaves_orphans_holding_gpus(host: Host, unit: Callable[..., tuple[str, str]]) -> None:
    name, url = unit("process", tp=2)
    assert wait_for(lambda: health(url) == 200, timeout=60)
    workers = host.workers()
    assert len(workers) == 3  # VLLM::EngineCore, VLLM::Worker_TP0, VLLM::Worker_TP1
    gpu_workers = host.titled("Worker_TP")
    held = host.gpus()
    main_pid = int(host.run(f"systemctl show -p MainPID --value {name}").strip())
    host.run(f"sudo -n kill -9 {main_pid}")
    assert wait_for(lambda: health(url) == -1, timeout=10)
    time.sleep(1)
    # The API server is gone, the unit is no longer running, but the engine core and both
    # workers are still there, and the workers still hold the GPUs.
    assert host.run(f"systemctl is-active {name}", check=False).strip() != "active"
    assert host.workers() == workers
    orphaned = host.gpus()
    assert sorted(int(pid) for g in orphaned for pid in g["procs"]) == gpu_workers
    assert [g["used"] for g in orphaned] == [g["used"] for g in held]
    with contextlib.suppress(AssertionError):
        host.run("sudo -n kill -9 " + " ".join(map(str, workers)))
    assert wait_for(lambda: host.workers() == [], timeout=10)
    assert not any(g["procs"] for g in host.gpus())


def test_killmode_control_group_cuts_the_drain(host: Host, unit: Callable[..., tuple[str, str]]) -> None:
    """With systemd's default KillMode the engine core and workers get SIGTERM with the API
    server: a worker that exits is a dead executor to the engine core (``monitor_workers``,
    ``vllm/v1/executor/multiproc_executor.py``), so the in-flight request fails: no drain."""
    name, url = unit("control-group", tp=2)
    assert wait_for(lambda: health(url) == 200, timeout=60)
    results: list[Any] = []
    thread = complete(url, 300, results)  # ~3 s of tokens
    time.sleep(0.5)
    host.run(f"sudo -n systemctl stop {name}", timeout=60)
    thread.join(60)
    assert results[0][0] != 200
    assert host.workers() == [] and not any(g["procs"] for g in host.gpus())
    assert "died unexpectedly" in host.run(f"sudo -n journalctl -u {name} --no-pager -o cat")


def _main_pid(host: Host, name: str) -> int:
    return int(host.show(name, "MainPID"))


def test_engine_death_exits_0_and_restart_always_brings_it_back(
    host: Host, unit: Callable[..., tuple[str, str]]
) -> None:
    """Kill the engine core: the API server exits 0 and systemd restarts the unit."""
    name, url = unit("mixed", restart=True)
    assert wait_for(lambda: health(url) == 200, timeout=60)
    first = _main_pid(host, name)
    (core,) = host.titled("EngineCore")
    t0 = time.monotonic()
    host.run(f"sudo -n kill -9 {core}")
    assert wait_for(lambda: _main_pid(host, name) not in (0, first), timeout=30)
    assert wait_for(lambda: health(url) == 200, timeout=60), host.run(
        f"sudo -n journalctl -u {name} --no-pager -o cat", check=False
    )
    print(f"\nengine core killed → serving again after {time.monotonic() - t0:.1f}s (RestartSec=1)")
    assert int(host.show(name, "NRestarts")) == 1, host.run(f"sudo -n journalctl -u {name} --no-pager -o cat")
    journal = host.run(f"sudo -n journalctl -u {name} --no-pager -o cat", check=False)
    assert "Scheduled restart job" in journal
    assert "Main process exited" not in journal  # systemd logs that only for a non-zero exit
    # systemctl stop is a stop systemd asked for: not restarted.
    host.run(f"sudo -n systemctl stop {name}", timeout=60)
    time.sleep(3)  # three RestartSec
    assert host.run(f"systemctl is-active {name}", check=False).strip() == "inactive"
    assert host.show(name, "MainPID") == "0"
    journal = host.run(f"sudo -n journalctl -u {name} --no-pager -o cat", check=False)
    assert journal.count("Scheduled restart job") == 1  # the crash's, none after the stop
    assert host.workers() == []


def test_crash_loop_hits_the_start_limit(host: Host, unit: Callable[..., tuple[str, str]]) -> None:
    """An engine that dies right after every start (exit 0 each time) is restarted until the
    template's start-rate limit, then the unit is ``failed`` with ``start-limit-hit``."""
    burst = int(template_lines("StartLimitBurst")[0].split("=")[1])
    faults = f"{HOME}/crash-faults.json"
    host.put(faults, json.dumps({"crash_after_seconds": 0.2}))
    name, _ = unit("mixed", restart=True, env=f"FLEET_LAB_FAULTS={faults}")
    assert wait_for(lambda: host.show(name, "Result") == "start-limit-hit", timeout=30 + 15 * burst), (
        host.show(name, "NRestarts"), host.run(f"sudo -n journalctl -u {name} --no-pager -o cat", check=False)
    )  # fmt: skip
    assert host.run(f"systemctl is-active {name}", check=False).strip() == "failed"
    journal = host.run(f"sudo -n journalctl -u {name} --no-pager -o cat", check=False)
    assert journal.count("EngineCore encountered a fatal error.") == burst  # every allowed start crashed
    assert "Start request repeated too quickly." in journal
    assert host.workers() == []


@pytest.mark.parametrize("outcome", ["killed", "deadlock", "ignored"])
def test_stop_while_loading_ends_in_a_known_state(
    host: Host, unit: Callable[..., tuple[str, str]], outcome: str
) -> None:
    """``systemctl stop`` while the model loads, whichever of the real engine's three ways the
    SIGTERM takes (fault ``sigterm_while_loading``): killed is a clean stop; a deadlock or an
    ignored SIGTERM ends in SIGKILL at ``TimeoutStopSec``, which ``systemctl stop`` does not report
    (exit 0) but the unit's ``Result`` does (``fleet.rollout.stopping``: what the rollout journals).
    Either way ``KillMode=mixed`` leaves no engine core and NVML shows the GPUs free."""
    from fleet.facts.systemctl_show import show_properties
    from fleet.rollout.stopping import STOP_PROPS, stop_outcome

    faults = f"{HOME}/faults-{outcome}.json"
    host.put(faults, json.dumps({"sigterm_while_loading": outcome, "load_seconds": 8}))
    name, _url = unit("mixed", env=f"FLEET_LAB_FAULTS={faults}", timeout_stop=5)
    assert wait_for(lambda: bool(host.titled("EngineCore")), timeout=30)
    started = time.monotonic()
    host.run(f"sudo -n systemctl stop {name}", timeout=60)  # exits 0 in all three cases
    took = time.monotonic() - started
    said = stop_outcome(show_properties(host.run(f"systemctl show -p {','.join(STOP_PROPS)} {name}")))
    if outcome == "killed":
        assert said == "stopped" and took < 5, (said, took)
    else:
        assert said.startswith("stopped by SIGKILL after TimeoutStopSec (Result=timeout"), said
        assert took >= 5
    assert host.pids(name) == [] and host.workers() == []
    assert all(not g["procs"] for g in host.gpus())
