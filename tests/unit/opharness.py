"""Run a fleet pyinfra operation against recorded fact output, the way pyinfra tests its own.

``facts`` maps ``(FactClass, kwargs)`` to what the host printed for that fact's command (a list of
lines, fed through the fact's own ``process()``; ``[]`` = no output, the fact's ``default()``), or
to ``Value(x)`` for a value already processed (pyinfra's own facts, whose commands are theirs).
The operation's generator runs exactly as pyinfra runs it, with no host and no SSH; the test
reads the commands it yields, and the fact reads it made (``Run.reads``): in ``fleet deploy``
every command empties the host's fact cache, so a read after the operation's first command is a
round trip of its own, while the reads before it are one (``fleet.deploy.factcache`` reads an
operation's facts ahead).
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.arguments import all_argument_meta
from pyinfra.api.command import StringCommand
from pyinfra.api.config import Config
from pyinfra.context import ctx_host, ctx_state


@dataclass(frozen=True)
class Value:
    value: Any


FactKey = tuple[type, tuple[tuple[str, Any], ...]]


def key(fact: type, **kwargs: Any) -> FactKey:
    return (fact, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))


@dataclass
class RecordedHost:
    facts: Mapping[FactKey, list[str] | Value]
    name: str = "gpu-1"
    noops: list[str] = field(default_factory=list)
    in_op: bool = True
    in_callback_op: bool = False
    current_op_global_arguments: Any = None
    #: each read: (fact name, commands the operation had yielded before it)
    reads: list[tuple[str, int]] = field(default_factory=list)
    yielded: int = 0

    def get_fact(self, fact_cls: type, *args: Any, **kwargs: Any) -> Any:
        value = self._value(fact_cls, **kwargs)
        self.reads.append((fact_cls.__name__, self.yielded))
        return value

    def _value(self, fact_cls: type, **kwargs: Any) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k not in all_argument_meta}
        recorded = self.facts[key(fact_cls, **kwargs)]  # KeyError: the test forgot a fact
        if isinstance(recorded, Value):
            return recorded.value
        fact = fact_cls()
        fact.command(**kwargs)  # as pyinfra does: some facts keep their arguments for process()
        return fact.process(recorded) if recorded else fact.default()

    def noop(self, description: str) -> None:
        self.noops.append(description)


@dataclass
class Command:
    """One yielded command: its shell text and what goes to its stdin."""

    text: str
    stdin: str | None


@dataclass
class Run:
    commands: list[Command]
    noops: list[str]
    reads: list[tuple[str, int]] = field(default_factory=list)

    @property
    def round_trips(self) -> int:
        """Commands plus fact reads ``fleet deploy`` sends for this operation once an earlier
        operation changed the host (nothing cached): the reads before its first command together
        (read ahead), each read after one on its own."""
        early = any(n == 0 for _f, n in self.reads)
        return len(self.commands) + int(early) + len(self.late_reads)

    @property
    def late_reads(self) -> list[str]:
        """Facts read after the operation's first command (in a deploy each is a round trip)."""
        return [f for f, n in self.reads if n > 0]

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.commands]


class _State:
    config = Config()


def run_op(op: Any, facts: Mapping[FactKey, list[str] | Value], **kwargs: Any) -> Run:
    """The commands ``op(**kwargs)`` yields on a host with ``facts``."""
    host = RecordedHost(facts)
    out = []
    with ctx_state.use(_State()), ctx_host.use(host):
        for cmd in op._inner(**kwargs):
            host.yielded += 1
            if isinstance(cmd, StringCommand):
                stdin = cmd.connector_arguments.get("_stdin")
                out.append(Command(cmd.get_raw_value(), stdin))
            else:
                out.append(Command(str(cmd), None))
    return Run(out, host.noops, host.reads)


def written(command: Command) -> dict[str, tuple[bytes, str, str]]:
    """What a ``fleet.operations.files.write_many_command`` writes: path -> (content, owner, mode)."""
    argv = shlex.split(_write_part(command.text))
    args = argv[argv.index("fleet-write") + 1 :]
    stdin = command.stdin or ""
    out = {}
    for i in range(0, len(args), 4):
        directory, name, owner, mode = args[i : i + 4]
        head, stdin = stdin.split("\n", 1)
        n, size = (int(x) for x in head.split())
        data, stdin = base64.b64decode(stdin[:n]), stdin[n:]
        assert len(data) == size
        out[f"{directory}/{name}"] = (data, owner, mode)
    assert stdin == ""
    return out


def _write_part(text: str) -> str:
    return next(p for p in text.split(" && ") if "fleet-write" in p)
