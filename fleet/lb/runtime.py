"""HAProxy's runtime API over its admin socket, as pure functions: the commands and their answers.

From HAProxy's management guide (``doc/management.txt``, 2.6, section 9.3 "Unix Socket commands"):

* non-interactive mode: one line is sent, the answers come back and HAProxy closes the
  connection; several commands on one line are separated by ``;``, and each command's output
  ends with an empty line, "so that the reader knows the output has not been truncated";
* ``set server <backend>/<server> state [ ready | drain | maint ]``: ``drain`` "only removes the
  server from load balancing but still allows it to be checked", ``maint`` also stops its checks,
  ``ready`` is normal mode (the same as ``enable server``). It answers nothing when it worked, and
  a sentence when not (``No such backend.``, ``No such server.``);
* ``show servers state [<backend>]``: a format version line (``1``), a ``#`` header, then one
  line per server, space-separated: ``srv_op_state`` (0 stopped, 1 starting, 2 running,
  3 stopping) and ``srv_admin_state``, a mask (0x01 forced maintenance, 0x02 inherited, 0x04
  from the configuration's ``disabled``, 0x08 forced drain, 0x10 inherited drain, 0x20 address
  resolution, 0x40 FQDN set on the socket);
* ``show stat``: CSV (section 9.1) with a ``# pxname,svname,...`` header; per server ``scur``
  (current sessions), ``qcur`` (queued requests) and ``status`` (``UP``, ``DOWN``, ``DRAIN``,
  ``MAINT``, ``no check``, with ``" 1/3"`` while a check is rising or falling). Fields are read by
  name (only the static fields' order is fixed) with Python's ``csv`` module, which handles
  HAProxy's quoting (a field with a comma or quote is quoted, a quote doubled).

A server's administrative state, as fleet names it, is what the mask says (maintenance wins over
drain, anything else is ready); its view for people (``UP``/``DRAIN``/``MAINT``/``DOWN``) is what
``show stat`` says, without the transition counter.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from enum import StrEnum

from fleet.errors import FleetError

#: ``srv_admin_state`` bits (HAProxy ``include/haproxy/server-t.h``, ``enum srv_admin``).
ADMF_FMAINT, ADMF_IMAINT, ADMF_CMAINT, ADMF_FDRAIN, ADMF_IDRAIN, ADMF_RMAINT, ADMF_HMAINT = (
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40,
)  # fmt: skip
_MAINT = ADMF_FMAINT | ADMF_IMAINT | ADMF_RMAINT | ADMF_HMAINT
_DRAIN = ADMF_FDRAIN | ADMF_IDRAIN
#: ``srv_op_state`` values (``enum srv_state``).
OP_STATES = {0: "stopped", 1: "starting", 2: "running", 3: "stopping"}


class AdminState(StrEnum):
    """The administrative state fleet sets (``set server ... state``)."""

    READY = "ready"
    DRAIN = "drain"
    MAINT = "maint"


class AnswerError(FleetError):
    """HAProxy answered a command with an error (a backend or server it does not have, a bad state)."""


@dataclass(frozen=True)
class ServerState:
    """One line of ``show servers state``."""

    backend: str
    server: str
    address: str
    op_state: int
    admin_mask: int
    port: int = 0  #: srv_port (0 when the line has none)

    @property
    def admin(self) -> AdminState:
        # a server written ``disabled`` keeps bit 0x04 after ``set server ... state ready``: that bit
        # alone says "the configuration said disabled", not "in maintenance now"
        if self.admin_mask & _MAINT:
            return AdminState.MAINT
        if self.admin_mask & _DRAIN:
            return AdminState.DRAIN
        return AdminState.READY


@dataclass(frozen=True)
class ServerStat:
    """The fields of one server's ``show stat`` line that fleet reads."""

    backend: str
    server: str
    status: str  #: "UP", "DOWN", "DRAIN", "MAINT", "no check", "UP 1/3", ...
    sessions: int  #: scur
    queued: int  #: qcur
    check: str  #: check_status ("L7OK", "L4CON", ...; "" when not checked)


@dataclass(frozen=True)
class ServerView:
    """A server as the balancer sees it now: what fleet decides on and shows."""

    backend: str
    server: str
    admin: AdminState
    status: str
    sessions: int
    queued: int
    check: str = ""

    @property
    def view(self) -> str:
        """UP, DRAIN, MAINT or DOWN (and HAProxy's other words, as it says them), no transition counter."""
        word = self.status.split(" ", 1)[0].upper() if self.status else "?"
        return {"NOLB": "DRAIN", "NO": "UP"}.get(word, word)  # "no check": up, unchecked

    @property
    def in_traffic(self) -> bool:
        return self.admin is AdminState.READY

    @property
    def busy(self) -> int:
        """Sessions on it plus requests queued for it: what must reach 0 before it is stopped."""
        return self.sessions + self.queued

    def describe(self) -> str:
        return f"{self.view} ({self.admin.value}), {self.sessions} session(s), {self.queued} queued"


