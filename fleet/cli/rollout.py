"""``fleet restart``, ``fleet rollout`` and ``fleet rollback``: the rolling engine on a serving fleet.

Thin: the inventory is read by ``fleet.rollout.fleet_inventory``, the work is
``fleet.rollout.runner.Runner`` over ``fleet.rollout.ssh_executor.SshExecutor``; this module
only turns options into a policy, shows progress and says what to do next.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import click
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fleet.audit.findings import Finding
from fleet.audit.gate import check_ignored
from fleet.cli import EXIT_INVALID, EXIT_SOME_HOSTS, console, fail
from fleet.cli.history import JOURNAL_HELP
from fleet.errors import FleetError
from fleet.facts.drain import DrainMarker
from fleet.lb.traffic import BalancerDown, BalancerMisconfigured
from fleet.rollout.advice import left_down, next_steps
from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import TERMINAL, RolloutState, RolloutStatus, Target
from fleet.rollout.errors import LockHeld
from fleet.rollout.executor import ExecutorError
from fleet.rollout.fleet_inventory import RolloutFleet, load_fleet
from fleet.rollout.journal import RolloutJournal
from fleet.rollout.observe import Observations
from fleet.rollout.previous import back_to, last_changes, rollback_targets
from fleet.rollout.runner import Runner
from fleet.rollout.session import NothingToResume, open_journal, resume_rollout, run_rollout
from fleet.rollout.ssh_executor import SshExecutor

EXIT_STOPPED = 1


def _policy_options(f: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--batches", help='Batch sizes: "1,2,25%" (the first is the canary; -1: the rest).'),
        click.option("--max-unavailable", help='Instances allowed not serving at once: a count or "N%".'),
        click.option("--soak", "soak_s", type=float, help="Seconds every gate must stay green."),
        click.option("--canary-bake", "canary_bake_s", type=float, help="Seconds the canary batch is watched."),
        click.option("--on-failure", type=click.Choice(["rollback", "halt"]), help="What a failed batch does."),
        click.option("--health-timeout", type=float, help="Seconds an instance may take to load (the health gate)."),
        click.option("--probe-interval", "probe_interval_s", type=float, help="Seconds between gate probes."),
        click.option("--gates-over-ssh", multiple=True, help="Probe this host's gates with curl on it (repeatable)."),
        click.option("--take-over", is_flag=True, help="Take over a stale lock (its owner is gone)."),
        click.option("--no-lb", is_flag=True,
                     help="Roll without the load balancers (clients will see failed requests; said once)."),
        click.option("--journal", "journal_path", metavar="PATH|URL", help=JOURNAL_HELP),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no live view)."),
        click.option("--ignore-finding", "ignore_finding", multiple=True, metavar="RULE",
                     help="Roll even though the audit finds RULE (e.g. driver-mismatch) on a host; journaled "
                     "(repeatable)."),
    ]  # fmt: skip
    for opt in reversed(opts):
        f = opt(f)
    return f


def exit_code_of(exc: FleetError) -> int:
    """1 for a host that could not be asked (unreachable, a refused host key or login): a host
    failed, the input is fine; 2 for everything else (bad input, a held lock)."""
    return EXIT_SOME_HOSTS if isinstance(exc, ExecutorError) else EXIT_INVALID


def check_journal(opts: Mapping[str, Any]) -> None:
    """Open the journal and let it go: a journal that cannot be used is refused before
    ``load_fleet`` reads anything from a host (the watcher records, the probes)."""
    with open_journal(opts.get("journal_path")):
        pass


def _size(text: str) -> int | str:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else text


def overrides_of(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The policy overrides the command line gives (validated by ``parse_policy``, named "command line")."""
    out: dict[str, Any] = {}
    if opts.get("batches"):
        out["batches"] = [_size(b) for b in str(opts["batches"]).split(",") if b.strip()]
    if opts.get("max_unavailable"):
        out["max_unavailable"] = _size(str(opts["max_unavailable"]))
    for key in ("soak_s", "canary_bake_s", "probe_interval_s"):
        if opts.get(key) is not None:
            out[key] = opts[key]
    if opts.get("on_failure"):
        out["on_failure"] = opts["on_failure"]
    if opts.get("health_timeout") is not None:
        out["timeouts.health"] = opts["health_timeout"]
    return out


# ---- the run, for people --------------------------------------------------------------------------


