"""Whether a host is drained for maintenance (``fleet drain``): the marker file on the host itself.

``fleet drain`` writes ``/var/lib/fleet/drained.json`` on the host (root-only: the directory is
created ``0700`` and the file ``0600`` by ``fleet.operations.files.write_command``, the one atomic
write: a reader sees the old file or the new one) saying who drained it, when and why. Keeping it
on the host, not only in the control machine's journal, is what makes a rollout, a restart or a
deploy started from *another* control machine skip the host too (Kubernetes keeps a cordon on the
Node object for the same reason, ``spec.unschedulable``; Nomad keeps a node's drain on the server,
``nomad node drain``). ``fleet undrain`` removes it once every instance serves again.

The fact reads it as root (``sudo -n``; pyinfra's own ``sudo`` runs it as root already): a host
whose marker exists but cannot be read still counts as drained (the safe side), with why.

**Example:**

.. code:: python

    marker = host.get_fact(Drained)   # None: not drained
    marker.reason, marker.by
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pyinfra.api.facts import FactBase
from typing_extensions import override

from fleet.facts.batch import BatchAnswer, FactBatch
from fleet.facts.runner import HostUnreachable, SshTarget, run_fact_on_hosts

#: The marker's path on a host (fleet's state directory on the host).
MARKER_PATH = "/var/lib/fleet/drained.json"
#: the fact's first line when the host has a marker
MARKER_PRESENT = "FLEET-DRAINED"
#: :class:`UnlessDrained`'s first line when the host has none (the batch's answers follow)
NOT_DRAINED = "FLEET-NOT-DRAINED"


@dataclass(frozen=True)
class DrainMarker:
    """What the marker says: who drained the host (``user@control-machine``), when, why."""

    by: str
    at: float  #: seconds since the epoch; 0 when unknown
    reason: str
    rollout: str = ""  #: the journal's id of the drain on the machine that drained it
    instances: tuple[str, ...] = field(default=())  #: "vllm-0", ... (what was stopped)
    unreadable: str = ""  #: the marker exists but could not be read: why

    def to_json(self) -> str:
        return json.dumps(
            {"by": self.by, "at": self.at, "reason": self.reason, "rollout": self.rollout,
             "instances": list(self.instances)}, sort_keys=True,
        ) + "\n"  # fmt: skip

    def data(self) -> dict[str, Any]:
        """For ``--json``."""
        return {
            "by": self.by,
            "at": self.at or None,
            "at_utc": self.when() if self.at else None,
            "reason": self.reason,
            "rollout": self.rollout or None,
            "unreadable": self.unreadable or None,
        }

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at)) if self.at else "at an unknown time"

    def describe(self) -> str:
        """``drained by ops@ctl at 2026-05-01 10:00:00 UTC: disk swap``."""
        if self.unreadable:
            return f"drained (the marker {MARKER_PATH} exists but could not be read: {self.unreadable})"
        return f"drained by {self.by} at {self.when()}: {self.reason}"


def parse_marker(lines: Sequence[str]) -> DrainMarker | None:
    """The fact's output → the marker (pure); None when the host has none."""
    if not lines or lines[0].strip() != MARKER_PRESENT:
        return None
    text = "\n".join(lines[1:])
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        by, at, reason = raw.get("by"), raw.get("at"), raw.get("reason")
        if not isinstance(by, str) or not isinstance(reason, str):
            raise ValueError("no 'by' or 'reason' text")
        if isinstance(at, bool) or not isinstance(at, int | float):
            raise ValueError("no 'at' time")
        rollout, instances = raw.get("rollout"), raw.get("instances")
        listed = tuple(str(i) for i in instances) if isinstance(instances, list) else ()
        return DrainMarker(by, float(at), reason, rollout if isinstance(rollout, str) else "", listed)
    except ValueError as exc:
        why = "root could not read it (sudo -n)" if not text.strip() else f"not fleet's marker ({exc})"
        return DrainMarker("?", 0.0, "", unreadable=why)


