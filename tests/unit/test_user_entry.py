"""The service user's fact and decision (``fleet.facts.users.UserEntry``,
``fleet.operations.vllm.user_command``): one user's entry equal to pyinfra's ``Users`` entry for
it, and the useradd/usermod argv pyinfra's ``server.user`` would yield."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from pyinfra.facts.server import Users

from fleet.facts.users import UserEntry
from fleet.operations.vllm import user_command

NOT_READ = ("lastlog", "login_time", "password")


def _run(command: str) -> list[str]:
    """A fact's command run by this machine's sh, its output as pyinfra splits it."""
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@pytest.mark.parametrize("user", ["root", "nobody", "daemon"])
def test_the_entry_is_pyinfras_users_entry_for_that_user(user: str) -> None:
    everyone = Users().process(_run(Users().command()))  # type: ignore[no-untyped-call]
    fact = UserEntry()
    mine = fact.process(_run(fact.command(user=user)))
    assert mine is not None and user in everyone
    assert {k: v for k, v in mine.items() if k not in NOT_READ} == {
        k: v for k, v in everyone[user].items() if k not in NOT_READ
    }


@pytest.mark.parametrize("user", ["no-such-user-here", "ro", "root:", ".*"])
def test_no_such_user_is_none_not_a_prefix_or_pattern_match(user: str) -> None:
    fact = UserEntry()
    output = _run(fact.command(user=user))
    assert output == [] and fact.default() is None


HOME, SHELL = "/var/lib/vllm", "/usr/sbin/nologin"
GOOD = {"home": HOME, "shell": SHELL, "group": "vllm", "groups": []}


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        (None, ["useradd", "-d", HOME, "-s", SHELL, "-g", "vllm", "-r", "-m", "vllm"]),
        (GOOD, []),
        ({**GOOD, "groups": ["video"]}, []),  # secondary groups are not the operation's (as server.user)
        ({**GOOD, "shell": "/bin/bash"}, ["usermod", "-s", SHELL, "vllm"]),
        ({**GOOD, "home": "/home/vllm"}, ["usermod", "-d", HOME, "vllm"]),
        ({**GOOD, "group": "nogroup"}, ["usermod", "-g", "vllm", "vllm"]),
        (
            {"home": None, "shell": None, "group": "users", "groups": []},
            ["usermod", "-d", HOME, "-s", SHELL, "-g", "vllm", "vllm"],
        ),
    ],
)
def test_user_command(existing: dict[str, Any] | None, expected: list[str]) -> None:
    assert user_command(existing, "vllm", HOME, SHELL) == expected