class _Stop:
    """Ctrl-C (or SIGTERM) asks the runner to stop between steps; the step in progress finishes
    (every step has a deadline: on a host that stopped answering it ends within the SSH layer's
    ``SILENT_S``). A second one aborts at once (``_Abort``): the connections are closed, what is
    left down is named, and the journal records the interruption."""

    def __init__(self) -> None:
        self.asked = False
        self.signal = ""
        self.note: Callable[[str], None] = lambda _m: None

    def __call__(self) -> bool:
        return self.asked

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.asked:
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)  # the abort is quick; a third signal must not cut it short
            raise _Abort(f"second signal ({self.signal}, then {name})")
        self.asked, self.signal = True, name
        self.note(f"{name}: stopping after the step in progress (again to abort at once)")


class _Abort(KeyboardInterrupt):
    """A second Ctrl-C/SIGTERM: stop in the middle of a step."""


@contextmanager
def _signals(stop: _Stop) -> Iterator[None]:
    old = {s: signal.signal(s, stop.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _view(state: RolloutState, now: float) -> Table:
    batch = f"batch {state.batch_index + 1}/{len(state.batches)}" if state.current else "between batches"
    title = f"fleet {state.kind} {state.id}: {batch}" + (f" ({state.waiting})" if state.waiting else "")
    if state.failing:
        title += f" [red]failing: {escape(state.failing)}[/]"
    table = Table(title=title, title_justify="left")
    for col in ("host", "instance", "step", "release", "waiting on", "for"):
        table.add_column(col)
    for ref in state.current:
        i = state.inst(ref)
        waited = "" if i.phase in TERMINAL else f"{max(0.0, now - i.phase_since):.0f}s"
        step = i.phase.value + (" (rolling back)" if i.rolling_back else "")
        table.add_row(ref.host, ref.instance, step, i.release, escape(i.note), waited)
    return table


class LiveRunner(Runner):
    """The runner, remembering the state it last observed for the live view."""

    last: RolloutState | None = None

    def observe(self, state: RolloutState) -> Observations:
        self.last = state
        return super().observe(state)


def _run(
    state: RolloutState,
    executor: SshExecutor,
    journal: RolloutJournal,
    as_json: bool,
    resumed: bool,
) -> RolloutState:
    stop = _Stop()
    err = Console(stderr=True, highlight=False)
    live_on = not as_json and err.is_terminal
    events: list[str] = []

    def event(line: str) -> None:
        events.append(line)
        if not as_json:
            err.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {escape(line)}", soft_wrap=True)

    runner = LiveRunner(executor, journal, should_stop=stop, on_event=event)
    stop.note = event
    if not as_json:
        what = "resuming" if resumed else "starting"
        n, b = len(state.instances), len(state.batches)
        err.print(f"{what} {state.kind} {state.id}: {n} instance(s) in {b} batch(es)")
    try:
        return _loop(runner, state, stop, live_on, event, err)
    except KeyboardInterrupt as exc:  # a second signal (or a Ctrl-C that came before ours was set)
        _abort(runner.state or state, executor, journal, as_json, str(exc) or "Ctrl-C")


def _loop(
    runner: LiveRunner,
    state: RolloutState,
    stop: _Stop,
    live_on: bool,
    event: Callable[[str], None],
    err: Console,
) -> RolloutState:
    with _signals(stop):
        if live_on:
            with Live(console=err, refresh_per_second=2, transient=True) as live:

                def on_event(line: str) -> None:
                    event(line)
                    live.update(_live(runner, state))

                runner.on_event = on_event

                def tick(seconds: float) -> None:
                    live.update(_live(runner, state))
                    time.sleep(seconds)

                runner.sleep = tick
                final = runner.run(state)
        else:
            final = runner.run(state)
    return final


def _abort(state: RolloutState, executor: SshExecutor, journal: RolloutJournal, as_json: bool, how: str) -> NoReturn:
    """Stop in the middle of a step: close every SSH connection (a command in flight ends now, and
    nothing more is sent), journal the interruption, say what is left down and how to resume."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)  # quick, and must not be cut short
    executor.close()
    down = left_down(state)
    names = ", ".join(str(i.ref) for i in down) or "none"
    detail = f"aborted during a step on a {how}; not serving (stopped by this rollout, not back): {names}"
    journal.interrupted(state, detail, time.time())
    lines = [
        f"{state.kind} {state.id} aborted during a step ({how}); the journal records it",
        *(f"{i.ref}: not serving: this rollout stopped it and it is not back (last step: {i.phase.value})"
          for i in down),
        *(["no instance was left stopped by this rollout"] if not down else []),
        f"resume with: fleet rollout --resume {state.id}",
    ]  # fmt: skip
    if as_json:
        body = {"id": state.id, "fleet": state.fleet, "kind": state.kind, "status": "interrupted",
                "reason": detail, "down": [str(i.ref) for i in down], "next": lines}  # fmt: skip
        click.echo(json.dumps(body, indent=2))
    else:
        out = console(stderr=True)
        for line in lines:
            out.print(escape(line), soft_wrap=True)
    sys.exit(EXIT_STOPPED)


def _live(runner: LiveRunner, initial: RolloutState) -> Group:
    return Group(_view(runner.last or initial, time.time()), Text(""))


def _summary(state: RolloutState, skipped: Mapping[str, DrainMarker] | None = None) -> dict[str, Any]:
    return {
        "id": state.id,
        "fleet": state.fleet,
        "kind": state.kind,
        # a rollout whose process ends before it did is interrupted (the journal keeps it running)
        "status": "interrupted" if state.status is RolloutStatus.RUNNING else state.status.value,
        "reason": state.reason,
        "instances": [
            {
                "instance": str(ref),
                "phase": i.phase.value,
                "release_before": i.previous_release,
                "release": i.release,
                "failure": i.failure,
                "rollback_failure": i.rollback_failure,
            }
            for ref, i in state.instances.items()
        ],
        "next": next_steps(state),
        "skipped": [{"host": name, "drained": m.data()} for name, m in (skipped or {}).items()],
    }


def report_state(state: RolloutState, as_json: bool, skipped: Mapping[str, DrainMarker] | None = None) -> None:
    """The result for people or ``--json``, then exit (0: every instance healthy; hosts skipped
    because they are drained do not change that)."""
    if as_json:
        click.echo(json.dumps(_summary(state, skipped), indent=2))
    else:
        shown = "interrupted" if state.status is RolloutStatus.RUNNING else state.status.value
        table = Table(title=f"fleet {state.kind} {state.id}: {shown}", title_justify="left")
        for col in ("instance", "result", "release before", "release now", "why"):
            table.add_column(col)
        for ref, i in state.instances.items():
            why = i.rollback_failure or i.failure or i.note
            table.add_row(str(ref), i.phase.value, i.previous_release or "-", i.release, escape(why))
        out = console()
        out.print(table)
        for line in next_steps(state):
            out.print(escape(line), soft_wrap=True)
        for name, m in (skipped or {}).items():
            out.print(escape(f"skipped {name}: {m.describe()}"), soft_wrap=True)
    sys.exit(0 if state.status is RolloutStatus.DONE else EXIT_SOME_HOSTS)


def _start(
    fleet: RolloutFleet,
    kind: str,
    targets_of: Callable[[SshExecutor], list[Target]],
    opts: Mapping[str, Any],
) -> None:
    """Check everything, take the lock, build the targets, journal the rollout, run it, report."""
    skipped: dict[str, DrainMarker] = {}
    overridden = audit_gate(fleet, kind, opts)
    report_state(roll(fleet, kind, targets_of, opts, on_skipped=skipped.update, overridden=overridden),
                 bool(opts["as_json"]), skipped)  # fmt: skip


def audit_gate(fleet: RolloutFleet, kind: str, opts: Mapping[str, Any]) -> tuple[Finding, ...]:
    """The audit's gate (``fleet.audit.gate``) before anything is touched: a refusal exits 1 (a
    host's state refuses it, the input is fine: the exit-code table's "some host could not be
    served"), a bad ``--ignore-finding`` exits 2; the findings let through, to journal."""
    as_json = bool(opts.get("as_json"))
    try:
        ignored = check_ignored(opts.get("ignore_finding") or ())
    except ValueError as exc:
        fail(str(exc), as_json, code=EXIT_INVALID)
    verdict = fleet.gate(ignored)
    if not verdict.ok:
        fail(verdict.message(f"fleet {kind}") + "\nnothing was touched", as_json, code=EXIT_SOME_HOSTS)
    warn = warn_to_stderr(as_json)
    for f in verdict.overridden:
        warn(f"{f.where}: {f.rule} ({f.severity.label}) overridden by --ignore-finding {f.rule}: {f.message}")
    return verdict.overridden


def roll(
    fleet: RolloutFleet,
    kind: str,
    targets_of: Callable[[SshExecutor], list[Target]],
    opts: Mapping[str, Any],
    on_skipped: Callable[[Mapping[str, DrainMarker]], None] = lambda _d: None,
    overridden: tuple[Finding, ...] = (),
) -> RolloutState:
    """``run_rollout`` with the command line's live view; a bad input or a held lock exits here.
    Hosts drained for maintenance are skipped (said on stderr, given to ``on_skipped``)."""
    as_json = bool(opts.get("as_json"))
    warn = warn_to_stderr(as_json)
    for host, why in fleet.unread_quarantine.items():
        warn(f"{host}: {why}")
    for host, held in fleet.quarantined.items():
        warn(f"{host}: planned around quarantined GPU(s) " + "; ".join(f"{i}: {w}" for i, w in sorted(held.items())))
    return guarded(
        lambda: run_rollout(
            fleet, kind, targets_of, overrides_of(opts), journal_path=opts.get("journal_path"),
            take_over=bool(opts.get("take_over")), gates_over_ssh=opts.get("gates_over_ssh") or (),
            run=live_loop(as_json), lb=not opts.get("no_lb"), warn=warn_to_stderr(as_json), on_skipped=on_skipped,
            overridden=overridden,
        ),
        as_json,
    )  # fmt: skip


def before_start(exc: FleetError) -> str:
    """The message of an error raised before anything started: a host that could not be asked says
    that nothing was changed (as ``guarded`` does for the same error later)."""
    return f"{exc} (nothing was changed)" if isinstance(exc, ExecutorError) else str(exc)


def live_loop(as_json: bool) -> Callable[[RolloutState, SshExecutor, RolloutJournal], RolloutState]:
    """The runner with the command line's live view (and Ctrl-C between steps)."""
    return lambda state, executor, journal: _run(state, executor, journal, as_json, resumed=False)


def guarded(call: Callable[[], RolloutState], as_json: bool) -> RolloutState:
    """``call()``; a held lock, a balancer that cannot be used or is down, or a bad input exits
    here, saying that nothing was touched and the way out."""
    try:
        return call()
    except LockHeld as exc:
        fail(str(exc), as_json, code=EXIT_INVALID)
    except BalancerMisconfigured as exc:
        fail(f"{exc}\nnothing was touched; fix the balancer, or roll without it: --no-lb", as_json, code=EXIT_INVALID)
    except BalancerDown as exc:
        fail(f"{exc}\nnothing was touched; bring the balancer back, or roll without it: --no-lb (clients will "
             "see failed requests)", as_json, code=EXIT_SOME_HOSTS)  # fmt: skip
    except ExecutorError as exc:  # a host could not be asked before anything started: not bad input
        fail(f"{exc} (nothing was changed)", as_json, code=EXIT_SOME_HOSTS)
    except FleetError as exc:
        fail(str(exc), as_json)


def warn_to_stderr(as_json: bool) -> Callable[[str], None]:
    """Warnings go to stderr (also with --json, whose document is stdout's)."""

    def say(line: str) -> None:
        Console(stderr=True, highlight=False).print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)

    return say


def _running_releases(executor: SshExecutor, fleet: RolloutFleet) -> dict[InstanceRef, str | None]:
    """The release each instance runs now (its process's; ``fleet.facts.releases.running_release``):
    a restart keeps every instance on its own, whatever its host's ``current`` link says. Hosts the
    rollout skips (drained, maybe down) are not asked."""
    return {ref: executor.live(ref).release for ref in fleet.instances if ref.host not in executor.skipped}


# ---- commands -------------------------------------------------------------------------------------


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@_policy_options
def restart(inventory: str, limit: tuple[str, ...], **opts: Any) -> None:
    """Restart every instance, batch by batch, behind the health gates (no configuration change).

    The on-call restart: each instance is drained, stopped, checked for GPUs left held (an
    orphaned engine is named and stopped), started on the release it runs, and gated. A failure
    halts the restart. Exit status 0 when every instance is healthy, 1 when it halted or was
    stopped (the message says how to resume), 2 on invalid input or a held lock.
    """
    try:
        check_journal(opts)
        fleet = load_fleet(inventory, limit, refuse_unreachable=True, keep_connections=True)
    except FleetError as exc:
        fail(before_start(exc), bool(opts["as_json"]), code=exit_code_of(exc))
    opts.setdefault("on_failure", None)
    if not opts["on_failure"]:
        opts["on_failure"] = "halt"  # rolling "back" a restart would restart the same release again
    _start(fleet, "restart", lambda ex: fleet.instance_targets(_running_releases(ex, fleet), restart=True,
                                                               skip=ex.skipped), opts)  # fmt: skip


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True), required=False)
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--release", help="Roll every instance onto this installed vLLM release (a name under releases/).")
@click.option("--model", help="Serve this model instead of the inventory's (a shortcut for editing it).")
@click.option(
    "--model-config",
    type=click.Path(dir_okay=False, exists=True),
    help="With --model: its config.json on this machine (default: the bundled one or the HF cache).",
)
@click.option("--resume", "resume_id", is_flag=False, flag_value="", default=None,
              help="Resume a rollout that did not finish (the last one, or the ID given).")  # fmt: skip
