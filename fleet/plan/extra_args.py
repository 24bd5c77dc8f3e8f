"""``vllm_extra_args``: any ``vllm serve`` flag fleet has no key for, checked against the pinned vLLM.

The inventory's grammar (``fleet.inventory.schema``) checks the shape: long flag names, at most 64
flags, printable one-line text, finite numbers. Here, when an inventory is loaded to plan (before
any host is touched), each flag is looked up in the pinned release's real argument surface
(``fleet.plan.vllm_surface``: a dump of vLLM's own ``make_arg_parser``,
``vllm/entrypoints/openai/cli_args.py``) and refused, with the way out, when it is:

* not a flag of that release (with "did you mean"), or a flag vLLM removed (``--swap-space``,
  ``--speculative-model``...: the replacement is named);
* a flag that release keeps only as a deprecated alias (``--disable-log-requests``,
  ``--log-config-file``, ``--model``...);
* a flag fleet plans itself (``--max-model-len``, ``--port``...): the inventory key to set instead;
* a flag that changes memory fleet's plan does not count (``--kv-cache-memory-bytes``,
  ``--cpu-offload-gb``, ``--block-size``, LoRA, parallelism across hosts), or that would bypass the
  inventory (``--config``: a YAML file of flags; ``--api-key``/``--hf-token``: a secret in argv);
* a value of the wrong form for the flag (a switch given a value, one value given a list), a value
  that starts with ``-`` and is not a number (it would be read as the next flag), or a value that
  vLLM's parser refuses (its type and choices: the whole extra argv is parsed by the surface).

Values land in the unit's ``ExecStart=`` through ``fleet.escape.systemd_arg`` (quoted, ``%`` and
``$`` escaped), one argv token each, so whitespace, quotes or ``;`` in a value stay inside it; no
shell ever sees them.

The shape: a mapping of flag to value, as vLLM's own ``--config`` YAML file is (a key per flag),
since a flag given twice is last-wins in argparse and so silently wrong; the flag written as
``vllm serve --help`` prints it, so it can be copied from there.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.errors import FieldProblem
from fleet.inventory.spec import ExtraArgValue, HostSpec
from fleet.plan.vllm_surface import SurfaceError, accepted_flags, known_versions, load_surface, parse_serve_argv

KEY = "vllm_extra_args"
SET_BY_YOU_REASON = "set by you (vllm_extra_args)"

#: ``dest`` of each flag fleet plans itself -> the inventory key that decides it.
PLANNED: dict[str, str] = {
    "model_tag": "model",
    "model": "model",
    "served_model_name": "served_model_name",
    "host": "bind_address",
    "port": "port",
    "tensor_parallel_size": "tensor_parallel_size (or let fleet choose it)",
    "max_model_len": "workload.p95_input_tokens and workload.p95_output_tokens (fleet derives --max-model-len)",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "dtype": "weights",
    "quantization": "weights",
    "kv_cache_dtype": "kv_cache_dtype",
    "enable_prefix_caching": "prefix_caching",
    "shutdown_timeout": "shutdown_timeout",
    "max_num_seqs": "serving_preset (throughput, latency, long_context)",
    "max_num_batched_tokens": "serving_preset (throughput, latency, long_context)",
    "speculative_config": "speculative (fleet plans the draft's weights and KV cache from it)",
    "spec_method": "speculative.method",
    "spec_model": "speculative.model",
    "spec_tokens": "speculative.num_speculative_tokens",
    "enable_lora": "lora_adapters (fleet plans the adapters' GPU slots from it)",
    "lora_modules": "lora_adapters (each adapter staged to the hosts like a model)",
    "max_loras": "max_loras (with lora_adapters)",
    "max_lora_rank": "max_lora_rank (with lora_adapters)",
    "max_cpu_loras": "max_cpu_loras (with lora_adapters)",
    "api_key": "api_key_ref (the key reaches the host in a root-only environment file, never in argv)",
}

#: ``dest`` of flags fleet refuses as extra flags, and why (the plan's memory or the inventory's rules).
REFUSED: dict[str, str] = {
    "config": "a YAML file of flags on the host would set flags behind the plan's back; write them here instead",
    "hf_token": "a secret in argv is visible in `ps` and the journal; give the host HF_TOKEN another way",
    "kv_cache_memory_bytes": "it overrides --gpu-memory-utilization and the KV budget fleet plans; "
    "set gpu_memory_utilization instead",
    "num_gpu_blocks_override": "it overrides the KV cache size fleet plans (vLLM: for testing)",
    "block_size": "fleet's KV arithmetic is vLLM's at its default block size",
    "cpu_offload_gb": "weight offload changes the weights' GPU memory fleet plans",
    "cpu_offload_params": "weight offload changes the weights' GPU memory fleet plans",
    "kv_offloading_size": "KV offload changes the KV budget fleet plans",
    "pipeline_parallel_size": "fleet plans one host per instance (tensor parallel inside an NVLink island)",
    "data_parallel_size": "fleet runs one instance per GPU group instead (data parallel as separate units)",
    "data_parallel_size_local": "fleet runs one instance per GPU group instead",
    "nnodes": "fleet plans one host per instance",
    "node_rank": "fleet plans one host per instance",
    "headless": "fleet's gates need each instance's API server",
    "uds": "fleet's gates and balancers reach instances on their port",
    "device_ids": "fleet picks each instance's GPUs (CUDA_VISIBLE_DEVICES)",
    "fully_sharded_loras": "it changes the LoRA slots' size per GPU, which the plan counts unsharded (lora_adapters)",
    "lora_dtype": "the plan counts the LoRA slots in the model's dtype (lora_adapters)",
    "lora_target_modules": "the plan counts LoRA slots on every layer vLLM wraps by default (lora_adapters)",
}

#: Flags vLLM removed (``vllm serve`` refuses them: ``unrecognized arguments``), with the way out.
#: vLLM 0.33.0's release notes and ``arg_utils.py``; see the module docstring.
REMOVED: dict[str, str] = {
    "--swap-space": "removed in vLLM 0.18 (a no-op in the V1 engine); leave it out, or use --kv-offloading-size",
    "--speculative-model": "removed in vLLM 0.8 in favour of --speculative-config",
    "--num-speculative-tokens": "removed in vLLM 0.8 in favour of --speculative-config",
    "--speculative-draft-tensor-parallel-size": "removed in vLLM 0.8 in favour of --speculative-config",
    "--num-scheduler-steps": "multi-step scheduling was removed in vLLM 0.10.1; leave it out",
    "--preemption-mode": "V0 only; the V1 engine always preempts by recompute; leave it out",
    "--use-v2-block-manager": "V0 only; leave it out",
}

#: Flags vLLM 0.33.0 accepts only as deprecated aliases (``arg_utils.py`` 456–478, ``cli_args.py``).
DEPRECATED: dict[str, str] = {
    "--disable-log-requests": "a deprecated no-op alias in vLLM 0.33 (request logging is off by default); leave it out",
    "--no-enable-log-requests": "request logging is off by default; leave it out",
    "--log-config-file": "deprecated in vLLM 0.33 (to be removed); use --logging-config",
    "--mamba-cache-mode": "deprecated in vLLM 0.33",
    "--disable-cascade-attn": "deprecated in vLLM 0.33: it has no effect",
    "--ir-op-priority": "deprecated in vLLM 0.33",
}

_JSON_TYPES = ("loads", "_optional_type", "parse_dataclass", "union_dict_and_str")


@dataclass(frozen=True)
class ExtraFlag:
    """One extra flag as it lands in argv: its canonical option and its value tokens."""

    option: str
    values: tuple[str, ...]
    written: str  #: the key as the inventory writes it

    def argv(self, append: bool = False) -> list[str]:
        if append:
            return [t for v in self.values for t in (self.option, v)]
        return [self.option, *self.values]


def canonical(flag: str) -> str:
    """``max_num_seqs`` / ``--max_num_seqs`` -> ``--max-num-seqs`` (vLLM reads ``_`` as ``-``)."""
    return "--" + flag.removeprefix("--").replace("_", "-")


def _records(version: str) -> dict[str, dict[str, Any]]:
    """Option string -> its argument record, hidden ``--no-enable-x`` forms included."""
    out: dict[str, dict[str, Any]] = {}
    for arg in load_surface(version):
        for option in arg["options"]:
            out[option] = arg
        if arg["action"] == "EnableDisableAction":
            out["--no-" + arg["dest"].replace("_", "-")] = arg
    return out


def _token(value: bool | int | float | str) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _resolve(option: str, record: dict[str, Any], value: ExtraArgValue) -> ExtraFlag | str:
    """The flag's argv for this value, or why the value does not fit the flag."""
    action, nargs = record["action"], record["nargs"]
    if action == "EnableDisableAction":
        if not isinstance(value, bool):
            return "an enable/disable switch: true (or false for its --no- form)"
        primary = "--" + record["dest"].replace("_", "-")
        if option != primary:
            return f"write it as {primary}: true or false"
        return ExtraFlag(primary if value else "--no-" + primary[2:], (), option)
    if action == "_StoreTrueAction" or nargs == 0:
        if value is not True:
            return "a switch: true to give it, or leave it out (false is vLLM's default)"
        return ExtraFlag(option, (), option)
    if isinstance(value, bool):
        if value and nargs == "?":
            return ExtraFlag(option, (), option)
        return "takes a value" + (" (a JSON object)" if str(record["type"]) in _JSON_TYPES else "")
    many = nargs in ("+", "*") or action == "_AppendAction"
    items = value if isinstance(value, tuple) else (value,)
    if len(items) > 1 and not many:
        return "takes one value, not a list"
    tokens = tuple(_token(v) for v in items)
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            return f"the value {token!r} starts with '-': vLLM would read it as another flag, not as this one's value"
        if not token:
            return "an empty value"
    return ExtraFlag(option, tokens, option)


