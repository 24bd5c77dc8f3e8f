"""Audit findings → a Prometheus textfile, so the last audit's GPU problems can page.

``fleet audit --json`` output (or any JSON with the same shape) goes in: either a list of
findings or ``{"findings": [...]}`` (also accepted: ``{"hosts": [{"host": ..., "findings": [...]}]}``).
A finding is ``{"host": str, "severity": "error"|"warning"|"info", "check": str, "gpu": int|null,
"message": str}``. Out comes node_exporter textfile-collector text (Prometheus text format)::

    fleet_audit_finding{host="gpu-01",check="nvlink_down",severity="error",gpu="3",message="..."} 1
    fleet_audit_last_run_timestamp_seconds 1.7e9

Put it in the textfile directory of a node_exporter that Prometheus scrapes under the job
``fleet-audit`` (``fleet monitor export --audit-exporter HOST:PORT``; labels are honoured, so
``host`` names the audited host, not the exporter). Prometheus' own textfile format rules:
``prometheus/docs`` "Exposition formats"; node_exporter's ``collector/textfile.go``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.errors import FleetError

FINDING_METRIC = "fleet_audit_finding"
LAST_RUN_METRIC = "fleet_audit_last_run_timestamp_seconds"
SEVERITIES = ("error", "warning", "info")


class FindingsError(FleetError):
    pass


@dataclass(frozen=True)
class Finding:
    host: str
    severity: str
    check: str
    message: str
    gpu: int | None = None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def parse_findings(data: Any, source: str = "findings") -> list[Finding]:
    """Validate the JSON; a ``FindingsError`` names the entry, field, value and what is allowed."""
    if isinstance(data, dict) and "hosts" in data and "findings" not in data:
        items: list[Any] = []
        for h in data["hosts"] if isinstance(data["hosts"], list) else []:
            if isinstance(h, dict):
                items += [{"host": h.get("host"), **f} for f in h.get("findings", []) if isinstance(f, dict)]
    elif isinstance(data, dict):
        items = data.get("findings")  # type: ignore[assignment]
    else:
        items = data
    if not isinstance(items, list):
        raise FindingsError(
            f'{source}: expected a list of findings or {{"findings": [...]}}, got {type(data).__name__}'
        )
    out = []
    for i, item in enumerate(items):
        where = f"{source}: findings[{i}]"
        if not isinstance(item, dict):
            raise FindingsError(f"{where}: {item!r}: expected an object with host, severity, check, message")
        for key in ("host", "check"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise FindingsError(f"{where}: {key}={item.get(key)!r}: a non-empty string is required")
        severity = item.get("severity", "error")
        if severity not in SEVERITIES:
            raise FindingsError(f"{where}: severity={severity!r}: one of {', '.join(SEVERITIES)}")
        gpu = item.get("gpu")
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
            raise FindingsError(f"{where}: gpu={gpu!r}: a GPU index >= 0 or null")
        out.append(Finding(item["host"], severity, item["check"], str(item.get("message", "")), gpu))
    return out


def load_findings(path: str | Path) -> list[Finding]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise FindingsError(f"{path}: cannot read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise FindingsError(f"{path}: not JSON: {exc}") from exc
    return parse_findings(data, str(path))


def textfile(findings: list[Finding], audited_at: float) -> str:
    """Prometheus text format for node_exporter's textfile collector (pure)."""
    lines = [
        f"# HELP {FINDING_METRIC} A finding of the last fleet audit (1 while it stands).",
        f"# TYPE {FINDING_METRIC} gauge",
    ]
    seen: set[str] = set()
    for f in findings:
        labels = {
            "host": f.host,
            "check": f.check,
            "severity": f.severity,
            "gpu": "" if f.gpu is None else str(f.gpu),
            "message": f.message[:200],
        }
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        if inner not in seen:  # one series per label set, or the textfile collector rejects the file
            seen.add(inner)
            lines.append(f"{FINDING_METRIC}{{{inner}}} 1")
    lines += [
        f"# HELP {LAST_RUN_METRIC} When the findings above were produced.",
        f"# TYPE {LAST_RUN_METRIC} gauge",
        f"{LAST_RUN_METRIC} {audited_at:.3f}",
    ]
    return "\n".join(lines) + "\n"