@_policy_options
def rollout(
    inventory: str | None,
    limit: tuple[str, ...],
    release: str | None,
    model: str | None,
    model_config: str | None,
    resume_id: str | None,
    **opts: Any,
) -> None:
    """Roll the inventory's serving settings out, batch by batch, behind the health gates; or resume one.

    ``fleet rollout INVENTORY`` applies what the inventory says now (a new model, vLLM release,
    flags, API key): each host gets the new release built beside the running one and each
    instance's new unit and env file stored as a configuration revision; then every instance
    whose release or configuration differs is drained, stopped, switched, started and gated,
    the first batch as the canary. A failed batch goes back to what it ran (a link flip, the old
    files, a restart) and the rollout halts. ``--model M`` is the same with the model replaced.
    ``--release R`` switches each instance to the installed release R only. ``--resume [ID]``
    reads every host's true state and finishes (or rolls back) a rollout whose control process
    died or was stopped.
    """
    as_json = bool(opts["as_json"])
    if resume_id is not None:
        _resume(resume_id, opts)
        return
    if inventory is None:
        fail("give an INVENTORY (with --release NAME or --model M, or neither), or --resume [ID]", as_json)
    if release and (model or model_config):
        fail("--release and --model are two different rollouts: give one of them", as_json)
    if model_config and not model:
        fail("--model-config goes with --model", as_json)
    if not release:
        overrides = {"model": model, "model_config": model_config} if model else None
        _apply(inventory, list(limit) or None, overrides, opts.get("health_timeout") or 300.0, opts)
        return
    try:
        check_journal(opts)
        fleet = load_fleet(inventory, limit, refuse_unreachable=True, keep_connections=True)
    except FleetError as exc:
        fail(before_start(exc), as_json, code=exit_code_of(exc))
    chosen = release
    _start(fleet, "rollout", lambda _ex: fleet.targets(dict.fromkeys(fleet.hosts, chosen), restart=False), opts)


