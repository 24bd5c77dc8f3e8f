"""``fleet gpu clear`` in fleet's own journal: who cleared which GPU of which host, when and why,
in the same place as the rollouts (``fleet history``, ``fleet history ID``).

A clear is journaled as an entry of kind ``gpu-clear`` with one step, ``gpu:cleared`` (the host
as its instance, what was cleared, by whom and why as its detail), the way a rollout journals
each step: written durably **before** the host is written, its outcome after. The journal is
opened (created, checked) before the host is read, so a journal that cannot be written stops
the clear before anything changes on the host; a refused clear (no such GPU, not quarantined, a
record that cannot be used) journals nothing. Until the host's answer is recorded the entry is
``halted`` with why, so a control machine that dies mid-way leaves an entry that says to look
at the host, never a ``running`` one ``fleet rollout --resume`` would pick up. The fleet's
rollout lock is not taken: a clear changes no instance, and the quarantine is read again by the
next plan, deploy or rollout. Nothing secret is in it: ``--why`` is refused when it looks like
a secret (``fleet.inventory.schema.drain_reason``), and the detail is redacted all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fleet.errors import FleetError
from fleet.facts.runner import SshTarget
from fleet.gpuwatch.clear import read_clear, write_clear
from fleet.inventory.policy import RolloutPolicy
from fleet.rollout.engine import RolloutStatus, new_rollout
from fleet.rollout.journal import JournalLocation, new_rollout_id
from fleet.rollout.journals import open_journal
from fleet.secrets import redact

#: The journal entry's kind and its one step's name (``fleet history``, ``fleet history ID``).
KIND = "gpu-clear"
STEP = "gpu:cleared"
NOT_CONFIRMED = (
    "the host's answer was not recorded (fleet stopped before it came): its clears.json says whether the "
    "clear was written (fleet gpu clear again is refused, not quarantined, when it was)"
)


#: reads the host's record and decides: (the new clears.json, what is cleared) (``read_clear``)
Read = Callable[[SshTarget, int, str, str, float], tuple[dict[str, Any], str]]
#: writes the decision on the host (``write_clear``)
Write = Callable[[SshTarget, dict[str, Any], str], None]


@dataclass(frozen=True)
class JournaledClear:
    rollout_id: str  #: the journal entry (``fleet history ID``)
    text: str  #: what was cleared, by whom and why


def clear_journaled(
    fleet: str,
    target: SshTarget,
    gpu: int,
    by: str,
    why: str,
    *,
    journal_path: str | Path | JournalLocation | None = None,
    now: float | None = None,
    read: Read = read_clear,
    write: Write = write_clear,
) -> JournaledClear:
    """Lift GPU ``gpu``'s quarantine on ``target`` and journal it for ``fleet`` (the inventory's
    absolute path, the name rollouts journal it by).

    Raises ``JournalError`` before the host is read when the journal cannot be opened;
    ``ClearRefused`` (bad input: nothing written anywhere) or ``FleetError`` when the host's
    record cannot be used or the host could not be reached or written (then the journal entry is
    ``halted`` with why). ``read``/``write``: how the host is read and written (over SSH)."""
    now = time.time() if now is None else now
    with open_journal(journal_path, write=True) as journal:
        clears, text = read(target, gpu, by, why, now)
        detail = redact(f"host {target.name}: {text}")
        state = replace(
            new_rollout(new_rollout_id(now), fleet, KIND, [], RolloutPolicy(), now),
            status=RolloutStatus.HALTED,
            reason=NOT_CONFIRMED,
        )
        journal.begin(state)
        seq = journal.note(state, STEP, detail, now, target.name)
        try:
            write(target, clears, text)
        except FleetError as exc:
            failed = replace(state, reason=redact(f"the clear was not written: {exc}"))
            journal.outcome(seq, failed, False, redact(str(exc)), time.time())
            raise
        journal.outcome(seq, replace(state, status=RolloutStatus.DONE, reason=detail), True, "cleared", time.time())
    return JournaledClear(state.id, text)
