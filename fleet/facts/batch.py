"""Many pyinfra facts in one command: one SSH round trip (and one ``sudo``) instead of one each.

pyinfra 3 runs every ``host.get_fact`` as its own command over SSH, through ``sudo`` when the
deploy uses it: on a host where nothing changes, that per-fact round trip is most of a deploy's
time. :class:`FactBatch` runs the commands of many facts in one shell script and hands back, per
fact, its exit status and its standard output split into lines the way pyinfra's connector splits
them (``pyinfra.connectors.util.read_buffer``: one line per ``\\n``, the newline dropped), so each
fact's own ``process()`` reads exactly what it would have read on its own
(:func:`answer_of`). Each fact's output travels base64-encoded on one line of the batch's output:
what a fact prints cannot be mistaken for another fact's answer.

The facts run side by side, each in its own background subshell writing to its own file in a
private directory (``mktemp -d``, mode 0700), and the files are printed in order once every one has
finished (POSIX ``wait``): a host's answer comes after its slowest fact rather than after the sum of
them all (a no-change deploy's batch: ~0.28 s one after another, ~0.13 s side by side on a loaded lab
host). Facts only read, so their order never mattered; each output is a file of its own, so long
answers never interleave (a pipe keeps writes whole only up to ``PIPE_BUF``). Where ``mktemp`` fails
the batch answers nothing and every fact is read on its own, as before the batch existed.

**Example:**

.. code:: python

    requests = [FactRequest(Sha1File, {"path": "/etc/fstab"}), FactRequest(Arch, {})]
    answers = host.get_fact(FactBatch, commands=[r.shell() for r in requests])
    value = answer_of(requests[0], answers.get(0))  # NO_ANSWER: read it on its own
"""

from __future__ import annotations

import base64
import binascii
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from inspect import getcallargs
from typing import Any

from pyinfra.api.command import StringCommand
from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import FactBase
from typing_extensions import override

#: Printed instead of a fact's output when the command its fact requires is missing (then the
#: fact is read on its own, and pyinfra decides what that means in this phase).
MISSING = "##fleet-batch-missing-command##"


class NoAnswer:
    """The batch has no usable answer for a fact: read it on its own."""

    def __repr__(self) -> str:
        return "NO_ANSWER"


NO_ANSWER = NoAnswer()


def _text(command: str | StringCommand) -> str:
    return command.get_raw_value() if isinstance(command, StringCommand) else str(command)


@dataclass(frozen=True)
class FactRequest:
    """One fact with its arguments, as ``host.get_fact(fact, **kwargs)`` would read it."""

    fact: type[FactBase[Any]]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def arguments(self) -> dict[str, Any]:
        """The fact's arguments as pyinfra binds them (``getcallargs`` of its ``command``)."""
        if not self.kwargs:
            return {}
        bound = getcallargs(self.fact().command, **self.kwargs)
        bound.pop("self", None)
        return bound

    def shell(self) -> str:
        """The command pyinfra runs for this fact (``pyinfra.api.facts._get_fact``), guard included."""
        fact = self.fact()
        arguments = self.arguments()
        command = _text(fact.command(**arguments))
        requires = fact.requires_command(**arguments)
        if requires:
            return (
                f"if command -v {_text(requires)} >/dev/null 2>&1; then ( {command} ); "
                f"else echo {shlex.quote(MISSING)}; fi"
            )
        return command


def _script(index: int, command: str) -> str:
    # The output and the status, kept apart by one newline: $(...) strips trailing newlines only
    # after the status, so the output comes back byte for byte.
    return (
        f'o=$( (\n{command}\n) 2>/dev/null; r=$?; echo; echo "$r"); '
        f"printf '{index} %s\\n' \"$(printf '%s' \"$o\" | base64 -w0)\""
    )


def lines_of(text: str) -> list[str]:
    """``text`` as pyinfra's connector splits a command's output into lines."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


@dataclass(frozen=True)
class BatchAnswer:
    status: int
    lines: list[str]


class FactBatch(FactBase[dict[int, BatchAnswer]]):
    """
    Run many fact commands in one: ``{index: BatchAnswer(exit status, stdout lines)}``, an index
    missing when its answer could not be read.

    + commands: the facts' shell commands (:meth:`FactRequest.shell`)
    """

    @override
    def command(self, commands: Sequence[str]) -> str:
        jobs = "\n".join(f'{{ {_script(i, c)}\n}} >"$d/{i}" &' for i, c in enumerate(commands))
        files = " ".join(f'"$d/{i}"' for i in range(len(commands)))
        return f'd=$(mktemp -d) || exit 0\n{jobs}\nwait\ncat {files}\nrm -rf "$d"' if commands else ":"

    @staticmethod
    @override
    def default() -> dict[int, BatchAnswer]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[int, BatchAnswer]:
        answers: dict[int, BatchAnswer] = {}
        for line in output:
            index, _, encoded = line.partition(" ")
            if not index.isdigit():
                continue
            try:
                raw = base64.b64decode(encoded, validate=True).decode(errors="replace")
            except (binascii.Error, ValueError):
                continue
            text, _, status = raw.rpartition("\n")
            if status.isdigit():
                answers[int(index)] = BatchAnswer(int(status), lines_of(text))
        return answers


def answer_of(request: FactRequest, answer: BatchAnswer | None) -> Any:
    """The fact's value from its batch answer, as pyinfra's ``get_fact`` would give it, or
    ``NO_ANSWER`` where pyinfra would do more than return a value (a failed command: an error,
    a failed host; a missing command; output its fact cannot process): read those on their own."""
    if answer is None or answer.status != 0:
        return NO_ANSWER
    if answer.lines == [MISSING]:
        return NO_ANSWER  # the command the fact requires is missing
    fact = request.fact()
    if not answer.lines:
        return fact.default()
    fact.command(**request.arguments())  # pyinfra's facts keep their arguments for process()
    try:
        return fact.process(answer.lines)
    except FactProcessError:
        return NO_ANSWER
