"""``fleet history``: past and running rollouts from the journal; ``fleet history ID``: their steps."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import click
from rich.table import Table

from fleet.cli import console, fail
from fleet.errors import FleetError


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) if ts else "-"


@click.command()
@click.argument("rollout_id", required=False)
@click.option("--fleet", "fleet_name", help="Only rollouts of this fleet.")
@click.option("--limit", default=20, show_default=True, help="How many rollouts to list.")
@click.option(
    "--journal",
    "journal_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The journal database (default: $FLEET_JOURNAL or ~/.local/state/fleet/journal.sqlite).",
)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def history(
    rollout_id: str | None, fleet_name: str | None, limit: int, journal_path: Path | None, as_json: bool
) -> None:
    """Rollouts and restarts, newest first, from the journal; with ROLLOUT_ID, every step of one."""
    from fleet.rollout.journal import Journal, default_path

    path = journal_path or default_path()
    if not path.exists():
        fail(f"no journal at {path}: no rollout has run from this machine (or pass --journal)", as_json, code=1)
    try:
        with Journal(path) as journal:
            if rollout_id is None:
                records = journal.history(fleet_name, limit)
                if as_json:
                    click.echo(json.dumps({"rollouts": [asdict(r) for r in records]}, indent=2))
                    return
                # id, when, what and how it ended never wrap (the id is what the on-call copies);
                # the reason takes the room left. Steps, fleet and who: `--json` and `fleet history ID`.
                table = Table()
                for col in ("id", "started (UTC)", "kind", "status"):
                    table.add_column(col, no_wrap=True)
                table.add_column("reason", ratio=1, min_width=12)
                for r in records:
                    table.add_row(r.id, _when(r.started_at)[5:16], r.kind, r.status, r.reason)
                console().print(table)
                return
            state = journal.latest_state(rollout_id)
            steps = journal.steps(rollout_id)
    except FleetError as exc:
        fail(str(exc), as_json)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "id": state.id,
                    "fleet": state.fleet,
                    "status": state.status.value,
                    "reason": state.reason,
                    "steps": [asdict(s) for s in steps],
                    "instances": [
                        {
                            "instance": str(ref),
                            "phase": i.phase.value,
                            "release": i.release,
                            "failure": i.failure,
                            "rollback_failure": i.rollback_failure,
                            # gates that went red during the soak and restarted it (a flap)
                            "soak_resets": i.track.soak_resets if i.track else 0,
                        }
                        for ref, i in state.instances.items()
                    ],
                },
                indent=2,
            )
        )
        return
    table = Table("#", "at (UTC)", "instance", "step", "before", "outcome")
    for s in steps:
        before = ", ".join(f"{k}={v}" for k, v in s.before.items() if v)
        outcome = s.outcome or "not recorded (the process stopped here)"
        if s.outcome == "failed":
            outcome += f": {s.outcome_detail}"
        table.add_row(str(s.seq), _when(s.at), s.instance or "-", s.detail, before, outcome)
    out = console()
    out.print(table)
    for ref, i in state.instances.items():
        if i.track is not None and i.track.soak_resets:
            out.print(f"{ref}: soak reset {i.track.soak_resets} time(s): a gate went red while it soaked")
    out.print(
        f"rollout {state.id} ({state.fleet}): {state.status.value}" + (f": {state.reason}" if state.reason else "")
    )
    if state.status.value == "running":
        out.print(f"resume with: fleet rollout --resume {state.id}")