def _check_name(kind: str, name: str) -> str:
    # fleet's names are validated at the inventory (``schema.HAPROXY_NAME_RULE``); this is the last
    # guard against a name that would end the command (``;``, a line break, a backslash, a space)
    if not name or any(c in name for c in "; \\\n\r\t/#"):
        raise ValueError(f"{kind} name {name!r} cannot be sent to HAProxy's admin socket")
    return name


def set_state_command(backend: str, server: str, state: AdminState) -> str:
    """``set server B/S state X`` (management guide 9.3)."""
    return f"set server {_check_name('backend', backend)}/{_check_name('server', server)} state {state.value}"


#: Both reads in one line (one connection, one consistent moment): the admin states, then the stats.
SNAPSHOT_COMMAND = "show servers state;show stat"


def split_answers(text: str, count: int) -> list[str]:
    """The answers to ``count`` commands sent on one line; each ends with an empty line.

    Raises ``AnswerError`` when fewer complete answers came (the output was cut short)."""
    blocks: list[str] = []
    current: list[str] = []
    for line in text.split("\n"):
        if line == "":
            blocks.append("\n".join(current))
            current = []
            if len(blocks) == count:
                break
        else:
            current.append(line)
    if len(blocks) < count:
        raise AnswerError(f"HAProxy's answer was cut short ({len(blocks)} of {count} answers complete)")
    return blocks


def parse_servers_state(text: str) -> list[ServerState]:
    """``show servers state`` → one ``ServerState`` per server (format version 1)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    if lines[0].strip() != "1":
        message = lines[0].strip()
        raise AnswerError(f"`show servers state`: {message}" if not message.isdigit() else
                            f"`show servers state`: format version {message}, fleet reads version 1")  # fmt: skip
    header: list[str] = []
    out = []
    for line in lines[1:]:
        if line.startswith("#"):
            header = line.lstrip("#").split()
            continue
        fields = line.split()
        row = dict(zip(header, fields, strict=False))
        try:
            out.append(
                ServerState(
                    row["be_name"], row["srv_name"], row.get("srv_addr", ""), int(row["srv_op_state"]),
                    int(row["srv_admin_state"]), _int(row.get("srv_port")),
                )
            )  # fmt: skip
        except (KeyError, ValueError) as exc:
            raise AnswerError(f"`show servers state`: a line fleet cannot read ({exc}): {line[:200]}") from exc
    return out


def _int(value: str | None) -> int:
    return int(value) if value and value.strip().lstrip("-").isdigit() else 0


def parse_stat(text: str) -> list[ServerStat]:
    """``show stat`` CSV → the server lines (not FRONTEND/BACKEND), read by field name."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("# "):
        raise AnswerError(f"`show stat`: no CSV header in the answer: {(lines[0] if lines else '')[:200]!r}")
    reader = csv.DictReader([lines[0][2:], *lines[1:]])
    out = []
    for row in reader:
        # type 2 is a server (management guide 9.1, field 32); listeners (3) and proxies are not
        if row.get("type") != "2":
            continue
        out.append(
            ServerStat(
                row.get("pxname") or "", row.get("svname") or "", row.get("status") or "",
                _int(row.get("scur")), _int(row.get("qcur")), (row.get("check_status") or "").strip("* "),
            )
        )  # fmt: skip
    return out


def parse_snapshot(text: str) -> dict[tuple[str, str], ServerView]:
    """The answer to ``SNAPSHOT_COMMAND`` → every server's view, by (backend, server)."""
    states_text, stat_text = split_answers(text, 2)
    states = {(s.backend, s.server): s for s in parse_servers_state(states_text)}
    stats = {(s.backend, s.server): s for s in parse_stat(stat_text)}
    out = {}
    for key, st in states.items():
        stat = stats.get(key)
        out[key] = ServerView(
            st.backend, st.server, st.admin, stat.status if stat else OP_STATES.get(st.op_state, "?").upper(),
            stat.sessions if stat else 0, stat.queued if stat else 0, stat.check if stat else "",
        )  # fmt: skip
    return out


def check_set_answer(command: str, answer: str) -> None:
    """``set server`` answers nothing (an empty line) when it worked; anything else is why not."""
    text = answer.strip()
    if text:
        raise AnswerError(f"HAProxy refused `{command}`: {text}")
