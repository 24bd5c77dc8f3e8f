"""The ``fleet`` command line: thin commands over the library, one module per verb.

Exit codes, the same for every command:

* 0: everything asked for was done (every host planned);
* 1: some host could not be served (it has no plan, or a check failed on it); the rest was done;
* 2: invalid input (an inventory, a group_data file, a model config, a command-line option):
  nothing was done, the message names the file, host, field and value;
* 3: an internal error, a bug in fleet: one line saying so and where to report it; the
  traceback only with ``--debug`` (or ``FLEET_DEBUG=1``), with secrets redacted.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import json
import os
import sys
import traceback
import types
from importlib import metadata
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from fleet.logs import route_library_logs
from fleet.secrets import redact, redact_data

EXIT_OK = 0
EXIT_SOME_HOSTS = 1
EXIT_INVALID = 2
EXIT_INTERNAL = 3


class RedactingWriter:
    """A text stream that runs everything written to it through ``redact``: every report goes here."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return bool(self._stream.isatty())

    def fileno(self) -> int:
        return int(self._stream.fileno())


def console(stderr: bool = False) -> Console:
    """A rich console for people, on stdout (or stderr), redacted."""
    return Console(file=RedactingWriter(sys.stderr if stderr else sys.stdout), highlight=False)  # type: ignore[arg-type]


def issues_url() -> str:
    """Where to report a bug: the package's ``Issues`` project URL."""
    try:
        for entry in metadata.metadata("fleet").get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            if label.strip().lower() in ("issues", "bug tracker", "tracker"):
                return str(url).strip()
    except metadata.PackageNotFoundError:
        pass
    return "the fleet issue tracker"


def _debug(ctx: click.Context | None) -> bool:
    if os.environ.get("FLEET_DEBUG") == "1":
        return True
    return bool(ctx is not None and ctx.find_root().meta.get("fleet.debug"))


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta["fleet.debug"] = True


#: ``--debug``, accepted before the command (``fleet --debug plan``) and after it (``fleet plan --debug``).
debug_option = click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_set_debug,
    help="On an internal error, print the traceback (secrets redacted).",
)


def internal_error(exc: BaseException, debug: bool) -> NoReturn:
    """A bug: one line (the traceback with ``--debug``), secrets redacted, exit 3."""
    err = console(stderr=True)
    if debug:
        err.print(escape("".join(traceback.format_exception(exc))), end="", soft_wrap=True)
    where = issues_url()
    hint = "" if debug else " (run again with --debug for the traceback)"
    err.print(
        escape(
            f"fleet: internal error ({type(exc).__name__}): this is a bug in fleet, not in your input; "
            f"please report it at {where}{hint}"
        ),
        soft_wrap=True,
    )
    sys.exit(EXIT_INTERNAL)


#: The commands, one module per verb: ``name: (module, attribute)``, imported only when that
#: command runs (or ``--help`` lists them), so ``fleet deploy`` does not pay for ``fleet audit``'s
#: imports (click's documented pattern for lazily loaded subcommands).
COMMANDS = {
    "audit": ("fleet.cli.audit", "audit"),
    "deploy": ("fleet.cli.deploy", "deploy"),
    "drain": ("fleet.cli.drain", "drain"),
    "gpu": ("fleet.cli.gpu", "gpu"),
    "history": ("fleet.cli.history", "history"),
    "lab": ("fleet.cli.lab", "lab"),
    "lb": ("fleet.cli.lb", "lb"),
    "monitor": ("fleet.cli.monitor", "monitor"),
    "plan": ("fleet.cli.plan", "plan"),
    "prune": ("fleet.cli.prune", "prune"),
    "restart": ("fleet.cli.rollout", "restart"),
    "rollback": ("fleet.cli.rollout", "rollback"),
    "rollout": ("fleet.cli.rollout", "rollout"),
    "stage": ("fleet.cli.stage", "stage"),
    "status": ("fleet.cli.status", "status"),
    "undrain": ("fleet.cli.drain", "undrain"),
}


class FleetGroup(click.Group):
    """Turns any exception a command did not handle into exit 3 (a bug), never a bare traceback;
    loads each command's module when it is asked for (``COMMANDS``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            module, attribute = COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            internal_error(exc, _debug(ctx))


@click.group(cls=FleetGroup)
@click.version_option(package_name="fleet")
@debug_option
def main() -> None:
    """Provision and roll out vLLM serving fleets on NVIDIA GPU hosts.

    Exit codes: 0 done; 1 some host could not be served; 2 invalid input; 3 internal error (a bug).
    """
    route_library_logs()  # paramiko's tracebacks go to fleet's log file, not between fleet's lines


def run() -> None:
    """The ``fleet`` program (``[project.scripts]``, ``python -m fleet.cli``): :func:`main`, and at
    exit no cyclic garbage collection of the whole heap.

    When the interpreter shuts down it clears every module and collects the cycles that leaves
    (CPython's ``finalize_modules``); after a deploy (pyinfra, paramiko, gevent's greenlets,
    pydantic's models) that took 1.1-1.3 s of a 5 s no-change ``fleet deploy`` on the 2-core
    development machine (0.1 s with this). ``gc.freeze()`` (Python 3.7+, the ``gc`` module's
    documentation) moves every object to the permanent generation, which no collection visits;
    objects are still freed by reference counting, and the operating system closes what is left
    open, as it would after ``os._exit``. Every command has closed its connections, journal and
    files and flushed its output before it returns, so nothing waits for that collection. Only
    the program does this, never ``main`` itself: tests call ``main`` in their own long-lived process.
    """
    atexit.register(gc.freeze)  # atexit runs last-in first-out: before logging's flush, which still runs
    defer_import("invoke")
    main()


def defer_import(name: str) -> None:
    """Load the module ``name`` only when one of its attributes is first used; nothing when it is
    imported already or not installed.

    For ``invoke``: paramiko's ``paramiko/config.py`` imports it at its own import, for one thing
    only, running an ssh_config ``Match exec`` command (``invoke.run``). Every command that
    connects imports paramiko, and ``invoke`` (with the ``unittest.mock``, ``asyncio`` and YAML
    modules it imports) was ~50 ms of a no-change ``fleet deploy``'s 0.6 s of imports
    (``python -X importtime``). Deferred, ``import invoke`` gives paramiko a stand-in module at
    once (its ``__spec__`` the real one's) whose first attribute read (PEP 562's module
    ``__getattr__``) imports the real module in its place and answers from it: a ``Match exec``
    line still runs ``invoke.run``; a broken install raises its error then, where paramiko would
    have raised its import error. (The standard library's ``importlib.util.LazyLoader`` does not
    serve here: Python 3.11's ``import`` statement reads the module's ``__spec__``, which loads
    it.) Only the program does this (:func:`run`): tests call ``main`` in their own process."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = types.ModuleType(name)
    stand_in.__spec__ = spec

    def load(attribute: str) -> Any:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attribute)

    stand_in.__dict__["__getattr__"] = load  # PEP 562
    sys.modules[name] = stand_in


def fail(
    message: str, as_json: bool, code: int = EXIT_INVALID, details: list[dict[str, Any]] | None = None
) -> NoReturn:
    """Report an error for people (stderr) or machines (``--json`` on stdout), redacted, and exit."""
    message = redact(message)
    if as_json:
        body: dict[str, Any] = {"error": message, "exit_code": code}
        if details is not None:
            body["problems"] = details
        click.echo(json.dumps(redact_data(body), indent=2))
    else:
        console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    sys.exit(code)
