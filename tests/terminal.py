"""A real terminal for tests: a command run in a detached tmux session of a given size, its screen
read back with ``tmux capture-pane`` (what a person would see), then the session ended.

Each :class:`Terminal` runs its own tmux server on a private socket under the test's directory,
so it never meets another session's (or a person's) tmux, and kills that server when done.
Without tmux the test skips, or fails when ``FLEET_LAB_REQUIRED=1`` (CI, where
``scripts/install.sh`` installs it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

DONE = "__terminal_command_exited__"


def require_tmux() -> str:
    path = shutil.which("tmux")
    if path is None:
        if os.environ.get("FLEET_LAB_REQUIRED") == "1":
            pytest.fail("tmux is not installed (scripts/install.sh installs it)", pytrace=False)
        pytest.skip("tmux is not installed")
    return path


class Terminal:
    """``with Terminal(tmp_path, 80, 40) as term: term.start([...]); term.wait_for("text")``."""

    def __init__(self, directory: Path, columns: int, lines: int = 50) -> None:
        self.tmux = require_tmux()
        self.socket = directory / f"tmux-{columns}x{lines}.sock"
        self.columns, self.lines = columns, lines

    def _tmux(self, *args: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
        proc = subprocess.run(
            [self.tmux, "-S", str(self.socket), *args], capture_output=True, text=True, timeout=30, check=False, env=env
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
        """Run ``argv`` in a new session; when it exits the screen keeps its output and a marker
        line with the exit status (the session stays until :meth:`close`).

        The environment reaches the command through the tmux server this call starts (a new
        server's global environment is its own), not through any command line; the terminal's
        size comes from the pane, so ``COLUMNS`` and ``LINES`` are dropped.
        """
        keep = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES", "TMUX", "TMUX_PANE")}
        script = f"cd {shlex.quote(str(cwd))} && {shlex.join(argv)}; echo {DONE} $?; sleep 3600"
        size = ("-x", str(self.columns), "-y", str(self.lines))
        self._tmux("-f", "/dev/null", "new-session", "-d", *size, "bash", "-c", script, env=keep)

    def screen(self) -> str:
        """The visible screen, one line per terminal row (trailing blanks stripped)."""
        return self._tmux("capture-pane", "-p")

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if text in screen:
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on the screen after {timeout:g}s:\n{screen}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float = 60) -> tuple[int, str]:
        """The command's exit status and the screen above the marker line."""
        screen = self.wait_for(DONE, timeout)
        above, _, rest = screen.partition(DONE)
        return int(rest.split()[0]), above

    def send_keys(self, *keys: str) -> None:
        self._tmux("send-keys", *keys)

    def close(self) -> None:
        self._tmux("kill-server", check=False)
        self.socket.unlink(missing_ok=True)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def table_rows(screen: str, first_header: str = "host") -> list[dict[str, str]]:
    """The rows of the first table on ``screen`` whose header line starts with ``first_header``:
    header → cell text, cells separated by two or more spaces, and a cell that wrapped onto the
    lines below (nothing in the first column there) joined back together. The table ends at the
    first empty line."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if re.split(r" {2,}", line.strip())[0] == first_header)
    headers = re.split(r" {2,}", lines[start].strip())
    rows: list[dict[str, str]] = []
    starts: list[int] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if set(line.strip()) <= {"─", "━", "-"}:
            continue
        cells = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]
        if not line[0].isspace():
            rows.append(dict(zip(headers, (text for _x, text in cells), strict=False)))
            starts = [x for x, _t in cells]
            continue
        for x, text in cells:  # a wrapped cell's next line starts where the cell does
            column = max((i for i, s in enumerate(starts) if s <= x), default=0)
            key = headers[column]
            rows[-1][key] = rows[-1].get(key, "") + text
    return rows
