"""``fleet history``: past and running rollouts from the journal; ``fleet history ID``: their steps."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

import click
from rich.markup import escape
from rich.table import Table

from fleet.cli import console, fail
from fleet.errors import FleetError
from fleet.rollout.engine import RolloutState
from fleet.rollout.journal import Journal, RolloutJournal, RolloutRecord, Step, shown_status
from fleet.secrets import redact_data


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) if ts else "-"


#: ``--journal``: a file, or a PostgreSQL URL (no password), for every command that reads the journal.
JOURNAL_HELP = (
    "The journal: an SQLite file or a postgresql:// URL without a password (default: $FLEET_JOURNAL, "
    "else ~/.config/fleet/journal.toml, else ~/.local/state/fleet/journal.sqlite)."
)


@click.command()
@click.argument("rollout_id", required=False)
@click.option("--fleet", "fleet_name", help="Only rollouts of this fleet.")
@click.option("--limit", default=20, show_default=True, help="How many rollouts to list.")
@click.option("--journal", "journal_path", metavar="PATH|URL", help=JOURNAL_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def history(
    rollout_id: str | None, fleet_name: str | None, limit: int, journal_path: str | None, as_json: bool
) -> None:
    """Rollouts and restarts, newest first, from the journal; with ROLLOUT_ID, every step of one.

    A rollout whose process is gone before it ended is listed as ``interrupted`` (resume it with
    ``fleet rollout --resume ID --take-over``). A damaged journal file is read as far as it can
    be, never changed: what it still holds is shown, with what could not be read (exit 1).
    """
    from fleet.rollout.errors import JournalDamaged, NoJournal
    from fleet.rollout.journal import locate
    from fleet.rollout.journals import open_journal

    try:
        where = locate(journal_path)
        try:
            with open_journal(where, write=False) as journal:
                shown = _read(journal, rollout_id, fleet_name, limit)
            damage: list[str] = []
        except JournalDamaged as exc:
            if not exc.salvageable or where.path is None:
                raise
            with Journal.salvage(where.path) as salvaged:
                shown = _read(salvaged, rollout_id, fleet_name, limit)
                damage = [str(exc), *salvaged.lost]
    except NoJournal as exc:
        fail(str(exc), as_json, code=1)
    except FleetError as exc:
        fail(str(exc), as_json)
    if isinstance(shown, list):
        _print_records(shown, as_json, damage)
    else:
        _print_rollout(rollout_id or "", *shown, as_json=as_json, damage=damage)
    if damage:
        sys.exit(1)


def _read(
    journal: RolloutJournal, rollout_id: str | None, fleet_name: str | None, limit: int
) -> list[RolloutRecord] | tuple[str, RolloutState | None, list[Step]]:
    from fleet.rollout.errors import JournalDamaged

    if rollout_id is None:
        return journal.history(fleet_name, limit)
    status = "unreadable"
    try:
        state: RolloutState | None = journal.latest_state(rollout_id)
    except JournalDamaged as exc:
        if not isinstance(journal, Journal) or not journal.salvaging:
            raise
        state = None
        journal.lost.append(f"rollout {rollout_id}'s state ({exc})")
    if state is not None:
        try:
            status = shown_status(state.status.value, state.id, journal.lock_owner(state.fleet))
        except JournalDamaged:
            status = state.status.value  # the lock table cannot be read: as journaled
    return status, state, journal.steps(rollout_id)


def _damage_lines(damage: list[str]) -> list[str]:
    if not damage:
        return []
    lines = [f"warning: {damage[0]}"]
    if len(damage) > 1:
        lines.append("could not be read: " + "; ".join(damage[1:]))
    return lines


def _print_records(records: list[RolloutRecord], as_json: bool, damage: list[str]) -> None:
    if as_json:
        body: dict[str, object] = {"rollouts": [asdict(r) for r in records]}
        if damage:
            body["damaged"] = damage
        click.echo(json.dumps(redact_data(body), indent=2))
        return
    # id, when, what and how it ended never wrap (the id is what the on-call copies);
    # the reason takes the room left. Steps, fleet and who: `--json` and `fleet history ID`.
    table = Table()
    for col in ("id", "started (UTC)", "kind", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("reason", ratio=1, min_width=12)
    for r in records:
        table.add_row(r.id, _when(r.started_at)[5:16], r.kind, r.status, escape(r.reason))
    console().print(table)
    err = console(stderr=True)
    for line in _damage_lines(damage):
        err.print(escape(line), soft_wrap=True)


def _print_rollout(
    rollout_id: str, status: str, state: RolloutState | None, steps: list[Step], *, as_json: bool, damage: list[str]
) -> None:
    if as_json:
        click.echo(
            json.dumps(
                {
                    "id": rollout_id,
                    "fleet": state.fleet if state else None,
                    "status": status,
                    "reason": state.reason if state else "",
                    "steps": [asdict(s) for s in steps],
                    **({"damaged": damage} if damage else {}),
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
                        for ref, i in (state.instances.items() if state else ())
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
    err = console(stderr=True)
    for line in _damage_lines(damage):
        err.print(escape(line), soft_wrap=True)
    if state is None:
        return
    for ref, i in state.instances.items():
        if i.track is not None and i.track.soak_resets:
            out.print(f"{ref}: soak reset {i.track.soak_resets} time(s): a gate went red while it soaked")
    out.print(
        escape(f"rollout {state.id} ({state.fleet}): {status}" + (f": {state.reason}" if state.reason else "")),
        soft_wrap=True,
    )
    if status == "interrupted":
        out.print(f"its process is gone; resume with: fleet rollout --resume {state.id} --take-over")
    elif status == "running":
        out.print(f"resume with: fleet rollout --resume {state.id}")
