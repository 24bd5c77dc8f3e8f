"""Run a fleet pyinfra operation against recorded fact output, the way pyinfra tests its own.

``facts`` maps ``(FactClass, kwargs)`` to what the host printed for that fact's command (a list of
lines, fed through the fact's own ``process()``; ``[]`` = no output, the fact's ``default()``), or
to ``Value(x)`` for a value already processed (pyinfra's own facts, whose commands are theirs).
The operation's generator runs exactly as pyinfra runs it, with no host and no SSH; the test
reads the commands it yields.
"""

from __future__ import annotations

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

    def get_fact(self, fact_cls: type, *args: Any, **kwargs: Any) -> Any:
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
            if isinstance(cmd, StringCommand):
                stdin = cmd.connector_arguments.get("_stdin")
                out.append(Command(cmd.get_raw_value(), stdin))
            else:
                out.append(Command(str(cmd), None))
    return Run(out, host.noops)