def _apply(
    inventory: str, limit: list[str] | None, overrides: Mapping[str, Any] | None, timeout: float,
    opts: Mapping[str, Any],
) -> None:  # fmt: skip
    """The inventory's serving settings onto the hosts (``fleet deploy``'s operations), rolled by the engine."""
    from gevent import monkey

    monkey.patch_all()  # pyinfra's operations run on gevent (see ``fleet deploy``)
    from fleet.cli.deploy_view import HostSteps, report
    from fleet.deploy.runner import deploy as run_deploy

    as_json = bool(opts["as_json"])
    err = Console(stderr=True, highlight=False)
    try:
        ignored = check_ignored(opts.get("ignore_finding") or ())
    except ValueError as exc:
        fail(str(exc), as_json, code=EXIT_INVALID)
    try:
        # the policy is checked before any host is touched
        load_fleet(inventory, limit, overrides).policy(overrides_of(opts))
        with HostSteps(err) as steps:
            result = run_deploy(
                inventory, limit, health_timeout=timeout, progress=steps.note, step=steps.step,
                roll=steps.paused(lambda fleet, targets_of: roll(fleet, "rollout", targets_of, opts,
                                                                 overridden=fleet.gate(ignored).overridden)),
                overrides=overrides, ignore_findings=ignored,
            )  # fmt: skip
    except FleetError as exc:
        fail(str(exc), as_json, code=exit_code_of(exc))
    report(result, as_json, "fleet rollout")


