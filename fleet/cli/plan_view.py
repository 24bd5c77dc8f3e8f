"""How reports look to people: rich tables and colours. Data for machines lives elsewhere (``--json``)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fleet.gpus import GiB
from fleet.inventory.spec import HostSpec
from fleet.plan.outcomes import HostOutcome
from fleet.plan.planner import SET_BY_FLEET, HostPlan, Instance


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def cpu_memory_table(instance: Instance) -> Table:
    """vLLM's CPU build: the KV cache is ``VLLM_CPU_KVCACHE_SPACE``, in the host's memory (``cpu_memory``)."""
    m = instance.memory
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="dim")
    table.add_column(justify="right")
    table.add_row("CPU build: KV cache (VLLM_CPU_KVCACHE_SPACE)", _gib(m.kv_budget))
    table.add_row("weights in host memory (beside it)", _gib(m.weights))
    table.add_row("KV bytes / token", f"{m.kv_bytes_per_token:,}")
    table.add_row("KV tokens", f"{m.kv_tokens:,} (exact: no estimated terms)")
    table.add_row(f"max concurrency @ {m.max_model_len:,}", f"{m.max_concurrency:.2f}x")
    table.add_row(f"workload requests ({m.kv_tokens_per_request:,} KV tok)", f"{m.workload_concurrency:,}")
    return table


def memory_table(instance: Instance) -> Table:
    m = instance.memory
    if m.cpu_kv_cache_gib:
        return cpu_memory_table(instance)
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="dim")
    table.add_column(justify="right")
    if m.nvml_total:
        table.add_row("GPU total (NVML)", _gib(m.nvml_total))
        source = {"probe": "probed", "measured": "measured", "estimate": "estimated"}.get(m.reserve_source, "")
        table.add_row(f"− driver reserve ({source})", f"{m.reserved / 2**20:,.0f} MiB")
    table.add_row("= CUDA total", _gib(m.gpu_total))
    table.add_row(f"× utilization {m.utilization:.2f} (rounded up)", _gib(m.budget))
    table.add_row("− weights / GPU", _gib(m.weights))
    if m.lora is not None:
        table.add_row("  of which LoRA adapter slots", _gib(m.lora.bytes_per_gpu))
    if m.draft is not None:
        table.add_row("  of which the speculative draft", _gib(m.draft.weights))
        table.add_row("draft KV bytes / block / GPU", f"{m.draft.kv_bytes_per_block:,}")
    table.add_row("− non-torch (CUDA, NCCL)", _gib(m.non_torch))
    table.add_row("− activation peak (est.)", _gib(m.activation_peak))
    table.add_row("− CUDA graphs (est.)", _gib(m.cuda_graphs))
    table.add_row("= KV cache / GPU", _gib(m.kv_budget))
    table.add_row("KV bytes / token / GPU", f"{m.kv_bytes_per_token:,}")
    if m.kv_layout is not None and m.kv_layout.hybrid:
        layout = m.kv_layout
        table.add_row("KV groups (hybrid)", f"{len(layout.groups)} × {layout.bytes_per_block:,} B blocks")
        per_token = layout.bytes_per_token(m.max_model_len, m.in_flight_tokens)
        table.add_row(f"KV bytes / token @ {m.max_model_len:,}", f"{per_token:,.0f}")
    table.add_row("KV tokens", f"{m.kv_tokens:,} (± {m.kv_tokens_uncertainty:,} est.)")
    table.add_row(f"max concurrency @ {m.max_model_len:,}", f"{m.max_concurrency:.2f}x")
    table.add_row(f"workload requests ({m.kv_tokens_per_request:,} KV tok)", f"{m.workload_concurrency:,}")
    return table


def node_table(instance: Instance) -> Table:
    """The nodes of an instance spanning hosts: which hosts, the leader, each node's layers and KV."""
    node = instance.node
    assert node is not None
    table = Table(box=None, show_header=True, pad_edge=False, header_style="dim")
    for column in ("node", "host", "role", "layers", "KV tokens (instance)"):
        table.add_column(column)
    start = 0
    for rank, (host, layers) in enumerate(zip(node.hosts, node.partition, strict=True)):
        role = "leader: serves the API" if rank == 0 else "headless worker"
        mark = "bold" if rank == node.rank else ""
        table.add_row(
            str(rank), host, role, f"{start}-{start + layers - 1} ({layers})", f"{node.instance_kv_tokens:,}",
            style=mark,
        )  # fmt: skip
        start += layers
    return table


