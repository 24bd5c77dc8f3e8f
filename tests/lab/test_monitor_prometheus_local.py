"""A real Prometheus (Debian's package) scraping real stand-in instances with fleet's exported
configuration: one instance driven into KV pressure and preemptions by load must raise its alerts
(pending, then firing), read back through Prometheus' own HTTP API; the others stay quiet.

The instances run on this machine as in ``test_vllm_standin_local`` (its fixtures are reused:
the built stand-in wheel in a venv, the simulated NVML), three of them on loopback ports, one GPU
each. The inventory points at them (``ssh_hostname: 127.0.0.1``, ``port``) and sets short
``alerts`` durations so the test runs in seconds; ``fleet monitor export`` is run as operators run it.
``fleet status --json`` is read during the load too. Everything stops in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.lab.polling import wait_for
from tests.lab.test_vllm_standin_local import (  # noqa: F401  (fixtures are used by name)
    LLAMA_8B,
    Server,
    free_port,
    http,
    lab,
    run,
)

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and os.environ.get("FLEET_LAB_REQUIRED") != "1",
    reason="prometheus (Debian package) not installed",
)

WORKLOAD = {"p95_input_tokens": 200, "p95_output_tokens": 100, "prefix_reuse": 0.0, "target_concurrency": 4}
ALERTS = {"for": "2s", "kv_cache_usage": 0.6, "waiting_requests": 2, "preemption_window": "30s",
          "preemption_for": "2s", "latency_window": "30s"}  # fmt: skip


def fleet(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)  # fmt: skip


def write_inventory(path: Path, servers: dict[str, Server]) -> None:
    hosts = []
    for name, server in servers.items():
        data = {"ssh_hostname": "127.0.0.1", "port": server.port, "model": LLAMA_8B, "workload": WORKLOAD,
                "gpu": {"sku": "h100-sxm-80gb", "count": 1}, "alerts": ALERTS}  # fmt: skip
        hosts.append((name, data))
    path.write_text(f"serving = {hosts!r}\n")


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A directory Prometheus can use whichever user it runs as; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="fleet-prometheus-"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def prometheus(config: Path, data: Path, log: Path) -> Iterator[str]:
    """Prometheus on a loopback port with its own storage; as ``nobody`` when we are root.

    inotify instances are counted per user (``fs.inotify.max_user_instances``, 128 by default) and
    booted lab hosts are root's systemds; file-based discovery needs one, so a root Prometheus next
    to a few labs cannot watch its target files. Its own user gets its own budget.
    """
    assert PROMETHEUS, "prometheus not installed (scripts/install.sh installs it)"
    port = free_port()
    data.mkdir()
    user = {}
    if os.geteuid() == 0:
        os.chown(data, 65534, 65534)
        user = {"user": 65534, "group": 65534, "extra_groups": []}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=out, stderr=subprocess.STDOUT, cwd=data, start_new_session=True, **user,  # type: ignore[call-overload]
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_for(lambda: _status(url + "/-/ready") == 200, timeout=30, step=0.2)
        assert ready, f"prometheus not ready:\n{log.read_text(errors='replace')[-3000:]}"
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _status(url: str) -> int:
    try:
        return http(url, timeout=2)[0]
    except OSError:
        return -1


def api(url: str, path: str, **params: str) -> Any:
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    status, body, _ = http(f"{url}/api/v1/{path}{query}", timeout=5)
    assert status == 200, body
    data = json.loads(body)
    assert data["status"] == "success", data
    return data["data"]


class Load:
    """Bounded background load: ``workers`` threads each sending completions until stopped."""

    def __init__(self, server: Server, workers: int, max_tokens: int, deadline_s: float = 120) -> None:
        self.stop = threading.Event()
        self.sent = 0
        self.errors: list[str] = []
        self.deadline = time.monotonic() + deadline_s
        self.threads = [
            threading.Thread(target=self._loop, args=(server, i, max_tokens), daemon=True) for i in range(workers)
        ]

    def _loop(self, server: Server, i: int, max_tokens: int) -> None:
        n = 0
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            n += 1
            prompt = " ".join(["word"] * (20 + (i * 7 + n) % 30)) + f" {i} {n}"
            try:
                status, body, _ = http(server.url + "/v1/completions",
                                       {"prompt": prompt, "max_tokens": max_tokens}, timeout=60)  # fmt: skip
                if status != 200:
                    self.errors.append(f"{status} {body[:200]!r}")
            except OSError as exc:
                self.errors.append(str(exc))
            self.sent += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def alerts_by_instance(url: str) -> dict[str, dict[str, str]]:
    """instance → {alertname: state} of every active (pending or firing) alert."""
    out: dict[str, dict[str, str]] = {}
    for alert in api(url, "alerts")["alerts"]:
        out.setdefault(alert["labels"].get("instance", alert["labels"].get("host", "?")), {})[
            alert["labels"]["alertname"]
        ] = alert["state"]
    return out


def test_prometheus_fires_kv_and_preemption_alerts_for_the_loaded_instance_only(
    run: Callable[..., Server],  # noqa: F811
    tmp_path: Path,
) -> None:
    with workdir() as work:
        _prometheus_fires(run, tmp_path, work)


def _prometheus_fires(run: Callable[..., Server], tmp_path: Path, work: Path) -> None:  # noqa: F811
    common = ("--served-model-name", LLAMA_8B, "--max-model-len", "1024")
    env = {"FLEET_LAB_TOKEN_SECONDS": "0.01"}
    servers = {
        # 24 blocks of 16 tokens (23 usable): a dozen 100-token requests cannot all fit.
        "hot": run(LLAMA_8B, *common, "--num-gpu-blocks-override", "24", env={**env, "CUDA_VISIBLE_DEVICES": "0"}),
        "calm-1": run(LLAMA_8B, *common, env={**env, "CUDA_VISIBLE_DEVICES": "1"}),
        "calm-2": run(LLAMA_8B, *common, env={**env, "CUDA_VISIBLE_DEVICES": "2"}),
    }
    for server in servers.values():
        server.wait_ready()
    inventory = tmp_path / "inventory.py"
    write_inventory(inventory, servers)
    export_dir = work / "prom"
    exported = fleet("monitor", "export", str(inventory), str(export_dir), "--scrape-interval", "1s",
                     "--evaluation-interval", "1s", "--node-exporter-port", "0", "--json")  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    assert {t["instance"] for t in json.loads(exported.stdout)["targets"]} == {f"{h}/vllm-0" for h in servers}

    with prometheus(export_dir / "prometheus.yml", work / "tsdb", work / "prometheus.log") as url:

        def all_up() -> bool:
            active = api(url, "targets")["activeTargets"]
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        up = wait_for(all_up, timeout=20, step=0.5)
        assert up, f"{api(url, 'targets')}\n{(work / 'prometheus.log').read_text(errors='replace')[-2000:]}"
        rules = api(url, "rules")["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"VllmKvCacheHigh", "VllmPreemptionsHigh"}

        seen: dict[str, set[str]] = {}
        with Load(servers["hot"], workers=12, max_tokens=100) as hot, Load(servers["calm-1"], 1, 8) as calm:

            def hot_alerts_firing() -> bool:
                current = alerts_by_instance(url)
                for instance, alerts in current.items():
                    for name, state in alerts.items():
                        seen.setdefault(f"{instance} {name}", set()).add(state)
                hot_now = current.get("hot/vllm-0", {})
                return hot_now.get("VllmKvCacheHigh") == "firing" and hot_now.get("VllmPreemptionsHigh") == "firing"

            fired = wait_for(hot_alerts_firing, timeout=45, step=0.25)
            # the instances run on this machine, not on hosts fleet reaches over SSH: HTTP side only
            status = fleet("status", str(inventory), "--json", "--interval", "1", "--no-ssh")
        assert fired, f"alerts seen: {seen}\nload errors: {hot.errors[:5]}"
        assert hot.sent > 12 and calm.sent > 0
        # pending was observed on the way to firing, for the KV alert at least (for: 2s, evaluated every 1s)
        assert "pending" in seen["hot/vllm-0 VllmKvCacheHigh"]
        quiet = {k: v for k, v in seen.items() if not k.startswith("hot/")}
        assert not quiet, f"alerts on instances under no pressure: {quiet}"

        # Prometheus' own view of the numbers behind the alerts
        kv = api(url, "query", query='vllm:kv_cache_usage_perc{instance="hot/vllm-0"}')["result"]
        assert kv and kv[0]["metric"]["host"] == "hot" and kv[0]["metric"]["group"] == "serving"
        preempted = api(url, "query", query='vllm:num_preemptions_total{instance="hot/vllm-0"}')["result"]
        assert float(preempted[0]["value"][1]) > 0
        calm_preempted = api(url, "query", query='vllm:num_preemptions_total{host=~"calm-.*"}')["result"]
        assert [float(r["value"][1]) for r in calm_preempted] == [0.0, 0.0]

        # The observed workload, read back from this Prometheus (fleet plan --observed URL's source)
        observed = fleet("monitor", "observe", str(inventory), "--prometheus", url, "--window", "5m", "--json")
        assert observed.returncode == 0, observed.stderr
        reports = {h["host"]: h for h in json.loads(observed.stdout)["hosts"]}
        assert reports["hot"]["observed"]["peak_concurrency"] >= 6  # 12 clients on a cache that holds a few
        assert reports["calm-2"]["observed"]["peak_concurrency"] == 0  # nothing was sent to it
        assert "Prometheus" in reports["hot"]["observed"]["source"]
        hot_obs = reports["hot"]["observed"]
        if hot_obs["p95_output_tokens"] is not None:  # stand-ins exporting vllm:request_generation_tokens
            low, high = hot_obs["p95_output_tokens"]["bucket"]
            assert low < 100 <= high  # every hot request asked for 100 tokens
        else:
            assert any("vllm:request_generation_tokens not exported" in n for n in hot_obs["notes"])
        via_plan = fleet("plan", str(inventory), "--observed", url, "--json")
        assert via_plan.returncode == 0 and {h["host"] for h in json.loads(via_plan.stdout)["hosts"]} == set(servers)

    # fleet status saw the same picture during the load (HTTP side)
    rows = {r["instance"]: r for r in json.loads(status.stdout)["instances"]}
    assert status.returncode == 1  # the hot instance breaks thresholds
    assert all(r["health"] == "ready" and r["vllm_version"].startswith("0.33.0") for r in rows.values())
    assert rows["hot/vllm-0"]["problems"], rows["hot/vllm-0"]
    assert rows["calm-1/vllm-0"]["ok"] and rows["calm-2/vllm-0"]["ok"], (rows["calm-1/vllm-0"], rows["calm-2/vllm-0"])
    assert rows["calm-1/vllm-0"]["interval"]["requests_finished"] > 0
