"""Many pyinfra facts in one command: one SSH round trip (and one ``sudo``) instead of one each.

pyinfra 3 runs every ``host.get_fact`` as its own command over SSH, through ``sudo`` when the
deploy uses it: on a host where nothing changes, that per-fact round trip is most of a deploy's
time. :class:`FactBatch` runs the commands of many facts in one shell script and hands back, per
fact, its exit status and its standard output split into lines the way pyinfra's connector splits
them (``pyinfra.connectors.util.read_buffer``: one line per ``\\n``, the newline dropped), so each
fact's own ``process()`` reads exactly what it would have read on its own
(:func:`answer_of`).

The facts run side by side, each in a background subshell of its own (``{ ...; } >file &``: one
fork; a fact's ``exit`` ends only its own subshell) writing to its own file in a private directory
(``mktemp -d``, mode 0700); once every one has finished, the script prints one header line with each
fact's exit status (POSIX ``wait <pid>``, a builtin), each file's size in bytes (one ``stat``), then
all the files, concatenated, as one base64 line (one ``cat``, one ``base64``): the facts' outputs are
cut apart by their sizes, so what a fact prints (a line that looks like the header, the batch's own
command line listed by ``ps``, bytes that are not UTF-8, which the connector could not decode)
never reads as another fact's answer or breaks the batch's. A host's answer comes after its slowest
fact rather than after the sum of them all (a no-change deploy's batch: ~0.28 s one after another,
~0.13 s side by side on a loaded lab host). Facts only read, so their order never mattered; each
output is a file of its own, so long answers never interleave (a pipe keeps writes whole only up
to ``PIPE_BUF``). The wrapper costs ~4 processes in all instead of ~5 per fact (36 facts: 12 ms of
CPU instead of 62 ms, ``benchmarks/rerun_cpu.py`` for the hosts' share). An answer that is not
whole (no header, sizes that do not add up) is no answer for any fact; where ``mktemp`` fails the
batch answers nothing: then every fact is read on its own, as before the batch existed.

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
#: The first word of the batch's header line (the facts' exit statuses follow it).
HEADER = "##fleet-batch##"


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
        if not commands:
            return ":"
        # Each fact in a background subshell of its own (one fork; ``exit`` ends only it), its
        # output in its own file; then, once each has finished, its exit status (``wait``, a
        # builtin) on the header line, the files' sizes (one ``stat``) and the files themselves,
        # concatenated, as one base64 line (one ``cat``, one ``base64``).
        jobs = "\n".join(f'{{\n{c}\n}} >"$d/{i}" 2>/dev/null & p{i}=$!' for i, c in enumerate(commands))
        waits = "\n".join(f'wait "$p{i}"; h="$h $?"' for i in range(len(commands)))
        files = " ".join(f'"$d/{i}"' for i in range(len(commands)))
        return (
            f"d=$(mktemp -d) || exit 0\n{jobs}\nh={HEADER}\n{waits}\n"
            f'printf \'%s\\n\' "$h"\nstat -c %s -- {files}\ncat -- {files} | base64 -w0\necho\nrm -rf "$d"'
        )

    @staticmethod
    @override
    def default() -> dict[int, BatchAnswer]:
        return {}

    @override
    def process(self, output: list[str]) -> dict[int, BatchAnswer]:
        return batch_answers(output)


def batch_answers(output: Sequence[str]) -> dict[int, BatchAnswer]:
    """The batch's output -> ``{index: BatchAnswer}`` (pure); nothing (every fact read on its own)
    when it is not whole: no header, a size or status that is not a number, a size missing, or
    outputs that do not add up to the sizes."""
    at = next((i for i, line in enumerate(output) if line.split(" ")[0] == HEADER), None)
    if at is None:
        return {}
    statuses = output[at].split(" ")[1:]
    sizes = output[at + 1 : at + 1 + len(statuses)]
    encoded = output[at + 1 + len(statuses) : at + 2 + len(statuses)]
    if len(sizes) != len(statuses) or len(encoded) != 1:
        return {}
    if not all(s.isdigit() for s in [*statuses, *sizes]):
        return {}
    try:
        data = base64.b64decode(encoded[0], validate=True)
    except (binascii.Error, ValueError):
        return {}
    if sum(int(s) for s in sizes) != len(data):
        return {}
    answers: dict[int, BatchAnswer] = {}
    start = 0
    for index, (status, size) in enumerate(zip(statuses, sizes, strict=True)):
        text = data[start : start + int(size)].decode(errors="replace")
        start += int(size)
        answers[index] = BatchAnswer(int(status), lines_of(text))
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