def marker_command(path: str = MARKER_PATH) -> str:
    """As root: nothing when there is no marker, else a line saying so and the marker's text."""
    script = f"[ -e {shlex.quote(path)} ] || exit 0; echo {MARKER_PRESENT}; cat -- {shlex.quote(path)}"
    return shlex.join(["sudo", "-n", "sh", "-c", script])


class Drained(FactBase[DrainMarker | None]):
    """
    The host's drain marker (``fleet drain``), or None when the host is not drained.
    """

    @override
    def command(self, path: str = MARKER_PATH) -> str:
        return marker_command(path)

    @override
    def process(self, output: list[str]) -> DrainMarker | None:
        return parse_marker(output)


@dataclass(frozen=True)
class MarkerOrBatch:
    """:class:`UnlessDrained`'s answer: the host's marker (then nothing else ran), or, on a host
    that has none, the answers of the batch (``fleet.facts.batch.FactBatch``: index -> answer)."""

    marker: DrainMarker | None
    answers: Mapping[int, BatchAnswer] = field(default_factory=dict)


class UnlessDrained(FactBase[MarkerOrBatch | None]):
    """
    The host's drain marker and, only on a host that has none, a batch of fact commands, in one
    round trip: a drained host runs none of them (a host is often drained because a GPU is broken,
    and a broken GPU can hang NVML, so a deploy must not probe it). The marker is read as the
    :class:`Drained` fact reads it (the same command): when that command fails, so does this one,
    with its status and output (nothing else ran). None: no output.

    + commands: the facts' shell commands (``fleet.facts.batch.FactRequest.shell``)
    + path: the marker's path
    """

    @override
    def command(self, commands: Sequence[str], path: str = MARKER_PATH) -> str:
        return (
            f"m=$({marker_command(path)}); r=$?\n"
            'if [ "$r" != 0 ] || [ -n "$m" ]; then [ -z "$m" ] || printf \'%s\\n\' "$m"; exit "$r"; fi\n'
            f"echo {NOT_DRAINED}\n{FactBatch().command(commands)}"
        )

    @override
    def process(self, output: list[str]) -> MarkerOrBatch | None:
        if output and output[0] == NOT_DRAINED:
            return MarkerOrBatch(None, FactBatch().process(output[1:]))
        marker = parse_marker(output)
        return MarkerOrBatch(marker) if marker is not None else None


MarkerAnswer = DrainMarker | None | HostUnreachable


def read_marker_answers(targets: Iterable[SshTarget]) -> dict[str, MarkerAnswer]:
    """Each host's drain marker, None, or why the host could not be asked (all hosts at once)."""
    return run_fact_on_hosts(list(targets), Drained)


def read_markers(targets: Iterable[SshTarget]) -> dict[str, DrainMarker]:
    """The drain marker of every host that has one (one SSH round trip per host, all at once).

    A host that cannot be asked is not taken for drained here: the step that needs it reports it."""
    return {name: a for name, a in read_marker_answers(targets).items() if isinstance(a, DrainMarker)}


def drained_view(answers: Mapping[str, MarkerAnswer], journaled: Mapping[str, DrainMarker]) -> dict[str, DrainMarker]:
    """The hosts to take for drained (pure): those whose marker says so, and, for a host that
    cannot be asked (powered off for its maintenance, say), the journal's word: the last marker a
    drain of this journal wrote on it and no undrain removed."""
    out: dict[str, DrainMarker] = {}
    for name, answer in answers.items():
        if isinstance(answer, DrainMarker):
            out[name] = answer
        elif isinstance(answer, HostUnreachable) and name in journaled:
            seen = journaled[name]
            out[name] = replace(seen, reason=f"{seen.reason} (the host does not answer: {answer.reason}; "
                                             "the journal says it is drained)")  # fmt: skip
    return out
