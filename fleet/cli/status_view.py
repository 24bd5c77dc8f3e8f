"""How ``fleet status`` looks to people: a view that fits 80 columns, and ``--wide``.

The default view is what an on-call reads on a laptop at 3 a.m.: one row per instance with its
host, instance, state, model and requests running/waiting, and under the table one line per
instance that is not ready or breaks a threshold, saying why. ``--wide`` adds every other column
(vLLM version, KV cache, preemptions, request rate, TTFT and e2e percentiles, the systemd unit and
its uptime, restarts, the release, GPU memory), like ``kubectl get -o wide``: one table at about
200 columns; on a narrower terminal the columns that do not fit continue in further tables, each
led by host, instance and state (:func:`pack`), so nothing is cut.

Why requests running/waiting is the one number in the default view: ``waiting`` is what clients
feel (requests queued behind a full batch wait for their first token), ``running`` says the
instance carries traffic at all (0/0 on one instance while its peers are busy means the balancer
skips it). KV-cache use is the usual cause of a queue and is on the line under the table as soon
as it passes its threshold, as is every other threshold a row breaks (the alert rules' numbers).

Model names are shown in a short form: the part after the last ``/`` (a Hugging Face id without
its organisation, a model directory's name), or the name in full where two models of the fleet
would read the same; where even that does not fit, the cell wraps, so a name is never cut.
Host, instance and state are never shortened (a host name wider than the terminal itself wraps).
An instance spanning hosts is one row whose host cell lists its nodes' hosts, one a line, the
leader (which serves the API) first and a node that is down in red.

Under everything, what each host's units' cache holds (``fleet.facts.hub``'s listing, read in the
same SSH round): by default hosts that hold the same are one line ("lab-h1, lab-h2 hold
meta-llama/Llama-3.1-8B-Instruct@main (15.0 GiB)", after three host names "and N more"), so a
fleet of 200 alike hosts costs a line, not 200, and a host that differs (another snapshot, a copy
being staged, a model missing) stands out on its own line; ``--wide`` gives every host its own
line. A host whose cache could not be listed has a line saying why (:func:`model_lines`).

The state column is rendered in one place (:func:`state_cell`) from
:attr:`fleet.monitor.status.InstanceStatus.state`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rich import box
from rich.console import Console, ConsoleOptions, JustifyMethod, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from fleet.monitor.histograms import Quantile
from fleet.monitor.status import HeldModel, HostModels, InstanceStatus, State
from fleet.weights.verify import fmt_bytes

#: States an instance passes through on its way up or down (shown as such, not as a failure).
TRANSITIONAL = frozenset({State.LOADING, State.STOPPING, State.RESTARTING})


# -- pure pieces (table-tested) ---------------------------------------------------------------------

#: Host names a line of the default view names before "and N more".
HOSTS_PER_LINE = 3


def held_text(m: HeldModel) -> str:
    """``ORG/NAME@SNAPSHOT (SIZE)``; a copy being staged says so."""
    at = f"@{m.snapshot[:12]}" if m.snapshot else ""
    return f"{m.model}{at} ({fmt_bytes(m.bytes)}{', being staged' if m.staging else ''})"


def model_lines(held: Mapping[str, HostModels], wide: bool = False) -> list[tuple[str, bool]]:
    """The lines saying what each host's cache holds, each with whether it is an error (pure): hosts
    that hold the same share a line (``wide``: one line per host); a host whose cache could not be
    listed has its own line saying why, after the others."""
    groups: dict[str, list[str]] = {}
    errors = []
    for host, hm in held.items():
        if hm.error:
            errors.append((f"{host}: model cache not listed: {hm.error}", True))
            continue
        what = ", ".join(held_text(m) for m in hm.models) or "no model"
        groups.setdefault(what if not wide else f"{host}\0{what}", []).append(host)
    out = []
    for key, hosts in groups.items():
        what = key.rpartition("\0")[2]
        names = ", ".join(hosts[:HOSTS_PER_LINE]) + (
            f" and {len(hosts) - HOSTS_PER_LINE} more" if len(hosts) > HOSTS_PER_LINE else ""
        )
        out.append((f"{names} {'holds' if len(hosts) == 1 else 'hold'} {what}", False))
    return out + errors


def short_model(name: str) -> str:
    """The part after the last ``/`` (``meta-llama/Llama-3.1-8B-Instruct`` → ``Llama-3.1-8B-Instruct``,
    ``/models/llama-70b/`` → ``llama-70b``); a name without one as it is."""
    tail = name.rstrip("/").rpartition("/")[2]
    return tail or name


def short_models(names: Iterable[str]) -> dict[str, str]:
    """Each distinct model name → how the status table shows it: :func:`short_model`, or the name
    in full where two different names would shorten to the same text."""
    distinct = sorted(set(names))
    short = {n: short_model(n) for n in distinct}
    clash = {s for s in short.values() if sum(1 for v in short.values() if v == s) > 1}
    return {n: (n if s in clash else s) for n, s in short.items()}


def reasons(row: InstanceStatus) -> list[str]:
    """Why the row is not fine: why it is not ready, then each threshold it breaks (for a drained
    instance: who drained its host, when and why)."""
    if row.drained is not None:
        return [row.drained.describe(), *row.problems]
    out = [row.detail] if row.state is not State.READY and row.detail else []
    return out + [p for p in row.problems if p not in out]


def summary(rows: list[InstanceStatus]) -> str:
    """``3/4 ready, 1 drained, 1 with problems`` (the title)."""
    ready = sum(1 for r in rows if r.state is State.READY)
    drained = sum(1 for r in rows if r.state is State.DRAINED)
    troubled = sum(1 for r in rows if r.problems or (r.state is not State.DRAINED and reasons(r)))
    return (f"{ready}/{len(rows)} ready" + (f", {drained} drained" if drained else "")
            + (f", {troubled} with problems" if troubled else ""))  # fmt: skip


def _num(v: float | None, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def run_wait(row: InstanceStatus) -> str:
    """Requests running/waiting (vLLM's ``num_requests_running``/``num_requests_waiting`` gauges)."""
    if row.running is None and row.waiting is None:
        return "-"
    return f"{_num(row.running)}/{_num(row.waiting)}"


# -- cells ---------------------------------------------------------------------------------------------


def state_cell(row: InstanceStatus) -> Text:
    """The state column, everywhere it is shown: green when ready and fine, yellow when ready with
    a problem or on its way up or down, red otherwise."""
    state = row.state
    if state is State.READY:
        style = "yellow" if row.problems else "green"
    elif state in TRANSITIONAL or state is State.DRAINED:
        style = "yellow"
    else:
        style = "red"
    return Text(state.value, style=style)


def host_cell(row: InstanceStatus) -> str | Text:
    """The host column: the host; for an instance spanning hosts, every node's host on a line of
    its own, leader first, a node that is down in red."""
    if not row.nodes:
        return row.target.host
    down = {n.host for n in row.down_nodes}
    return Text("\n").join(Text(n.host, style="red" if n.host in down else "") for n in row.nodes)


def _lb_cell(row: InstanceStatus) -> Text:
    """What the instance's load balancer says: UP/DRAIN/MAINT/DOWN and its sessions ("-": none)."""
    if row.lb_error:
        return Text("?", style="red")
    if row.lb is None:
        return Text("-", style="dim")
    return Text(f"{row.lb.view} {row.lb.sessions}", style="green" if row.lb.in_traffic else "yellow")


def _red_if(text: str, row: InstanceStatus, word: str) -> Text:
    return Text(text, style="red" if any(word in p for p in row.problems) else "")


def _q(q: Quantile | None) -> str:
    if q is None or q.value is None:
        return "-"
    return f">{q.lower:g}" if math.isinf(q.upper) else f"{q.value:.2f}"


def _pair(a: Quantile | None, b: Quantile | None) -> str:
    if (a is None or a.value is None) and (b is None or b.value is None):
        return "-"
    return f"{_q(a)}/{_q(b)}s"


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 3600:
        return f" {s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f" {s // 3600}h{s % 3600 // 60:02d}m"
    return f" {s // 86400}d{s % 86400 // 3600:02d}h"


def _unit_cell(row: InstanceStatus) -> Text:
    unit = row.unit
    if unit is None:
        return Text("n/a", style="dim")
    return Text(unit.state + _uptime(unit.uptime_seconds), style="green" if unit.active else "red")


def _release_cell(row: InstanceStatus) -> str:
    unit = row.unit
    return "-" if unit is None or unit.release is None else unit.release


# -- the views -----------------------------------------------------------------------------------------

#: Between two columns: SIMPLE_HEAD's divider (a space) and each cell's left padding of one.
GAP = 2


@dataclass(frozen=True)
class Column:
    """One column of the view: its header and one cell per row."""

    header: str
    cells: tuple[RenderableType, ...]
    justify: JustifyMethod = "left"
    key: bool = False  #: repeated in every table of a view too wide for the terminal
    min_width: int | None = None  #: the narrowest it wraps to


def pack(first: int, rest: int, extra: Sequence[int], width: int, gap: int = GAP) -> list[list[int]]:
    """Which extra columns (given by their natural widths) go into which table (pure).

    The first table starts ``first`` wide (the default columns), each further one ``rest`` wide
    (the key columns); columns are taken in order, each into the current table while it fits in
    ``width``, else into a new one. The answer lists, per table, indices into ``extra``: the first
    list may be empty (nothing fits beside the default columns); a further one never is (a column
    wider than what is left gets a table of its own, and wraps there).
    """
    parts: list[list[int]] = [[]]
    used = first
    for i, w in enumerate(extra):
        if used + gap + w > width and (parts[-1] or len(parts) == 1):
            parts.append([])
            used = rest
        parts[-1].append(i)
        used += gap + w
    return parts


def _columns(rows: list[InstanceStatus], wide: bool) -> tuple[list[Column], list[Column]]:
    """The default columns (host, inst, state: keys; model, run/wait) and, with ``wide``, the rest."""
    models = short_models(r.target.model for r in rows)
    main = [
        Column("host", tuple(host_cell(r) for r in rows), key=True),
        Column("inst", tuple(str(r.target.index) for r in rows), "right", key=True),
        Column("state", tuple(state_cell(r) for r in rows), key=True),
        Column("model", tuple(models[r.target.model] for r in rows), min_width=8),
        Column("run/wait", tuple(_red_if(run_wait(r), r, "waiting") for r in rows), "right"),
    ]
    if not wide:
        return main, []

    def col(header: str, cell: Callable[[InstanceStatus], RenderableType], justify: JustifyMethod = "right") -> Column:
        return Column(header, tuple(cell(r) for r in rows), justify)

    def preempt(r: InstanceStatus) -> Text:
        ratio = r.interval.preemptions_per_request if r.interval else None
        return _red_if("-" if ratio is None else ("inf" if math.isinf(ratio) else f"{ratio:.1%}"), r, "preemptions")

    def ttft(r: InstanceStatus) -> Text:
        return _red_if(_pair(r.interval.ttft_p50, r.interval.ttft_p99) if r.interval else "-", r, "TTFT")

    def e2e(r: InstanceStatus) -> Text:
        return _red_if(_pair(r.interval.e2e_p50, r.interval.e2e_p99) if r.interval else "-", r, "e2e")

    def gpu(r: InstanceStatus) -> RenderableType:
        used = r.unit.gpu_memory_used if r.unit else None
        return Text("n/a", style="dim") if used is None else f"{used / 2**30:.1f} GiB"

    extra = [
        col("vLLM", lambda r: r.version or "-", "left"),
        col("KV", lambda r: _red_if(_num(r.kv_usage, "{:.0%}"), r, "KV")),
        col("preempt", preempt),
        col("req/s", lambda r: _num(r.interval.requests_per_second if r.interval else None, "{:.1f}")),
        col("TTFT\np50/p99", ttft),
        col("e2e\np50/p99", e2e),
        col("unit", _unit_cell, "left"),
        col("restarts", lambda r: _red_if(_num(r.unit.restarts if r.unit else None), r, "restarted")),
        col("release", _release_cell, "left"),
        col("GPU mem", gpu),
        col("lb", _lb_cell, "left"),
    ]
    return main, extra


def _table(columns: Sequence[Column], nrows: int, title: str | None, fold_keys: bool = False) -> Table:
    table = Table(
        title=title, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1)
    )
    for c in columns:
        # Host, instance and state keep their width (they wrap only where they alone do not fit);
        # any other cell wraps (folds) rather than losing its end.
        no_wrap = c.key and not fold_keys
        table.add_column(c.header, justify=c.justify, no_wrap=no_wrap, overflow="fold", min_width=c.min_width)
    for i in range(nrows):
        table.add_row(*(c.cells[i] for c in columns))
    return table


def _natural(console: Console, options: ConsoleOptions, column: Column) -> int:
    """How wide the column is when nothing wraps (its widest cell or header)."""
    widest = max(Measurement.get(console, options, x).maximum for x in (Text(column.header), *column.cells))
    return max(widest, column.min_width or 0)


class StatusView:
    """The table (laid out for the width it is printed at) and, under it, the notes.

    The default columns fit 80 columns. With ``wide``, the other columns that do not fit beside
    them go into further tables below, each led by host, instance and state, so a narrower
    terminal shows every value instead of cutting columns off.
    """

    def __init__(
        self,
        rows: list[InstanceStatus],
        interval: float,
        wide: bool = False,
        models: Mapping[str, HostModels] | None = None,
    ) -> None:
        self.rows, self.interval, self.wide, self.models = rows, interval, wide, models or {}

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = self.rows
        title = f"fleet status: {summary(rows)}"
        if self.wide:
            title += f" (rates over the last {self.interval:g}s)"
        main, extra = _columns(rows, self.wide)
        keys = [c for c in main if c.key]

        def span(columns: Sequence[Column]) -> int:
            return sum(_natural(console, options, c) for c in columns) + GAP * (len(columns) - 1)

        natural = [_natural(console, options, c) for c in extra]
        first, *more = pack(span(main), span(keys), natural, options.max_width)
        # The narrowest the default columns get with the keys kept whole: wider than the terminal
        # (a host name of 60 characters at 80 columns), the keys wrap too, rather than being cut.
        narrowest = span(keys) + sum(GAP + (c.min_width or _natural(console, options, c)) for c in main if not c.key)
        fold = narrowest > options.max_width
        yield _table([*main, *(extra[i] for i in first)], len(rows), title, fold)
        for part in more:
            yield Text("")
            yield _table([*keys, *(extra[i] for i in part)], len(rows), None, fold)
        if self.wide and any(r.unit is None for r in rows):
            yield Text("")
            yield Text("unit and GPU mem: n/a without SSH facts (--no-ssh)", style="dim")
        below = notes(rows)
        if below is not None:
            yield Text("")
            yield below
        lines = model_lines(self.models, self.wide)
        if lines:
            yield Text("")
            for line, error in lines:
                yield Text(line, style="red" if error else "dim")


def notes(rows: list[InstanceStatus]) -> Table | None:
    """One line per instance that is not ready or breaks a threshold: its id and every reason
    (wrapped under itself); ``None`` when every instance is fine."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for row in rows:
        why = reasons(row)
        if why:
            style = "yellow" if row.state in (State.READY, State.DRAINED) or row.state in TRANSITIONAL else "red"
            grid.add_row(Text(row.target.instance + ":", style=style), Text("; ".join(why), style=style))
    return grid if grid.row_count else None


def status_view(
    rows: list[InstanceStatus], interval: float, wide: bool = False, models: Mapping[str, HostModels] | None = None
) -> StatusView:
    """What ``fleet status`` prints: :class:`StatusView` (``models``: what each host's cache holds)."""
    return StatusView(rows, interval, wide, models)
