"""Preflight: on each host, before anything restarts, would the new units start?

Three checks per instance, each a refusal that names the host, the instance, the check and the
way out:

* ``flags``: the host's own installed vLLM parses the planned argv with its own parser
  (:class:`fleet.facts.serve_check.ServeCheck`): flag drift between vLLM versions stops here;
* ``model``: the model's files resolve on the host (local directory with ``config.json``, or the
  Hugging Face cache, since units run with ``HF_HUB_OFFLINE=1``);
* ``gpus``: the instance's GPUs are free or held only by our own units (``fleet-vllm-*.service``),
  from the NVML probe's process list and each process's systemd unit (its cgroup).

The decision (:func:`refusals`) is pure; :func:`run_preflight` gathers the facts in parallel.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.runner import HostUnreachable, SshTarget, run_fact_on_hosts
from fleet.facts.serve_check import ServeCheck, ServeCheckResult
from fleet.facts.units import OUR_UNIT_PREFIX
from fleet.plan.planner import Flag, HostPlan
from fleet.render.units import HostPaths


@dataclass(frozen=True)
class Refusal:
    host: str
    instance: str  #: the unit (``fleet-vllm-0.service``), or ``*`` for the whole host
    check: str  #: "flags", "model", "gpus", "vllm", "ssh"
    reason: str
    way_out: str

    def __str__(self) -> str:
        return f"host {self.host}, {self.instance}: preflight {self.check}: {self.reason}; {self.way_out}"


def unit_of(instance_unit_name: str) -> str:
    return f"fleet-{instance_unit_name}.service"


def _flags_way_out(parse_error: str, flags: Sequence[Flag], planned: str) -> str:
    """What to do about a refused command line: the flags vLLM names, why fleet planned them."""
    named = [f for f in flags if re.search(rf"(?<![\w-]){re.escape(f.option)}(?![\w-])", parse_error)]
    install = (
        f"install a vLLM that takes it: fleet planned for vLLM {planned} (vllm_version), from the index "
        "the inventory names (pip_index_url)"
    )
    if not named:
        return install + ", or change the inventory setting behind the refused flag"
    why = "; ".join(f"{f.option}: {f.reason}" for f in named)
    return f"fleet planned {why}; {install}, or change that inventory setting so the flag is not planned"


def refusals(plan: HostPlan, check: ServeCheckResult, facts: HostFacts | None) -> list[Refusal]:
    """Every reason the host's new units would not start; empty: go ahead."""
    host = plan.host
    if check.error is not None:
        return [
            Refusal(host, "*", "vllm", f"the release's vLLM cannot be imported ({check.error})",
                    "reinstall the release (remove it under /opt/fleet/vllm/releases and deploy again)")
        ]  # fmt: skip
    out: list[Refusal] = []
    by_unit = {c.unit: c for c in check.instances}
    for inst in plan.instances:
        unit = unit_of(inst.unit_name)
        c = by_unit.get(unit)
        if c is None:
            out.append(Refusal(host, unit, "flags", "the host's vLLM gave no answer for it", "run the deploy again"))
            continue
        if c.parse_error is not None:
            out.append(Refusal(host, unit, "flags", f"the host's vLLM refuses the command line: {c.parse_error}",
                               _flags_way_out(c.parse_error, inst.flags, plan.vllm_version)))  # fmt: skip
        if not c.model_found:
            out.append(
                Refusal(host, unit, "model", f"model {inst.model} not found on the host (looked in {c.model_where})",
                        "put the model's files there (huggingface-cli download, as the vllm user) or fix `model`")
            )  # fmt: skip
        if facts is None or not facts.ok:
            why = "the NVML probe failed" if facts is None else f"NVML: {facts.error_message or facts.status}"
            out.append(Refusal(host, unit, "gpus", f"cannot see who holds the GPUs ({why})",
                               "check the driver (fleet probe) and deploy again"))  # fmt: skip
            continue
        gpus = {g.index: g for g in facts.gpus}
        for index in inst.gpus:
            g = gpus.get(index)
            if g is None:
                out.append(Refusal(host, unit, "gpus", f"GPU {index} is not visible to NVML",
                                   "check the host's GPUs (fleet probe) or its inventory gpu entry"))  # fmt: skip
                continue
            for p in g.processes or ():
                if p.unit is not None and p.unit.startswith(OUR_UNIT_PREFIX):
                    continue
                out.append(
                    Refusal(host, unit, "gpus",
                            f"GPU {index} is held by pid {p.pid} ({p.comm or '?'}, unit {p.unit or 'none'})",
                            "stop that process (or move it to other GPUs), then deploy again")
                )  # fmt: skip
    return out


def run_preflight(
    targets: Mapping[str, SshTarget],
    plans: Mapping[str, HostPlan],
    paths: HostPaths,
    venvs: Mapping[str, str] | None = None,
    run_fact: Callable[..., Mapping[str, Any]] = run_fact_on_hosts,
) -> dict[str, list[Refusal]]:
    """Preflight every host in parallel: ``{host: refusals}`` (empty list: ready). ``venvs``: the
    release each host's new command line will run on (default ``paths.venv``). ``run_fact``: how the
    facts are read (``run_fact_on_hosts``'s signature; ``fleet deploy`` reads them through its own
    connections)."""

    def python(name: str) -> str:
        return f"{(venvs or {}).get(name, paths.venv)}/bin/python"

    checks = run_fact(
        targets.values(), ServeCheck, user=paths.user, hf_home=f"{paths.state_dir}/hf",
        args_for=lambda name: {
            "python": python(name), "jobs": [(unit_of(i.unit_name), i.argv) for i in plans[name].instances]
        },
    )  # fmt: skip
    probes = run_fact(targets.values(), NvmlProbe, args_for=lambda name: {"python": python(name)})
    out: dict[str, list[Refusal]] = {}
    for name, check in checks.items():
        if isinstance(check, HostUnreachable):
            out[name] = [Refusal(name, "*", "ssh", check.reason, "check the host and deploy again")]
            continue
        probe = probes.get(name)
        out[name] = refusals(plans[name], check, probe if isinstance(probe, HostFacts) else None)
    return out
