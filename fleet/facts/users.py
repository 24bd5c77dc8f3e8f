"""One user's entry, as pyinfra's ``Users`` fact gives it, without reading every user.

pyinfra 3.10's ``pyinfra.facts.server.Users`` runs, for every line of ``/etc/passwd``, ``grep``,
``lastlog``, ``grep`` on the shadow file and ``id`` twice: on a Debian host with 25 users about
0.4 s of the 0.7 s of a no-change deploy's whole fact batch on a lab host (measured on the 2-core
development machine). ``fleet deploy`` needs one user, its service user: :class:`UserEntry` runs
the same commands for that one name (no ``lastlog``, no password: the service user's operation
reads neither) and processes the line with ``Users``' own parser, so the entry is the one
``Users`` would give for it (``tests/unit/test_user_entry.py`` checks both on the same line).
"""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api.facts import FactBase
from pyinfra.facts.server import Users
from typing_extensions import override


class UserEntry(FactBase[dict[str, Any] | None]):
    """
    ``Users()[user]``: home, comment, shell, group, groups, uid, gid (``lastlog``, ``login_time``
    None and ``password`` empty: not read), or None when there is no such user.

    + user: the user's name
    """

    _user = ""

    @override
    def command(self, user: str) -> str:
        self._user = user
        name = shlex.quote(user)
        # /etc/passwd, as Users reads it (its `grep ^NAME:`), the name compared as a string
        return (
            f"ENTRY=$(awk -F: -v u={name} '$1 == u {{ print; exit }}' /etc/passwd); "
            f'[ -n "$ENTRY" ] || exit 0; echo "$ENTRY|$(id -gn {name})|$(id -Gn {name})||"'
        )

    @staticmethod
    @override
    def default() -> None:
        return None

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        entry: dict[str, Any] | None = Users().process(output).get(self._user)  # type: ignore[no-untyped-call]
        return entry