def flags_table(instance: Instance) -> Table:
    """One row per flag: the flag, its value, and under the value why it has it."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(ratio=1)
    for flag in instance.flags:
        value = " ".join(flag.argv()[1:]) or "(switch)"
        option = Text(flag.option, style="magenta" if flag.set_by != SET_BY_FLEET else "cyan")
        table.add_row(option, Group(Text(value, style="bold"), Text(flag.reason, style="dim")))
    env = " ".join(f"{k}={v}" for k, v in instance.env)
    why = "this instance's GPUs, numbered as NVML numbers them"
    if instance.memory.cpu_kv_cache_gib:
        why += "; vLLM's CPU build: its KV cache and CPUs (the notes say why)"
    table.add_row("environment", Group(Text(env, style="bold"), Text(why, style="dim")))
    return table


def _same_flags(a: Instance, b: Instance) -> bool:
    strip = {"--port"}
    return [(f.option, f.value) for f in a.flags if f.option not in strip] == [
        (f.option, f.value) for f in b.flags if f.option not in strip
    ] and a.memory == b.memory


def _instance_parts(instances: tuple[Instance, ...]) -> list[Table | Text]:
    """Each instance's GPUs, flags and memory; one with the first's flags and memory in one line."""
    parts: list[Table | Text] = []
    for instance in instances:
        if instance is not instances[0] and _same_flags(instance, instances[0]):
            parts.append(
                Text(
                    f"instance {instance.index}: GPUs {list(instance.gpus)}  port {instance.port}  "
                    f"(same flags and memory as instance {instances[0].index})",
                    style="bold",
                )
            )
            continue
        parts.append(
            Text(
                f"\ninstance {instance.index}: GPUs {list(instance.gpus)}  TP {instance.tensor_parallel_size}  "
                f"port {instance.port}",
                style="bold",
            )
        )
        if instance.node is not None:
            parts.append(node_table(instance))
        parts.append(flags_table(instance))
        parts.append(memory_table(instance))
    return parts


def _models_parts(plan: HostPlan, spec: HostSpec) -> list[Table | Text]:
    """A host with ``models``: each entry with its GPUs, instances, totals, notes and warnings."""
    parts: list[Table | Text] = []
    for m in plan.models:
        p = m.plan
        gpus = f"{m.gpus[0]}-{m.gpus[-1]}" if len(m.gpus) > 1 else str(m.gpus[0])
        parts.append(
            Text.assemble(
                (f"\nmodels[{m.entry}] ", "dim"),
                (m.model, "bold"),
                (f"  served as {m.served_name}  GPUs {gpus}", ""),
                (f"  weights {p.weights_precision} {_gib(p.weight_bytes)}", ""),
            )
        )
        parts += _instance_parts(p.instances)
        target = spec.models[m.entry].spec.workload.target_concurrency
        parts.append(
            Text(
                f"{len(p.instances)} instance(s), {p.total_kv_tokens:,} KV tokens, {p.workload_concurrency:,} "
                f"concurrent requests of the workload (target {target})"
            )
        )
        prefix = f"models[{m.entry}] {m.model}: "
        for note in plan.notes:
            if note.startswith(prefix) and not note.removeprefix(prefix).startswith("GPU(s) "):
                parts.append(Text(f"• {note.removeprefix(prefix)}", style="dim"))
        for warning in plan.warnings:
            if warning.startswith(prefix):
                parts.append(Text(f"! {warning.removeprefix(prefix)}", style="yellow"))
    parts.append(Text(f"\n{len(plan.instances)} instance(s) of {len(plan.models)} models on this host"))
    for note in plan.notes:
        if not note.startswith("models["):
            parts.append(Text(f"• {note}", style="dim"))
    return parts


def plan_panel(outcome: HostOutcome) -> Panel:
    spec = outcome.spec
    if outcome.plan is None:
        assert outcome.problem is not None
        body = Text(str(outcome.problem))
        return Panel(body, title=f"[bold red]✗ {spec.name}[/]", border_style="red")
    plan: HostPlan = outcome.plan
    parts: list[Table | Text] = [
        Text.assemble(
            ("model ", "dim"),
            (plan.model, "bold"),
            (f"  weights {plan.weights_precision} {_gib(plan.weight_bytes)}", ""),
        )
        if not plan.models
        else Text.assemble(
            ("models ", "dim"),
            (", ".join(m.model for m in plan.models), "bold"),
            ("  vLLM ", "dim"),
            plan.vllm_version,
            ("  GPUs from ", "dim"),
            plan.gpus_source,
        )
    ]
    if plan.models:
        parts += _models_parts(plan, spec)
        for warning in plan.warnings:
            if not warning.startswith("models["):  # the entries' own are shown with their entry
                parts.append(Text(f"! {warning}", style="yellow"))
        style = "yellow" if plan.warnings else "green"
        return Panel(Group(*parts), title=f"[bold {style}]✓ {spec.name}[/]", border_style=style)
    parts += _instance_parts(plan.instances)
    follower = [i.node for i in plan.instances if i.node is not None and i.node.headless]
    summary = (
        f"\nnode {follower[0].rank} of the instance led by {follower[0].leader} (headless: its KV tokens and "
        "requests count at the leader)"
        if follower and len(follower) == len(plan.instances)
        else f"\n{len(plan.instances)} instance(s), {plan.total_kv_tokens:,} KV tokens, "
        f"{plan.workload_concurrency:,} concurrent requests of the workload "
        f"(target {spec.workload.target_concurrency})"
    )
    parts.append(Text(summary))
    for note in plan.notes:
        parts.append(Text(f"• {note}", style="dim"))
    for warning in plan.warnings:
        parts.append(Text(f"! {warning}", style="yellow"))
    style = "yellow" if plan.warnings else "green"
    return Panel(Group(*parts), title=f"[bold {style}]✓ {spec.name}[/]", border_style=style)


def print_plans(console: Console, outcomes: list[HostOutcome]) -> None:
    for outcome in outcomes:
        console.print(plan_panel(outcome))
    bad = [o.spec.name for o in outcomes if not o.ok]
    if bad:
        console.print(f"[bold red]{len(bad)} of {len(outcomes)} host(s) have no valid plan:[/] {', '.join(bad)}")
    else:
        console.print(f"[bold green]{len(outcomes)} host(s) planned.[/]")
