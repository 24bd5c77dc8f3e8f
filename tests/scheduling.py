"""The longest test files start first: longest-processing-time-first order for ``--dist loadfile``.

``pytest -n 2 --dist loadfile`` (the README's test command, ``.ci/run``) hands whole files to its
two workers one after another, each taking the next file when it is nearly done (pytest-xdist's
``LoadScopeScheduling``, ``xdist/scheduler/loadscope.py``). A file that starts late and runs long
sets the run's tail; the two real-engine files take ~7-8 min each and started 63rd and 107th of
131 files. Started first (Graham's longest-processing-time-first rule for identical machines),
they overlap with each other and the short files fill in behind them.

The order is the collection's (``pytest_collection_modifyitems`` in ``tests/conftest.py``): files
listed in :data:`TABLE` (``tests/file_seconds.json``, each file's measured seconds and where the
number came from) first, longest first; every other file after them in collection order; the
tests of a file keep their order (module-scoped fixtures, a file's lab, depend on it). xdist keeps
the collection's order of files only with ``--no-loadscope-reorder`` (``pyproject.toml``'s
addopts): by default it re-sorts files by their number of tests (``--loadscope-reorder``), which
put the long files, with few tests each, late.

Refresh the table from a run's JUnit XML report (the sum of each file's testcase times, which
pytest counts as setup + call + teardown, so a file's own lab boot and teardown are in it)::

    PYTEST_ADDOPTS=--junitxml=/tmp/ci.xml bash .ci/run
    bash scripts/test-seconds /tmp/ci.xml          # rewrites tests/file_seconds.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "file_seconds.json"
#: Files shorter than this are left to collection order (their order barely moves the tail).
MIN_SECONDS = 60.0


def file_of(nodeid: str) -> str:
    """The file part of a pytest node id (what ``--dist loadfile`` groups by)."""
    return nodeid.split("::", 1)[0]


def lpt_order(files: Sequence[str], seconds: Mapping[str, float]) -> list[int]:
    """The order to run items in, as indices into ``files`` (each item's file, in collection order).

    Items of files in ``seconds`` first, longest file first (a tie: the file collected first);
    the rest after, in collection order. Items of one file stay together and in their order.
    """
    first_seen: dict[str, int] = {}
    for i, f in enumerate(files):
        first_seen.setdefault(f, i)

    def key(i: int) -> tuple[int, float, int, int]:
        f = files[i]
        if f in seconds:
            return (0, -seconds[f], first_seen[f], i)
        return (1, 0.0, first_seen[f], i)

    return sorted(range(len(files)), key=key)


def load_table(path: Path = TABLE) -> dict[str, float]:
    """``{file: seconds}`` from the table (empty where there is none)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {f: float(entry["seconds"]) for f, entry in raw["files"].items()}


def _file_of_case(case: ET.Element, root: Path) -> str | None:
    """A testcase's file, relative to ``root``: its ``file`` attribute (``junit_family=xunit1``),
    else the longest prefix of its ``classname`` (``tests.lab.test_x`` or ``tests.lab.test_x.TestY``)
    that names a ``.py`` file under ``root``."""
    if case.get("file"):
        return case.get("file")
    parts = (case.get("classname") or "").split(".")
    for n in range(len(parts), 0, -1):
        candidate = "/".join(parts[:n]) + ".py"
        if (root / candidate).is_file():
            return candidate
    return None


def seconds_per_file(report: str, root: Path = REPO) -> dict[str, float]:
    """The sum of testcase times per file in a JUnit XML report's text."""
    totals: dict[str, float] = {}
    for case in ET.fromstring(report).iter("testcase"):
        f = _file_of_case(case, root)
        if f is not None:
            totals[f] = totals.get(f, 0.0) + float(case.get("time") or 0.0)
    return totals


def refreshed(
    old: Mapping[str, Mapping[str, object]], measured: Mapping[str, float], source: str, min_seconds: float, root: Path
) -> dict[str, dict[str, object]]:
    """The table's new ``files``: every file the report measured at ``min_seconds`` or more, with
    ``source``; an old entry the report does not cover is kept while its file exists."""
    out: dict[str, dict[str, object]] = {
        f: dict(entry) for f, entry in old.items() if f not in measured and (root / f).is_file()
    }
    for f, s in measured.items():
        if s >= min_seconds:
            out[f] = {"seconds": round(s), "source": source}
    return dict(sorted(out.items(), key=lambda kv: -float(str(kv[1]["seconds"]))))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/test-seconds", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a JUnit XML report (pytest --junitxml=FILE)")
    parser.add_argument("--table", type=Path, default=TABLE, help=f"the table to rewrite (default {TABLE})")
    parser.add_argument("--min-seconds", type=float, default=MIN_SECONDS, help="files shorter are left out")
    parser.add_argument("--note", default="", help="how the run was made (machine, load), added to each source")
    args = parser.parse_args(argv)
    try:
        text = args.report.read_text()
        measured = seconds_per_file(text)
    except (OSError, ET.ParseError) as exc:
        print(f"scripts/test-seconds: cannot read {args.report}: {exc}", file=sys.stderr)
        return 2
    if not measured:
        print(f"scripts/test-seconds: {args.report} holds no testcase of a file under {REPO}", file=sys.stderr)
        return 2
    suite = ET.fromstring(text).find(".//testsuite")
    stamp = (suite.get("timestamp") if suite is not None else None) or _dt.datetime.now(_dt.UTC).isoformat()
    source = f"sum of testcase times in {args.report.name} ({stamp[:16]})" + (f", {args.note}" if args.note else "")
    try:
        old = json.loads(args.table.read_text())
    except FileNotFoundError:
        old = {"files": {}}
    old["files"] = refreshed(old["files"], measured, source, args.min_seconds, REPO)
    args.table.write_text(json.dumps(old, indent=2) + "\n")
    for f, entry in old["files"].items():
        print(f"{entry['seconds']:>6} s  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
