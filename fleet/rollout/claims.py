"""Hosts that know who is rolling them: a claim file on each host of a rollout.

Before a rollout changes anything, it records on every one of its hosts who is rolling it: the
rollout id, the control machine, the user, the pid and a lease, in a root-only file under
fleet's state directory on the host (``/var/lib/fleet/rollout-claim``, written atomically: a
temporary file renamed over it, under ``flock`` so two rollouts claiming at once cannot both
win). A rollout from any machine and any journal that finds a live claim by another rollout
refuses to touch that host and names the owner: two journals cannot fight over an instance even
without the shared journal.

* the lease is judged by the host's own clock (the claim holds the host time it runs out), so
  control machines with different clocks agree;
* a rollout renews its claims every ``RENEW_S`` while it runs (a thread beside the runner) and
  clears them when its process stops acting on the hosts (done, halted, stopped or interrupted);
  a process that dies leaves claims that expire with their lease (``LEASE_S``);
* a claim by the same rollout id is this rollout's own: ``fleet rollout --resume ID
  --take-over`` takes the claims of the rollout it resumes, from any machine;
* a claim found lost while the rollout runs (another rollout took the host after this one's
  lease ran out) is an observation: the executor reports the host as claimed
  (``InstanceFacts.claimed_by``) and the engine fails that host's instances without touching it.

The parsing and the verdicts are pure; ``HostClaims`` does the I/O through the executor.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from fleet.errors import FleetError
from fleet.rollout.errors import LockHeld
from fleet.rollout.journal import pid_start

#: fleet's state directory on a host, and the claim in it (root only: 0700 / 0600).
STATE_DIR = "/var/lib/fleet"
CLAIM_FILE = "rollout-claim"
#: Seconds a claim lives without being renewed; how often a running rollout renews it.
LEASE_S = 120
RENEW_S = 30.0

_SAFE = re.compile(r"[^A-Za-z0-9._@:+-]")


def safe_word(text: str, limit: int = 128) -> str:
    """A value as it may be written in the claim file: one line, no shell or file syntax."""
    return _SAFE.sub("_", text)[:limit] or "-"


@dataclass(frozen=True)
class ClaimRequest:
    """Who is claiming: what this rollout writes on its hosts."""

    rollout_id: str
    machine: str
    user: str
    pid: int
    lease_s: int = LEASE_S
    pid_start: str = ""  #: the pid's start time (``/proc/PID/stat``), so a reused pid is not the owner

    @classmethod
    def mine(cls, rollout_id: str, lease_s: int = LEASE_S) -> ClaimRequest:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        me = os.getpid()
        return cls(
            safe_word(rollout_id), safe_word(socket.gethostname()), safe_word(user), me, lease_s, pid_start(me) or "-"
        )


@dataclass(frozen=True)
class HostClaim:
    """A claim as read from a host."""

    rollout_id: str
    machine: str
    user: str
    pid: int
    since: int  #: host clock, seconds
    lease_until: int  #: host clock, seconds
    host_now: int  #: the host's clock when it was read
    pid_start: str = ""

    def owner_gone(self) -> bool:
        """Its owner ran on this machine and that process is gone (pid and start time, as the
        journal's lock tells): its claim is stale before its lease runs out."""
        if self.machine != safe_word(socket.gethostname()) or not self.pid_start or self.pid_start == "-":
            return False
        return pid_start(self.pid) != self.pid_start

    def describe(self) -> str:
        left = self.lease_until - self.host_now
        lease = f"its lease runs {left}s more" if left > 0 else f"its lease ran out {-left}s ago"
        return f"rollout {self.rollout_id} by {self.user}@{self.machine} (pid {self.pid}), {lease}"


Verdict = Literal["claimed", "held", "lost", "released"]


@dataclass(frozen=True)
class ClaimAnswer:
    """What the host said: ``claimed`` (it is ours now), ``held`` (a live claim by another rollout),
    ``lost`` (renewing found another rollout's claim in place of ours), ``released``."""

    verdict: Verdict
    holder: HostClaim | None = None


def parse_answer(text: str) -> ClaimAnswer:
    """The claim script's output: a verdict line, then the holder's ``key=value`` lines."""
    lines = text.strip().splitlines()
    verdict = lines[0].strip() if lines else ""
    if verdict not in ("claimed", "held", "lost", "released"):
        raise ValueError(f"unexpected answer from the claim script: {text.strip()[:200]!r}")
    values = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    holder = None
    if "rollout" in values:

        def num(key: str) -> int:
            try:
                return int(values.get(key, "0"))
            except ValueError:
                return 0

        holder = HostClaim(
            values["rollout"], values.get("machine", "?"), values.get("user", "?"), num("pid"), num("since"),
            num("lease_until"), num("now"), values.get("pid_start", ""),
        )  # fmt: skip
    return ClaimAnswer(verdict, holder)  # type: ignore[arg-type]


def claim_script() -> str:
    """The host side (POSIX sh, coreutils, util-linux ``flock``): argv is ``dir mode id machine user
    pid lease pid_start stale``; ``mode`` is claim, renew or release; ``stale``: a rollout id whose
    claim may be replaced though its lease lives (its owner is known gone). Prints the verdict and
    the claim in place."""
    return (
        'set -e; umask 077; d=$1; mode=$2; id=$3; f="$d/' + CLAIM_FILE + '"; '
        'mkdir -p "$d"; chmod 700 "$d"; exec 9>"$d/.claim.lock"; flock -w 20 9; now=$(date +%s); '
        'cur=; until=0; if [ -f "$f" ]; then cur=$(sed -n "s/^rollout=//p" "$f"); '
        'until=$(sed -n "s/^lease_until=//p" "$f"); fi; '
        'show() { echo "$1"; if [ -f "$f" ]; then cat "$f"; fi; echo "now=$now"; exit 0; }; '
        'if [ -n "$cur" ] && [ "$cur" != "$id" ] && [ "$cur" != "$9" ]; then '
        '  if [ "$mode" = renew ]; then show lost; fi; '
        '  if [ "$mode" = release ]; then show released; fi; '
        '  if [ "${until:-0}" -gt "$now" ] 2>/dev/null; then show held; fi; fi; '
        'if [ "$mode" = release ]; then rm -f "$f"; echo released; echo "now=$now"; exit 0; fi; '
        'since=$now; if [ "$cur" = "$id" ]; then since=$(sed -n "s/^since=//p" "$f"); fi; '
        't=$(mktemp "$d/.claim.XXXXXX"); '
        'printf "rollout=%s\\nmachine=%s\\nuser=%s\\npid=%s\\npid_start=%s\\nsince=%s\\nlease_until=%s\\n" '
        '"$id" "$4" "$5" "$6" "$8" "${since:-$now}" "$((now + $7))" > "$t"; chmod 600 "$t"; mv -f "$t" "$f"; '
        "show claimed"
    )


class HostClaimed(LockHeld):
    """Hosts of this rollout are being rolled by another rollout (the owners named)."""


def refusal(held: Mapping[str, HostClaim]) -> str:
    """Why the rollout does not start, naming each host's owner and the ways out."""
    lines = [f"host {h} is being rolled by {c.describe()}" for h, c in sorted(held.items())]
    first = next(iter(sorted(held.items())))[1]
    lines.append(
        "nothing was touched. Wait for that rollout to end; if its control machine is gone, its claims end "
        f"with their lease ({LEASE_S}s without renewal), or resume it where its journal is: "
        f"fleet rollout --resume {first.rollout_id} --take-over"
    )
    return "\n".join(lines)


#: One host's claim operation: (host, mode, stale rollout id or "") → the host's answer; raises on SSH failure.
ClaimOp = Callable[[str, str, str], ClaimAnswer]


@dataclass
class HostClaims:
    """The claims of one rollout on its hosts: taken before anything is changed (``take``),
    renewed every ``renew_s`` by a thread while the rollout runs, released at the end (``release``).

    A host that cannot be reached when claiming is claimed by the renewals once it answers; the
    engine sees it unreachable meanwhile. ``lost_on(host)`` says who took a host from this rollout.
    """

    op: ClaimOp
    hosts: tuple[str, ...]
    renew_s: float = RENEW_S
    claimed: set[str] = field(default_factory=set)
    lost: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def take(self) -> None:
        """Claim every host; on a live claim by another rollout, release ours and raise ``HostClaimed``."""
        held: dict[str, HostClaim] = {}
        for host, answer in self._each(self.hosts, "claim"):
            if answer is not None and answer.verdict == "held" and answer.holder and answer.holder.owner_gone():
                answer = self._one(host, "claim", answer.holder.rollout_id)  # a dead process's claim on this machine
            if answer is None:
                continue  # unreachable now: the renewals claim it when it answers
            if answer.verdict == "claimed":
                self.claimed.add(host)
            elif answer.holder is not None:
                held[host] = answer.holder
        if held:
            self.release()
            raise HostClaimed(refusal(held), held)
        self._thread = threading.Thread(target=self._renew_loop, name="fleet-claims", daemon=True)
        self._thread.start()

    def lost_on(self, host: str) -> str:
        return self.lost.get(host, "")

    def renew(self) -> None:
        """One round: renew what is ours, claim what could not be reached before."""
        todo = [h for h in self.hosts if h not in self.lost]
        for host, answer in self._each(todo, "renew"):
            if answer is None:
                continue
            if answer.verdict == "claimed":
                self.claimed.add(host)
            elif answer.holder is not None:
                self.lost[host] = answer.holder.describe()
                self.claimed.discard(host)

    def release(self) -> None:
        """Stop renewing and clear this rollout's claims (a host that does not answer keeps a claim
        that runs out with its lease)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for host, _answer in self._each(sorted(self.claimed), "release"):
            self.claimed.discard(host)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            self.renew()

    def _each(self, hosts: Iterable[str], mode: str) -> list[tuple[str, ClaimAnswer | None]]:
        return [(host, self._one(host, mode)) for host in hosts]

    def _one(self, host: str, mode: str, stale: str = "") -> ClaimAnswer | None:
        try:
            return self.op(host, mode, stale)
        except FleetError:  # the host cannot be reached (the executor's error): the lease decides
            return None

    def __enter__(self) -> HostClaims:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