def _resume(resume_id: str, opts: Mapping[str, Any]) -> None:
    as_json = bool(opts["as_json"])
    try:
        final = resume_rollout(
            resume_id or None, journal_path=opts["journal_path"], take_over=bool(opts["take_over"]),
            gates_over_ssh=opts["gates_over_ssh"] or (), lb=not opts.get("no_lb"),
            run=lambda state, executor, journal: _run(state, executor, journal, as_json, resumed=True),
            warn=warn_to_stderr(as_json),
        )  # fmt: skip
    except NothingToResume as exc:
        fail(str(exc), as_json, code=EXIT_SOME_HOSTS)
    except BalancerDown as exc:
        fail(f"{exc}\nnothing was touched; bring the balancer back, or resume without it: --no-lb",
             as_json, code=EXIT_SOME_HOSTS)  # fmt: skip
    except BalancerMisconfigured as exc:
        fail(f"{exc}\nor resume without the balancer: --no-lb", as_json, code=EXIT_INVALID)
    except FleetError as exc:
        fail(str(exc), as_json, code=exit_code_of(exc))
    report_state(final, as_json)


@click.command()
@click.argument("target", required=False)
@click.option("--limit", multiple=True, help="With an INVENTORY: only these hosts or groups.")
@_policy_options
def rollback(target: str | None, limit: tuple[str, ...], **opts: Any) -> None:
    """Go back to the last good release: a link flip and a restart per instance, no reinstall.

    TARGET is a rollout ID (every instance it changed goes back to what it ran before it) or an
    INVENTORY (each instance goes back to what it ran before the newest rollout that changed it,
    as the journal recorded it for that instance; instances no rollout changed stay as they are).
    Without TARGET: the last rollout in the journal.
    """
    as_json = bool(opts["as_json"])
    if target is not None and Path(target).is_file():
        _rollback_inventory(target, limit, opts)
        return
    try:
        with open_journal(opts["journal_path"]) as journal:
            rid = target or next((r.id for r in journal.history(None, 200) if r.kind == "rollout"), None)
            if not rid:
                fail("no rollout in the journal to roll back; give an INVENTORY to send each instance back to what "
                     "it ran before its last rollout", as_json)  # fmt: skip
            saved = journal.latest_state(rid)
    except FleetError as exc:
        fail(str(exc), as_json, code=exit_code_of(exc))
    back = {ref: i for ref, i in saved.instances.items() if i.touched and i.previous_release}
    if not back:
        fail(f"rollout {rid} changed no instance: nothing to roll back", as_json, code=EXIT_SOME_HOSTS)
    try:
        fleet = load_fleet(saved.fleet, sorted({r.host for r in back}), refuse_unreachable=True, keep_connections=True)
    except FleetError as exc:
        fail(before_start(exc), as_json, code=exit_code_of(exc))
    _start(fleet, "rollback", lambda _ex: [back_to(i) for ref, i in back.items() if ref in fleet.instances], opts)


