"""The test run's network guard: tests reach loopback (127.0.0.0/8, ::1) and nothing else.

Two layers, both on for every test:

* in-process, pytest-socket (``--allow-hosts``, set in pyproject.toml's addopts): a
  ``socket.connect`` to anything outside loopback raises ``SocketConnectBlockedError`` at the
  call, in the test's own traceback;
* for what tests run as subprocesses (``fleet``, ssh, pip, Ansible, curl, Chromium), which
  in-process patching cannot see: this pytest process is moved into a cgroup of its own that an
  nftables table matches (``fleetlab/netguard.py``); every other destination is refused at
  once and recorded, and a test during which anything was refused fails (at its teardown), with
  the destinations. What the table lets through beyond loopback (this machine's own package
  sources, which the lab needs on a cold cache) is printed in the pytest header.

Without root, nftables or cgroup v2 the second layer cannot go up; the header says so and the
tests run with the in-process guard only. The table and the cgroup go away at the end of the
session, whatever happened.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType

import pytest

from fleetlab import netguard
from tests import scheduling

_GUARD = pytest.StashKey[netguard.Guard]()
_WHY_NOT = pytest.StashKey[str]()


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a CI timeout, ``kill``) ends the session like Ctrl-C: fixtures tear down (the
    labs go down) and the guard's table and cgroup are removed, instead of dying on the spot."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    try:
        config.stash[_GUARD] = netguard.up(*netguard.machine_allowances())
    except netguard.GuardUnavailable as exc:
        config.stash[_WHY_NOT] = str(exc)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


GEVENT_PATCHED = (
    "the interpreter is gevent-patched (pyinfra_cli, imported in the test process, does it on import): threads "
    "become greenlets, and with pytest-socket's per-test restore of socket.socket a server thread's accept() "
    "blocks the whole session; load pyinfra_cli in a process of its own (see test_inventory_deploy_keys.py)"
)


def _gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_anything_patched())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``tests/scheduling.py``: the measured seconds in
    ``tests/file_seconds.json``), the rest in collection order, each file's tests in their order."""
    order = scheduling.lpt_order([scheduling.file_of(item.nodeid) for item in items], scheduling.load_table())
    items[:] = [items[i] for i in order]


def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests run in a plain interpreter, as fleet does (``fleet/inventory/load.py``)."""
    if _gevent_patched():
        raise pytest.UsageError(f"after collecting the tests, {GEVENT_PATCHED}")


def pytest_unconfigure(config: pytest.Config) -> None:
    guard = config.stash.get(_GUARD, None)
    if guard is not None:
        del config.stash[_GUARD]
        guard.down()


def pytest_report_header(config: pytest.Config) -> list[str]:
    allowed = config.getoption("allow_hosts", None)
    inproc = f"socket.connect() only to {allowed} (pytest-socket)" if allowed else "OFF (no --allow-hosts)"
    guard = config.stash.get(_GUARD, None)
    if guard is not None:
        sub = guard.describe()
    else:
        sub = f"OFF, in-process guard only: {config.stash.get(_WHY_NOT, 'unknown')}"
    return [f"net guard, in-process: {inproc}", f"net guard, subprocesses: {sub}"]


def guard_of(config: pytest.Config) -> netguard.Guard | None:
    """The session's subprocess guard, or None where it could not go up."""
    return config.stash.get(_GUARD, None)


def _failure(refused: list[netguard.Refusal], packets: int, when: str) -> str:
    where = ", ".join(map(str, refused)) or f"{packets} packets (destinations not recorded: the set is full)"
    return (
        f"net guard: {when} connected outside loopback, refused: {where}. Tests reach only 127.0.0.0/8 and ::1 "
        "(the lab's addresses); use --offline or a lab address (see fleetlab/netguard.py)"
    )


@pytest.fixture(autouse=True)
def _net_guard_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test during which anything (a subprocess too) was refused."""
    yield
    if _gevent_patched():
        pytest.fail(f"after this test, {GEVENT_PATCHED}", pytrace=False)
    guard = guard_of(request.config)
    if guard is not None:
        refused, packets = guard.news()
        if packets or refused:
            pytest.fail(_failure(refused, packets, "this test (or a process it left running)"), pytrace=False)


@pytest.fixture
def net_guard(request: pytest.FixtureRequest) -> netguard.Guard:
    """The subprocess guard, for a test that provokes refusals on purpose and reads them with
    ``news()`` (what it read is no longer this test's failure). Skips where the guard is off."""
    guard = guard_of(request.config)
    if guard is None:
        why = f"the subprocess net guard is off: {request.config.stash.get(_WHY_NOT, 'unknown')}"
        if os.environ.get("FLEET_LAB_REQUIRED") == "1":  # CI: root with nftables, like the lab's air gap
            pytest.fail(f"FLEET_LAB_REQUIRED=1 but {why}", pytrace=False)
        pytest.skip(why)
    return guard


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """What session-scoped teardowns (the labs going down) connected to, after the last test."""
    guard = guard_of(session.config)
    if guard is None:
        return
    refused, packets = guard.news()
    if packets or refused:
        print("\n" + _failure(refused, packets, "the session's teardown"))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
