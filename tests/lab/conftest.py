"""Fixtures for lab tests: a small lab of real hosts, always torn down.

The test lab has its own name, state dir, inventory path (under pytest's tmp dir) and address
octet, so it never touches an operator's lab. It shares the cached base
(``/var/cache/fleet/lab`` or ``$FLEET_LAB_CACHE``) because building one takes a minute.

Teardown happens twice over: the fixture's ``finally`` takes the lab down, and
``pytest_sessionfinish`` takes down every lab this session started (a no-op when the fixture
already did), so an interrupted session leaves no nspawn process and no mount.

Without root or the lab's tools the tests skip with the reason; with ``FLEET_LAB_REQUIRED=1``
(set in CI) they fail instead, so CI cannot silently skip them.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fleetlab import lab as lab_ops
from fleetlab.ports import _listeners
from fleetlab.prereqs import check_prereqs, describe_missing
from fleetlab.removal import BackgroundRemoval
from fleetlab.state import LabDir, LabState

#: Octets this process holds (an open file with an exclusive ``flock`` on it, released by the kernel
#: when the process ends, however it ends).
_HELD_OCTETS: dict[int, int] = {}
OCTET_LOCKS = Path(os.environ.get("FLEET_LAB_OCTET_LOCKS", "/run/lock"))


def _hold_octet(octet: int) -> bool:
    """Whether this process holds ``octet`` now (taking it if no other process does)."""
    if octet in _HELD_OCTETS:
        return True
    fd = os.open(OCTET_LOCKS / f"fleet-test-octet-{octet}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _HELD_OCTETS[octet] = fd
    return True


def free_octet(start: int, avoid: frozenset[int] = frozenset()) -> int:
    """An address octet (100-249) with nothing listening on 127.0.<octet>.* now, held by this process.

    Test sessions run side by side (pytest-xdist's workers, several engineers, CI jobs), each with
    its own labs, so the octet is picked from the pid, skipping octets in use and octets another
    process holds: a lab's addresses listen only once its hosts boot, so listening alone cannot
    tell two sessions that pick at the same moment apart. This process keeps what it took until
    it ends (its own labs, one after another, may reuse an octet).
    """
    busy = {int(a.split(".")[2]) for a, _p in _listeners() if a.startswith("127.0.")}
    for i in range(150):
        octet = 100 + (start + i) % 150
        if octet not in busy and octet not in avoid and _hold_octet(octet):
            return octet
    raise RuntimeError("no free 127.0.x.0/24 for a test lab")


TEST_OCTET = int(os.environ.get("FLEET_LAB_TEST_OCTET") or free_octet(os.getpid()))
TEST_PROFILES = ("h100-sxm-8-link-down", "rtx4090-2", "h100-pcie-8-bridged")

#: (lab name, state root) of every lab this session brought up, for the safety net.
_STARTED: list[tuple[str, Path]] = []
#: Lab directories being deleted while the session goes on (``take_down``); waited for at its end.
REMOVALS = BackgroundRemoval()


def take_down(opts: lab_ops.UpOptions) -> None:
    """``lab down`` whose last step, deleting the lab's directory (a real-engine host's overlay is
    2.5 GB in 62,562 files), goes on in the background while the next test runs: the hosts are
    stopped and nothing is mounted there any more before it starts (``fleetlab.removal``); the
    session waits for it at its end (``pytest_sessionfinish``) and fails if anything is left."""
    lab_ops.down(opts.name, opts.state_root, remove=REMOVALS)


def lab_unavailable() -> str | None:
    """Why lab tests cannot run here, or None."""
    missing = check_prereqs()
    return describe_missing(missing) if missing else None


def require_lab() -> None:
    """Skip (or, with FLEET_LAB_REQUIRED=1, fail) when the lab cannot run here."""
    reason = lab_unavailable()
    if reason is None:
        return
    if os.environ.get("FLEET_LAB_REQUIRED") == "1":
        pytest.fail(f"FLEET_LAB_REQUIRED=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def bring_up(opts: lab_ops.UpOptions) -> lab_ops.UpResult:
    """``up`` that registers the lab with the session's safety net first."""
    if (opts.name, opts.state_root) not in _STARTED:
        _STARTED.append((opts.name, opts.state_root))
    return lab_ops.up(opts)


def test_lab_options(root: Path, name: str, octet: int, hosts: int, profiles: tuple[str, ...]) -> lab_ops.UpOptions:
    """Options for a test lab that lives entirely under ``root``."""
    return lab_ops.UpOptions(
        name=name,
        hosts=hosts,
        profiles=profiles,
        mirror=os.environ.get("FLEET_LAB_MIRROR") or None,
        inventory=root / "inventory" / "lab.py",
        state_root=root / "state",
        octet=octet,
    )


test_lab_options.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@dataclass
class LabFleet:
    """The running test lab."""

    opts: lab_ops.UpOptions
    result: lab_ops.UpResult

    @property
    def dir(self) -> LabDir:
        return LabDir(self.opts.name, self.opts.state_root)

    @property
    def state(self) -> LabState:
        state = self.dir.load()
        assert state is not None
        return state

    def options(self, **changes: object) -> lab_ops.UpOptions:
        return replace(self.opts, **changes)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def lab_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    """Three hosts with distinct profiles; taken down at the end of the session, pass or fail."""
    require_lab()
    root = tmp_path_factory.mktemp("lab")
    opts = test_lab_options(root, f"pt{os.getpid()}", TEST_OCTET, 3, TEST_PROFILES)
    try:
        result = bring_up(opts)
        yield LabFleet(opts, result)
    finally:
        lab_ops.down(opts.name, opts.state_root)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Safety net: take down every lab this session started, even if a fixture could not."""
    for name, state_root in _STARTED:
        try:
            lab_ops.down(name, state_root)
        except Exception as exc:  # report and go on to the next lab
            print(f"\nfleet lab: could not take down test lab {name} under {state_root}: {exc}")
    waiting = REMOVALS.pending
    t0 = time.monotonic()
    left = REMOVALS.wait()
    if waiting:
        print(f"\nfleet lab: waited {time.monotonic() - t0:.1f} s for the removal of {', '.join(map(str, waiting))}")
    if left:
        print("\nfleet lab: test lab directories left behind: " + "; ".join(left))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def bare_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    """One bare host (8x H100 SXM with NVSwitch, no driver); taken down at the end of the session."""
    require_lab()
    root = tmp_path_factory.mktemp("bare-lab")
    octet = free_octet(os.getpid() + 7, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pb{os.getpid()}", octet, 1, ("h100-sxm-8",)), bare=True)
    try:
        result = bring_up(opts)
        yield LabFleet(opts, result)
    finally:
        lab_ops.down(opts.name, opts.state_root)


@pytest.fixture(scope="session", autouse=True)
def _fleet_log_here(tmp_path_factory: pytest.TempPathFactory) -> None:
    """fleet's log file (``fleet.logs``: what paramiko and pyinfra log) under this session's tmp dir,
    for the commands tests run in-process and as subprocesses, never in the home directory."""
    os.environ.setdefault("FLEET_LOG", str(tmp_path_factory.mktemp("fleet-log") / "fleet.log"))