#: rollouts of a fleet read to find each instance's newest change (newest first)
ROLLBACK_HISTORY = 200


def _rollback_inventory(inventory: str, limit: tuple[str, ...], opts: Mapping[str, Any]) -> None:
    """``fleet rollback INVENTORY``: each instance back to what it ran before the newest rollout
    that changed it (``fleet.rollout.previous``), from the journal; never the host's ``previous``
    link, which one instance's switch flips for all of the host's."""
    as_json = bool(opts["as_json"])
    try:
        check_journal(opts)
        fleet = load_fleet(inventory, limit, refuse_unreachable=True, keep_connections=True)
    except FleetError as exc:
        fail(before_start(exc), as_json, code=exit_code_of(exc))
    try:
        with open_journal(opts["journal_path"]) as journal:
            records = journal.history(fleet.name, ROLLBACK_HISTORY)
            changes = last_changes(journal.latest_state(r.id) for r in records)
    except ValueError as exc:
        fail(f"rollout {exc} of {inventory} did not finish: resume it (fleet rollout --resume {exc}) or roll "
             f"it back by its ID (fleet rollback {exc}) first", as_json, code=EXIT_SOME_HOSTS)  # fmt: skip
    except FleetError as exc:
        fail(str(exc), as_json)
    targets, untouched = rollback_targets(changes, fleet.instances)
    if not targets:
        fail(f"no rollout in the journal changed an instance of {inventory}: nothing to go back to "
             "(fleet history lists the rollouts; fleet rollout INVENTORY --release R goes to a given release)",
             as_json, code=EXIT_SOME_HOSTS)  # fmt: skip
    if untouched and not as_json:
        names = ", ".join(str(r) for r in untouched)
        Console(stderr=True, highlight=False).print(f"no rollout changed {escape(names)}: left as they are")
    _start(fleet, "rollback", lambda _ex: targets, opts)
