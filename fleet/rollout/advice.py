"""What the on-call does next after a rollout, in words and commands."""

from __future__ import annotations

from fleet.rollout.engine import InstanceState, Phase, RolloutState, RolloutStatus, left_midway, midway_words

#: Phases in which an instance fleet stopped is serving again (or never stopped).
BACK = (Phase.DONE, Phase.ROLLED_BACK)


def left_down(state: RolloutState) -> list[InstanceState]:
    """Instances this rollout stopped that are not back in service: stopped (or a stop was sent),
    not yet started, started but not through their gates, or failed. A stop journaled but cut
    short by an abort counts: the engine marks an instance ``changed`` before its stop is sent.
    (``engine.left_midway``: every instance between its first step and its end, stopped or not.)"""
    return [i for i in state.instances.values() if i.changed and i.phase not in BACK]


def _down_line(i: InstanceState) -> str:
    why = i.rollback_failure or i.failure or f"its last step: {i.phase.value}"
    return f"{i.ref} is not serving: this rollout stopped it and it is not back ({why})"


def out_of_traffic(state: RolloutState) -> list[str]:
    """Instances this rollout took out of their load balancer's traffic and did not put back, and
    the command that puts each back (once it is checked to serve)."""
    if state.kind == "drain":
        return []
    left = [i for i in state.instances.values() if i.lb_out]
    if not left:
        return []
    refs = " ".join(str(i.ref) for i in left)
    return [
        f"out of traffic on its load balancer: {', '.join(str(i.ref) for i in left)}; once each serves "
        f"(fleet status), put it back: fleet lb ready {state.fleet} {refs}"
    ]


def next_steps(state: RolloutState) -> list[str]:
    """What the on-call does next, in words and commands."""
    if state.status is RolloutStatus.RUNNING:
        out = [f"interrupted: {state.reason}"] if state.reason else []
        out += [f"{i.ref} was left mid-way: {midway_words(i)}" for i in left_midway(state)]
        midway = {i.ref for i in left_midway(state)}
        out += [_down_line(i) for i in left_down(state) if i.ref not in midway]
        out.append(f"stopped between steps; resume with: fleet rollout --resume {state.id}")
        return out
    hosts = " ".join(sorted({r.host for r in state.instances}))
    if state.kind == "drain":
        if state.status is RolloutStatus.DONE:
            return [
                f"drained: every instance of {hosts} is out of traffic and stopped, its units disabled; each host is "
                f"marked drained, so rollouts, restarts and deploys skip it. Back into service: fleet undrain "
                f"{state.fleet} {hosts}",
                f"`fleet history {state.id}` lists every step",
            ]
        return [
            f"halted: {state.reason}",
            f"`fleet history {state.id}` lists every step and its outcome",
            f"{hosts} stay marked drained where the marker was written (rollouts skip them); run `fleet drain` again "
            f"to finish, or `fleet undrain {state.fleet} {hosts}` to put them back",
        ]
    if state.kind == "undrain" and state.status is RolloutStatus.DONE:
        return [f"{hosts}: every instance serves and is back in traffic; the drain markers are removed",
                f"`fleet history {state.id}` lists every step"]  # fmt: skip
    if state.status is RolloutStatus.DONE:
        out = [f"every instance is healthy; `fleet history {state.id}` lists every step"]
        if state.kind == "rollout":
            out.append(f"to undo it: fleet rollback {state.id}")
        return out
    out = [f"halted: {state.reason}", f"`fleet history {state.id}` lists every step and its outcome"]
    if state.kind == "undrain":
        out.append(f"a host whose instances are not all serving stays marked drained; fix the cause, then `fleet "
                   f"undrain {state.fleet} {hosts}` again")  # fmt: skip
    out += out_of_traffic(state)
    stuck = [i for i in state.instances.values() if i.rollback_failure]
    for i in stuck:
        if i.rollback_failure.startswith("load balancer not reachable") and i.lb_out:
            continue  # named above, with the command that puts it back
        if "host unreachable" in i.rollback_failure:
            out.append(
                f"{i.ref} is not serving: host {i.ref.host} cannot be reached ({i.rollback_failure}). Bring "
                f"{i.ref.host} back (its units start at boot on the release its `current` link names), then run "
                f"the rollout again, or `fleet rollback {state.id}`"
            )
            continue
        out.append(
            f"{i.ref} is not serving ({i.rollback_failure}): check `journalctl -u fleet-{i.ref.instance}.service` "
            f"on {i.ref.host}, then `fleet rollback {state.id}` to try the previous release again"
        )
    for i in left_down(state):
        if i.rollback_failure:
            continue  # said above
        line = _down_line(i)
        if "unreachable" in i.failure:
            line += f". Bring {i.ref.host} back, then run the {state.kind} again (`--limit {i.ref.host}`)"
        out.append(line)
    skipped = [i for i in state.instances.values() if i.phase is Phase.SKIPPED]
    for host in sorted({i.ref.host for i in skipped}):
        names = ", ".join(str(i.ref) for i in skipped if i.ref.host == host)
        out.append(
            f"not touched, host {host} did not answer: {names}; once it does, run the {state.kind} again "
            f"for it (`--limit {host}`)"
        )
    if not stuck and any(i.rolling_back for i in state.instances.values()):
        out.append(
            "the failed batch is back on the release it ran before; later batches were not touched. Fix the cause "
            "(the failure above), then run it again"
        )
    return out
