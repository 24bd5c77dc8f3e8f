"""Ask the host's own installed vLLM whether it accepts a ``vllm serve`` command line.

``ServeCheck`` follows pyinfra's facts (``command()``/``process()``). The command runs a small
script with the release's Python, as the service user and with the unit's Hugging Face settings,
so it sees what the unit will see. For each instance it

* builds the parser the way ``vllm serve`` does: ``make_arg_parser(FlexibleArgumentParser())``
  from ``vllm.entrypoints.common.cli_args`` and ``vllm.utils.argparse_utils`` (vLLM 0.33.0,
  ``vllm/entrypoints/cli/serve.py``, ``ServeSubcommand.subparser_init``; vLLM 0.32.0, the lab's
  CPU build, has ``make_arg_parser`` in ``vllm.entrypoints.launchers.cli_args``), and parses the planned
  argv with it: a flag that this vLLM does not know is refused here, with vLLM's own message;
* resolves the model: a local directory must hold ``config.json``; a Hugging Face id must be in
  the cache under ``$HF_HOME/hub`` (``models--<org>--<name>/snapshots/*/config.json``, the layout
  of ``huggingface_hub``'s cache), since the units run with ``HF_HUB_OFFLINE=1``.

It always exits 0 and prints one JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.output import answer_line

_END = "FLEET_SERVE_CHECK_EOF"

SCRIPT = r"""
import contextlib, glob, io, json, os, sys
jobs = json.loads(sys.argv[1])
try:
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ModuleNotFoundError:  # vLLM 0.32 (the lab's CPU build) keeps it here
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except Exception as exc:
    print(json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)}))
    sys.exit(0)
out = []
hub = os.path.join(os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
for job in jobs:
    parse = None
    err = io.StringIO()
    try:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(job["argv"])
    except SystemExit as exc:
        if exc.code:
            lines = [l for l in err.getvalue().splitlines() if l.strip()]
            parse = (lines[-1] if lines else "exit %s" % exc.code)[-400:]
    except Exception as exc:
        parse = ("%s: %s" % (type(exc).__name__, exc))[-400:]
    model = job["argv"][0] if job["argv"] else ""
    if model.startswith(("/", "./", "../")):
        found = os.path.isfile(os.path.join(model, "config.json"))
        where = model
    else:
        where = os.path.join(hub, "models--" + model.replace("/", "--"))
        found = bool(glob.glob(os.path.join(where, "snapshots", "*", "config.json")))
    out.append({"unit": job["unit"], "parse": parse, "model_found": found, "model_where": where})
print(json.dumps({"error": None, "instances": out}))
"""


@dataclass(frozen=True)
class InstanceCheck:
    unit: str
    parse_error: str | None  #: vLLM's own message when it refuses the argv; None: accepted
    model_found: bool
    model_where: str  #: the directory looked at


@dataclass(frozen=True)
class ServeCheckResult:
    error: str | None  #: the host's vLLM could not be imported (not installed, broken venv)
    instances: tuple[InstanceCheck, ...]


def serve_check_command(python: str, user: str, hf_home: str, jobs: Sequence[tuple[str, Sequence[str]]]) -> str:
    """The shell command: the script on stdin, run as ``user`` with the unit's HF settings."""
    payload = json.dumps([{"unit": unit, "argv": list(argv)} for unit, argv in jobs])
    argv = ["sudo", "-n", "-u", user, "--", "env", f"HF_HOME={hf_home}", "HF_HUB_OFFLINE=1", python, "-", payload]
    return f"cd / && {ssh_command(argv)} <<'{_END}'\n{SCRIPT}\n{_END}\n"


class ServeCheck(FactBase[ServeCheckResult]):
    """
    Whether the host's installed vLLM accepts each planned ``vllm serve`` argv, and whether the model
    resolves on the host.

    + python: the release's interpreter; user: the service user; hf_home: the unit's ``HF_HOME``
    + jobs: ``(unit name, argv after "vllm serve")`` per instance
    """

    def command(self, python: str, user: str, hf_home: str, jobs: Sequence[tuple[str, Sequence[str]]]) -> str:
        return serve_check_command(python, user, hf_home, jobs)

    def process(self, output: list[str]) -> ServeCheckResult:
        text = answer_line(output)
        try:
            raw = json.loads(text)
            instances = tuple(
                InstanceCheck(str(i["unit"]), i["parse"], bool(i["model_found"]), str(i["model_where"]))
                for i in raw.get("instances") or ()
            )
            return ServeCheckResult(raw.get("error"), instances)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FleetError(f"serve check: unreadable answer {text[-200:]!r} ({exc})") from exc
