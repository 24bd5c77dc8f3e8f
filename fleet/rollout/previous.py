"""Where ``fleet rollback`` sends each instance: the release (and configuration) *it* ran before.

Pure. The journal records, per instance of every rollout, what it ran before the rollout changed
anything (``InstanceState.previous_release``, ``previous_revision``, ``previous_model``: read from
the instance itself, its process's interpreter, not from its host's links). That is each
instance's own previous release. The host's ``previous`` link cannot stand in for it: it is one
per host, flipped by whichever instance switched last, so after a canary or a halted rollout it
names a release some instances never ran, or the one that just crashed (issue: a rollback "back"
onto the failed release).

* ``fleet rollback ID``: every instance that rollout changed goes back to what it ran before it
  (:func:`back_to`).
* ``fleet rollback INVENTORY``: each instance goes back to what it ran before the newest rollout
  of the fleet that changed it (:func:`last_changes`). A rollout *changed* an instance when it
  stopped it (``changed``) and did not return it itself (not ``rolled_back``); rollbacks and
  restarts are not changes to undo (so a second ``fleet rollback`` finds the instance already
  where the first sent it: a no-op, not a flip back onto the release it left). An instance no
  rollout changed is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fleet.rollout.batches import InstanceRef
from fleet.rollout.engine import InstanceState, Phase, RolloutState, RolloutStatus, Target

#: the rollout kinds whose changes a rollback undoes
CHANGES = ("rollout",)


def changed(inst: InstanceState) -> bool:
    """The rollout changed this instance and left it changed (something to go back from)."""
    return inst.changed and inst.phase is not Phase.ROLLED_BACK and inst.previous_release is not None


def back_to(inst: InstanceState) -> Target:
    """The target that puts ``inst`` back on what it ran before its rollout: release, model and,
    when that rollout switched configuration revisions, the revision that was live."""
    return Target(
        inst.ref,
        str(inst.previous_release),
        inst.previous_model or inst.target.model,
        inst.target.port,
        revision=inst.previous_revision if inst.target.revision else None,
        adapters=inst.previous_adapters,
    )


def last_changes(rollouts: Iterable[RolloutState]) -> dict[InstanceRef, InstanceState]:
    """Per instance, its state in the newest of ``rollouts`` (given newest first) that changed it.

    Raises ``ValueError`` naming an unfinished rollout among them: what it changed is not known
    until it is resumed or rolled back by its ID."""
    out: dict[InstanceRef, InstanceState] = {}
    for state in rollouts:
        if state.status is RolloutStatus.RUNNING:
            raise ValueError(state.id)
        if state.kind not in CHANGES:
            continue
        for ref, inst in state.instances.items():
            if ref not in out and changed(inst):
                out[ref] = inst
    return out


def rollback_targets(
    changes: Mapping[InstanceRef, InstanceState], instances: Iterable[InstanceRef]
) -> tuple[list[Target], list[InstanceRef]]:
    """(the targets for ``instances`` that a rollout changed, in ``instances``' order; the
    instances no rollout changed, which stay as they are)."""
    targets: list[Target] = []
    untouched: list[InstanceRef] = []
    for ref in instances:
        inst = changes.get(ref)
        if inst is None:
            untouched.append(ref)
        else:
            targets.append(back_to(inst))
    return targets, untouched
