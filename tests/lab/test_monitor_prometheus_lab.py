"""A real Prometheus (Debian's package, started by the test on loopback) scraping a lab fleet that
``fleet deploy`` took to serving, with the configuration ``fleet monitor export`` wrote from the
same inventory: load drives one instance's KV cache past the inventory's threshold and its alert
must go pending, then firing, read back through Prometheus' own API, while the other instances
stay quiet. Everything stops in ``finally`` (Prometheus, the load, the lab).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleetlab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT
from .polling import wait_for
from .test_monitor_prometheus_local import alerts_by_instance, api, prometheus, workdir
from .test_status_lab import FLEET, place_model_config

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        shutil.which("prometheus") is None and os.environ.get("FLEET_LAB_REQUIRED") != "1",
        reason="prometheus (Debian package) not installed",
    ),
]

#: Alert settings an operator puts in the inventory: short durations so the test runs in seconds.
ALERTS = {"for": "2s", "kv_cache_usage": 0.5}


def with_alerts(lab_inventory: Path, out: Path) -> None:
    """The lab's inventory with ``alerts`` data on every host (what an operator would add)."""
    scope: dict[str, Any] = {}
    exec(compile(lab_inventory.read_text(), str(lab_inventory), "exec"), scope)  # the lab wrote it: trusted
    hosts = [(name, {**data, "alerts": ALERTS}) for name, data in scope["lab"]]
    out.write_text(f"lab = {hosts!r}\n")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabFleet, Path]]:
    """Two lab hosts (2x RTX 4090 each, so four instances) deployed from an inventory with alerts."""
    require_lab()
    root = tmp_path_factory.mktemp("prom-lab")
    octet = free_octet(os.getpid() + 41, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pp{os.getpid()}", octet, 2, ("rtx4090-2", "rtx4090-2")))
    try:
        lab = LabFleet(opts, bring_up(opts))
        inventory = root / "fleet.py"
        with_alerts(opts.inventory, inventory)
        for i in range(2):
            place_model_config(lab, i)
        proc = subprocess.run(
            [str(FLEET), "deploy", str(inventory), "--json", "--health-timeout", "180"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield lab, inventory
    finally:
        lab_ops.down(opts.name, opts.state_root)


class Load:
    """``workers`` threads sending long completions to one URL until stopped (bounded by a deadline)."""

    def __init__(self, url: str, workers: int, prompt_words: int, max_tokens: int, deadline_s: float = 120) -> None:
        self.url, self.prompt_words, self.max_tokens = url, prompt_words, max_tokens
        self.stop = threading.Event()
        self.deadline = time.monotonic() + deadline_s
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(workers)]

    def _loop(self, i: int) -> None:
        n = 0
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            n += 1
            prompt = " ".join(["word"] * self.prompt_words) + f" {i} {n}"
            body = json.dumps({"prompt": prompt, "max_tokens": self.max_tokens}).encode()
            req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                         headers={"content-type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=60) as resp:
                    resp.read()
                self.done += 1
            except (OSError, urllib.error.HTTPError) as exc:
                self.errors.append(str(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def test_prometheus_fires_the_kv_alert_for_the_loaded_lab_instance_only(
    deployed: tuple[LabFleet, Path], tmp_path: Path
) -> None:
    lab, inventory = deployed
    hosts = [h.name for h in lab.state.hosts]
    hot = f"{hosts[0]}/vllm-0"
    with workdir() as work:
        export_dir = work / "prom"
        exported = subprocess.run(
            [str(FLEET), "monitor", "export", str(inventory), str(export_dir), "--scrape-interval", "1s",
             "--evaluation-interval", "1s", "--node-exporter-port", "0", "--json"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr
        targets = json.loads(exported.stdout)["targets"]
        assert {t["instance"] for t in targets} == {f"{h}/vllm-{i}" for h in hosts for i in (0, 1)}
        hot_url = next(f"http://{t['target']}" for t in targets if t["instance"] == hot)

        with prometheus(export_dir / "prometheus.yml", work / "tsdb", work / "prometheus.log") as url:

            def all_up() -> bool:
                active = api(url, "targets")["activeTargets"]
                return len(active) == 4 and all(t["health"] == "up" for t in active)

            up = wait_for(all_up, timeout=30, step=0.5)
            assert up, f"{api(url, 'targets')}\n{(work / 'prometheus.log').read_text(errors='replace')[-2000:]}"
            # quiet before any load
            assert alerts_by_instance(url) == {}

            seen: dict[str, set[str]] = {}
            # 20 clients x (1200-token prompt + up to 1200 generated) on a 41,872-token KV cache
            with Load(hot_url, workers=20, prompt_words=1200, max_tokens=1200) as load:

                def hot_kv_firing() -> bool:
                    for instance, alerts in alerts_by_instance(url).items():
                        for name, state in alerts.items():
                            seen.setdefault(f"{instance} {name}", set()).add(state)
                    return "firing" in seen.get(f"{hot} VllmKvCacheHigh", set())

                fired = wait_for(hot_kv_firing, timeout=60, step=0.25)
                kv = api(url, "query", query=f'vllm:kv_cache_usage_perc{{instance="{hot}"}}')["result"]
            assert fired, f"alerts seen: {seen}; load errors: {load.errors[:5]}; hot KV: {kv}"
            assert "pending" in seen[f"{hot} VllmKvCacheHigh"]  # for: 2s, evaluated every 1s
            assert kv and float(kv[0]["value"][1]) > ALERTS["kv_cache_usage"], kv
            assert kv[0]["metric"]["host"] == hosts[0] and kv[0]["metric"]["group"] == "lab"
            quiet = {k: v for k, v in seen.items() if not k.startswith(hot + " ")}
            assert not quiet, f"alerts on instances under no load: {quiet}"
            others = api(url, "query", query=f'vllm:kv_cache_usage_perc{{instance!="{hot}"}}')["result"]
            assert len(others) == 3 and all(float(r["value"][1]) == 0.0 for r in others), others
