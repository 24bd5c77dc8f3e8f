"""Restart hosts that are already serving, one at a time, until the rolling engine takes over.

A host whose units, env files or release changed while it was serving is restarted only after
the previous one serves again (``/health``, ``/v1/models``, a 1-token completion): never two
hosts down at once. The first failure stops the sequence and says how to resume.

``restart_serving_hosts`` is the one call site ``fleet.deploy.runner`` uses, so the rollout
engine (``fleet rollout``) can replace it without touching the rest of the deploy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import paramiko

from fleet.deploy.health import Endpoint, wait_healthy
from fleet.facts.runner import SshTarget, run_command
from fleet.render.escape import ssh_command
from fleet.secrets import redact

Step = Callable[[str, str], None]  #: (host, what it is doing now)


@dataclass
class RestartStep:
    host: str
    target: SshTarget
    units: list[str]
    endpoints: list[Endpoint]
    api_key: str | None


@dataclass
class RestartOutcome:
    done: list[str] = field(default_factory=list)  #: hosts restarted and serving, in order
    failed: str | None = None  #: the host that stopped the sequence
    error: str | None = None
    not_started: list[str] = field(default_factory=list)  #: hosts left on their old units
    timeline: list[tuple[str, str, float]] = field(default_factory=list)  #: (host, "down"/"up", time)


def restart_command(units: Sequence[str]) -> str:
    return ssh_command(["sudo", "-n", "systemctl", "restart", "--", *units])


def restart_serving_hosts(
    steps: Sequence[RestartStep], timeout: float, resume_hint: str, step: Step = lambda _h, _s: None
) -> RestartOutcome:
    """Restart ``steps`` one host at a time (see the module docstring)."""
    out = RestartOutcome()
    for i, s in enumerate(steps):
        step(s.host, "restarting " + ", ".join(s.units))
        command = restart_command(s.units)
        out.timeline.append((s.host, "down", time.time()))
        try:
            rc, _stdout, stderr = run_command(s.target, command, timeout=max(60.0, timeout))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            rc, stderr = -1, f"SSH: {exc}"
        if rc == 0:
            step(s.host, "waiting until it serves")
            wait_healthy(s.endpoints, s.api_key, timeout)
            bad = [e for e in s.endpoints if not e.healthy]
            if not bad:
                out.timeline.append((s.host, "up", time.time()))
                out.done.append(s.host)
                step(s.host, "serving")
                continue
            error = "; ".join(f"{e.unit}: {e.detail}" for e in bad)
        else:
            error = f"`{command}` exited {rc}: {redact(stderr.strip()[-300:])}"
        out.failed = s.host
        out.not_started = [x.host for x in steps[i + 1 :]]
        out.error = (
            f"host {s.host}: restart failed: {error}; hosts not restarted yet: "
            f"{', '.join(out.not_started) or 'none'}. Fix the host, then resume with: {resume_hint}"
        )
        step(s.host, "restart failed")
        break
    return out
