"""Planning for vLLM's CPU build (``vllm_cpu``, the lab's real engine): what each instance needs in
its environment, with the reason for each value. Pure; table-tested.

vLLM's CPU backend is configured through two environment variables, both read by the CPU worker
(vLLM 0.32.0 ``vllm/envs.py``; ``vllm/platforms/cpu.py`` ``CpuPlatform.check_and_update_config``
and ``vllm/v1/worker/cpu_worker.py`` ``CPUWorker.init_device``):

* ``VLLM_CPU_KVCACHE_SPACE``: the KV cache in GiB. Unset (0), vLLM sizes it from the machine's
  memory, so two instances on one machine take most of it between them; fleet caps it.
* ``VLLM_CPU_OMP_THREADS_BIND``: the CPUs the worker's OpenMP threads are pinned to
  (``0-3,5``-style lists, ``|`` between tensor-parallel ranks). Its default, ``auto``, binds each
  rank to the cores of a NUMA node counted from the first, so every instance on a one-node
  machine pins the same cores (CPU 0 first) and they fight over them; fleet gives each instance
  its own share of ``vllm_cpu.cpus``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.inventory.spec import VllmCpuSpec


@dataclass(frozen=True)
class CpuEnv:
    """One instance's CPU-build environment and why."""

    env: tuple[tuple[str, str], ...]
    reason: str


class CpuPlanError(ValueError):
    """The host's ``vllm_cpu.cpus`` cannot give every rank of every instance a CPU of its own."""


def cpu_list(cpus: tuple[int, ...]) -> str:
    """``0-3,5``: runs of consecutive CPUs as ranges (the form vLLM's CPU worker parses)."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    start = prev = ordered[0]
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def share(cpus: tuple[int, ...], parts: int, k: int) -> tuple[int, ...]:
    """Part ``k`` of ``parts`` contiguous, near-equal shares of ``cpus`` (in the order given)."""
    n = len(cpus)
    return cpus[k * n // parts : (k + 1) * n // parts]


def cpu_env(cpu: VllmCpuSpec, index: int, instances: int, tp: int) -> CpuEnv:
    """Instance ``index``'s environment among ``instances`` on the host, each of ``tp`` ranks.

    ``CpuPlanError`` when there are fewer distinct CPUs than ranks in all (two would share one).
    """
    cpus = tuple(dict.fromkeys(cpu.cpus))
    ranks = instances * tp
    if len(cpus) < ranks:
        raise CpuPlanError(
            f"vllm_cpu.cpus {list(cpus)}: {instances} instance(s) x TP {tp} = {ranks} CPU worker(s) need a CPU "
            f"each, {len(cpus)} given: list more CPUs, or serve fewer instances"
        )
    mine = share(cpus, instances, index)
    binds = "|".join(cpu_list(share(mine, tp, r)) for r in range(tp))
    reason = (
        f"vLLM's CPU build: KV cache capped at {cpu.kv_cache_gib} GiB (VLLM_CPU_KVCACHE_SPACE; unset, vLLM sizes "
        f"it from the machine's memory), worker threads bound to CPUs {binds} (VLLM_CPU_OMP_THREADS_BIND; "
        f"its default binds every instance to the same cores), instance {index} of {instances} on "
        f"vllm_cpu.cpus {cpu_list(cpus)}"
    )
    env = (("VLLM_CPU_KVCACHE_SPACE", str(cpu.kv_cache_gib)), ("VLLM_CPU_OMP_THREADS_BIND", binds))
    return CpuEnv(env, reason)