@dataclass(frozen=True)
class ExtraArgs:
    """The host's extra flags that passed, and the problems of the others (field, value, allowed)."""

    flags: tuple[ExtraFlag, ...]
    problems: tuple[tuple[str, object, str], ...]
    appends: frozenset[str] = frozenset()  #: options that repeat per value (argparse ``append``)

    def argv(self) -> list[str]:
        return [t for f in self.flags for t in f.argv(f.option in self.appends)]


def parse_extra_args(pairs: Sequence[tuple[str, ExtraArgValue]], version: str) -> ExtraArgs:
    """Check each (flag, value) against vLLM ``version``'s surface; a pure function of its inputs."""
    if not pairs or version not in known_versions():
        return ExtraArgs((), ())  # an unknown release is the planner's error (plan_host)
    records = _records(version)
    known = sorted(o for o in accepted_flags(version) if o.startswith("--"))
    flags: list[ExtraFlag] = []
    problems: list[tuple[str, object, str]] = []
    seen: dict[str, str] = {}
    appends: set[str] = set()
    for written, value in pairs:
        fld = f"{KEY}.{written}"
        option = canonical(written)
        record = records.get(option)
        if option in REMOVED:
            problems.append((fld, value, f"{option}: {REMOVED[option]}"))
            continue
        if record is None:
            near = difflib.get_close_matches(option, known, n=1, cutoff=0.75)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            problems.append((fld, value, f"{option} is not a flag of vLLM {version}'s `vllm serve`{hint}"))
            continue
        dest = record["dest"]
        if option in DEPRECATED:
            problems.append((fld, value, f"{option}: {DEPRECATED[option]}"))
            continue
        if dest in PLANNED:
            problems.append((fld, value, f"{option} is planned by fleet: set {PLANNED[dest]} instead"))
            continue
        if dest in REFUSED:
            problems.append((fld, value, f"{option} is refused as an extra flag: {REFUSED[dest]}"))
            continue
        if dest in seen:
            problems.append((fld, value, f"{option} is the same vLLM setting as {seen[dest]!r}: give it once"))
            continue
        seen[dest] = written
        resolved = _resolve(option, record, value)
        if isinstance(resolved, str):
            problems.append((fld, value, f"{option}: {resolved}"))
            continue
        resolved = ExtraFlag(resolved.option, resolved.values, written)
        if record["action"] == "_AppendAction":
            appends.add(resolved.option)
        try:  # vLLM's own parser on the flag: types (human-readable ints...) and choices
            parse_serve_argv(["model", *resolved.argv(resolved.option in appends)], version)
        except SurfaceError as exc:
            problems.append((fld, value, f"vLLM {version} refuses it: {str(exc).split('error: ', 1)[-1]}"))
            continue
        flags.append(resolved)
    return ExtraArgs(tuple(flags), tuple(problems), frozenset(appends))


def extra_args_problems(spec: HostSpec) -> list[FieldProblem]:
    """``load_inventory``'s ``host_check``: the host's refused extra flags, as inventory problems."""
    parsed = parse_extra_args(spec.vllm_extra_args, spec.vllm_version)
    return [FieldProblem(spec.source_of(KEY), spec.name, f, v, why) for f, v, why in parsed.problems]
