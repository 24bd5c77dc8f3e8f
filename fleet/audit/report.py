"""The audit report: one result per host plus fleet findings, as rich tables, JSON and HTML.

The HTML is one self-contained file (inline CSS and SVG, no scripts, nothing fetched): per host a
topology picture (GPUs, NVSwitches, NVLinks; inactive links drawn red and dashed, links a VM
cannot see drawn grey) and its findings, then the fleet summary. Every value that comes from a
host is escaped where it lands (``html.escape``).
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.audit.findings import Finding, Severity, worst
from fleet.facts.hostfacts import REMOTE_SWITCH, HostFacts
from fleet.topology import format_matrix, island_shape, nvlink_counts, topo_matrix

LINK_OK = "#1b9e4b"
LINK_DOWN = "#d7263d"
LINK_HIDDEN = "#9e9e9e"
SEVERITY_STYLE = {
    Severity.INFO: "cyan",
    Severity.WARNING: "yellow",
    Severity.ERROR: "red",
    Severity.CRITICAL: "bold red",
}


@dataclass
class HostAudit:
    name: str
    facts: HostFacts | None
    unreachable: str | None
    findings: list[Finding] = field(default_factory=list)


@dataclass
class AuditReport:
    inventory: str
    hosts: list[HostAudit]
    fleet: list[Finding]
    seconds: float = 0.0

    @property
    def findings(self) -> list[Finding]:
        return [f for h in self.hosts for f in h.findings] + self.fleet

    def findings_for(self, host: str) -> list[Finding]:
        return [f for f in self.findings if f.host == host]

    def failed(self, fail_on: Severity) -> bool:
        return any(f.severity >= fail_on for f in self.findings)

    # ---- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        hosts = []
        for h in self.hosts:
            entry: dict[str, Any] = {"host": h.name, "reachable": h.unreachable is None, "error": h.unreachable}
            f = h.facts
            if f is not None:
                entry.update(
                    status=f.status,
                    driver_version=f.driver_version,
                    kernel_module_version=f.kernel_module_version,
                    cuda_driver_version=f.cuda_driver_version,
                    vllm=f.packages.get("vllm"),
                    python=f.python,
                    pynvml=f.pynvml,
                    gpus=[
                        {
                            "index": g.index,
                            "name": g.name,
                            "uuid": g.uuid,
                            "bus_id": g.bus_id,
                            "memory_free": g.memory.free if g.memory else None,
                            "memory_total": g.memory.total if g.memory else None,
                            "active_nvlinks": len(g.active_links),
                            "nvlinks": len(g.nvlinks),
                        }
                        for g in f.gpus
                    ],
                    topology=island_shape(f) if f.gpus else None,
                    matrix=topo_matrix(f) if f.gpus else [],
                )
            entry["findings"] = [x.to_json() for x in self.findings_for(h.name)]
            hosts.append(entry)
        counts = Counter(f.severity.label for f in self.findings)
        return {
            "inventory": self.inventory,
            "hosts": hosts,
            "fleet_findings": [f.to_json() for f in self.fleet],
            "summary": {
                "hosts": len(self.hosts),
                "unreachable": sum(1 for h in self.hosts if h.unreachable),
                "findings": {s.label: counts.get(s.label, 0) for s in Severity},
                "worst": (w.label if (w := worst(self.findings)) is not None else None),
            },
            "seconds": round(self.seconds, 3),
        }

    # ---- tables --------------------------------------------------------------------------------

    def print(self, console: Console) -> None:
        for h in self.hosts:
            title = f"[bold]{h.name}[/]"
            f = h.facts
            if f is not None and f.ok:
                names = Counter(g.name or "?" for g in f.gpus)
                gpus = ", ".join(f"{n}x {name}" for name, n in names.items())
                title += f"  {gpus}  driver {f.driver_version}  {island_shape(f)}"
            elif h.unreachable:
                title += "  [red]unreachable[/]"
            table = Table(title=title, title_justify="left", show_lines=False)
            for col in ("severity", "rule", "where", "finding", "way out"):
                table.add_column(col)
            for x in sorted(self.findings_for(h.name), key=lambda x: (-x.severity, x.gpu or 0, x.link or 0)):
                table.add_row(
                    f"[{SEVERITY_STYLE[x.severity]}]{x.severity.label}[/]",
                    x.rule,
                    x.where.removeprefix(h.name).strip() or "host",
                    x.message,
                    x.way_out,
                )
            if not table.row_count:
                table.add_row("[green]ok[/]", "", "", "no findings", "")
            console.print(table)
        summary = Table(title="[bold]fleet summary[/]", title_justify="left")
        for col in ("host", "reachable", "GPUs", "topology", "driver", "worst", "findings"):
            summary.add_column(col)
        for h in self.hosts:
            f = h.facts
            fs = self.findings_for(h.name)
            w = worst(fs)
            summary.add_row(
                h.name,
                "no" if h.unreachable else "yes",
                str(len(f.gpus)) if f else "-",
                island_shape(f) if f and f.gpus else "-",
                (f.driver_version or "-") if f else "-",
                f"[{SEVERITY_STYLE[w]}]{w.label}[/]" if w is not None else "[green]ok[/]",
                str(len(fs)),
            )
        console.print(summary)
        counts = Counter(f.severity for f in self.findings)
        console.print(
            f"{len(self.hosts)} hosts in {self.seconds:.1f} s; findings: "
            + ", ".join(f"{counts.get(s, 0)} {s.label}" for s in reversed(Severity))
        )

    # ---- HTML ----------------------------------------------------------------------------------

    def to_html(self) -> str:
        e = html.escape
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>fleet audit: {e(self.inventory)}</title>",
            "<style>body{font:14px sans-serif;margin:24px;color:#222}h2{margin-top:32px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
            ".critical{color:#a00;font-weight:bold}.error{color:#d00}.warning{color:#b70}.info{color:#07a}"
            "pre{background:#f6f6f6;padding:8px;display:inline-block}</style></head><body>",
            f"<h1>fleet audit: {e(self.inventory)}</h1>",
        ]
        for h in self.hosts:
            parts.append(f"<section class='host' id='host-{e(h.name)}'><h2>{e(h.name)}</h2>")
            if h.unreachable:
                parts.append(f"<p class='critical'>unreachable: {e(h.unreachable)}</p>")
            f = h.facts
            if f is not None and f.gpus:
                parts.append(
                    f"<p>driver {e(f.driver_version or '?')}, kernel module {e(f.kernel_module_version or '?')}, "
                    f"topology {e(island_shape(f))}</p>"
                )
                parts.append(topology_svg(h.name, f, self.findings_for(h.name)))
                parts.append(f"<pre>{e(format_matrix(topo_matrix(f)))}</pre>")
            parts.append(_findings_table(self.findings_for(h.name)))
            parts.append("</section>")
        parts.append(
            "<h2>fleet summary</h2><table><tr><th>host</th><th>GPUs</th><th>topology</th>"
            "<th>driver</th><th>worst</th><th>findings</th></tr>"
        )
        for h in self.hosts:
            f = h.facts
            fs = self.findings_for(h.name)
            w = worst(fs)
            parts.append(
                f"<tr><td>{e(h.name)}</td><td>{len(f.gpus) if f else '-'}</td>"
                f"<td>{e(island_shape(f)) if f and f.gpus else '-'}</td>"
                f"<td>{e((f.driver_version or '-') if f else '-')}</td>"
                f"<td class='{w.label if w is not None else ''}'>{w.label if w is not None else 'ok'}</td>"
                f"<td>{len(fs)}</td></tr>"
            )
        parts.append("</table>")
        peers = [f for f in self.fleet if f.instance is None]
        spanning = [f for f in self.fleet if f.instance is not None]
        if peers:
            parts.append("<h3>hosts that differ from their peers</h3>" + _findings_table(peers))
        if spanning:
            parts.append("<h3>instances spanning hosts</h3>" + _findings_table(spanning))
        parts.append("</body></html>")
        return "\n".join(parts)


def _findings_table(findings: list[Finding]) -> str:
    e = html.escape
    if not findings:
        return "<p>no findings</p>"
    rows = "".join(
        f"<tr><td class='{x.severity.label}'>{x.severity.label}</td><td>{e(x.rule)}</td><td>{e(x.where)}</td>"
        f"<td>{e(x.message)}</td><td>{e(x.way_out)}</td></tr>"
        for x in sorted(findings, key=lambda x: -x.severity)
    )
    return (
        "<table><tr><th>severity</th><th>rule</th><th>where</th><th>finding</th><th>way out</th></tr>"
        + rows
        + "</table>"
    )


def topology_svg(host: str, facts: HostFacts, findings: list[Finding]) -> str:
    """An SVG of the host: GPUs in a row, NVSwitches above them, NVLinks as lines.

    Switch fabric: one line per GPU and switch, labelled with the link count, red and dashed when
    any of those links is inactive. Direct links: one line per GPU pair. A GPU whose NVLinks a VM
    cannot see gets a grey dashed stub.
    """
    e = html.escape
    gpus = facts.gpus
    n = len(gpus)
    box_w, gap = 92, 18
    width = max(n * (box_w + gap) + gap, 360)
    switches: list[str] = []
    for g in gpus:
        for link in g.nvlinks:
            if link.remote_type == REMOTE_SWITCH and link.remote_bus_id and link.remote_bus_id not in switches:
                switches.append(link.remote_bus_id)
    has_switch = bool(switches)
    gpu_y = 170 if has_switch else 90
    height = gpu_y + 130
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='topology' data-host='{e(host)}' width='{width}' "
        f"height='{height}' viewBox='0 0 {width} {height}'>",
        f"<rect x='0' y='0' width='{width}' height='{height}' fill='#ffffff'/>",
    ]

    def gx(i: int) -> float:
        return gap + i * (box_w + gap) + box_w / 2

    sw_w = 110
    sw_gap = (width - len(switches) * sw_w) / (len(switches) + 1) if switches else 0

    def sx(k: int) -> float:
        return sw_gap + k * (sw_w + sw_gap) + sw_w / 2

    # links first, boxes on top
    for i, g in enumerate(gpus):
        per_switch: dict[str, list[bool]] = {}
        for link in g.nvlinks:
            if link.remote_type == REMOTE_SWITCH and link.remote_bus_id:
                per_switch.setdefault(link.remote_bus_id, []).append(link.active)
        for bus, states in per_switch.items():
            k = switches.index(bus)
            down = states.count(False)
            color = LINK_DOWN if down else LINK_OK
            dash = " stroke-dasharray='8 5'" if down else ""
            x1, y1, x2, y2 = gx(i), gpu_y, sx(k), 80
            out.append(
                f"<line class='nvlink{' down' if down else ''}' x1='{x1:.0f}' y1='{y1}' x2='{x2:.0f}' y2='{y2}' "
                f"stroke='{color}' stroke-width='{4 if down else 3}'{dash}/>"
            )
            if down:
                out.append(
                    f"<text x='{(x1 + x2) / 2:.0f}' y='{(y1 + y2) / 2:.0f}' fill='{LINK_DOWN}' font-size='11'>"
                    f"{down} down</text>"
                )
    counts = nvlink_counts(facts)
    bus_index = {g.bus_id: j for j, g in enumerate(gpus)}
    for i, g in enumerate(gpus):
        down_to: dict[int, int] = {}
        for link in g.nvlinks:
            if link.remote_type != REMOTE_SWITCH and link.remote_bus_id in bus_index and not link.active:
                j = bus_index[link.remote_bus_id]
                down_to[j] = down_to.get(j, 0) + 1
        for j in range(i + 1, n):
            direct = sum(
                1 for link in g.nvlinks if link.remote_type != REMOTE_SWITCH and link.remote_bus_id == gpus[j].bus_id
            )
            if not direct:
                continue
            down = down_to.get(j, 0)
            color = LINK_DOWN if down else LINK_OK
            x1, x2 = gx(i), gx(j)
            arc = 40 + 12 * abs(j - i)
            out.append(
                f"<path class='nvlink{' down' if down else ''}' d='M {x1:.0f} {gpu_y + 70} Q {(x1 + x2) / 2:.0f} "
                f"{gpu_y + 70 + arc} {x2:.0f} {gpu_y + 70}' fill='none' stroke='{color}' stroke-width='4'/>"
            )
            out.append(
                f"<text x='{(x1 + x2) / 2 - 14:.0f}' y='{gpu_y + 66 + arc / 2 + 12:.0f}' font-size='11'>"
                f"NV{counts[i][j]}</text>"
            )
    for k, bus in enumerate(switches):
        out.append(
            f"<rect class='switch' x='{sx(k) - sw_w / 2:.0f}' y='40' width='{sw_w}' height='40' rx='6' "
            f"fill='#37474f'/><text x='{sx(k):.0f}' y='58' fill='#fff' font-size='11' text-anchor='middle'>"
            f"NVSwitch</text><text x='{sx(k):.0f}' y='72' fill='#fff' font-size='10' text-anchor='middle'>"
            f"{e(bus[-10:])}</text>"
        )
    bad_gpus = {f.gpu for f in findings if f.gpu is not None and f.severity >= Severity.ERROR}
    for i, g in enumerate(gpus):
        x = gx(i) - box_w / 2
        stroke = LINK_DOWN if g.index in bad_gpus else "#1e3a5f"
        hidden = not g.nvlinks and (g.nvlink_error is not None)
        if hidden and g.virtualization_mode == 1:
            out.append(
                f"<line class='nvlink hidden' x1='{gx(i):.0f}' y1='{gpu_y}' x2='{gx(i):.0f}' y2='{gpu_y - 40}' "
                f"stroke='{LINK_HIDDEN}' stroke-width='3' stroke-dasharray='4 4'/>"
                f"<text x='{gx(i) + 6:.0f}' y='{gpu_y - 30}' font-size='10' fill='#666'>NVLink not visible (VM)</text>"
            )
        mem = f"{g.memory.free / 2**30:.0f}/{g.memory.total / 2**30:.0f} GiB free" if g.memory else ""
        name = (g.name or "?").replace("NVIDIA ", "")
        out.append(
            f"<rect class='gpu' x='{x:.0f}' y='{gpu_y}' width='{box_w}' height='70' rx='6' fill='#2b5d8a' "
            f"stroke='{stroke}' stroke-width='{4 if g.index in bad_gpus else 2}'/>"
            f"<text x='{gx(i):.0f}' y='{gpu_y + 20}' fill='#fff' font-size='13' "
            f"text-anchor='middle'>GPU{g.index}</text>"
            f"<text x='{gx(i):.0f}' y='{gpu_y + 38}' fill='#fff' font-size='9' "
            f"text-anchor='middle'>{e(name[:18])}</text>"
            f"<text x='{gx(i):.0f}' y='{gpu_y + 56}' fill='#fff' font-size='9' text-anchor='middle'>{e(mem)}</text>"
        )
    if not any(g.nvlinks for g in gpus) and not any(g.virtualization_mode == 1 for g in gpus):
        out.append(f"<text x='{gap}' y='{gpu_y - 20}' font-size='12' fill='#555'>PCIe only (no NVLink)</text>")
    out.append("</svg>")
    return "".join(out)
