"""The test run's file order (``tests/scheduling.py``): the longest measured files first, the rest
in collection order, each file's tests together and in order; the table refreshed from JUnit XML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import scheduling

A, B, C, D = "tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py"


@pytest.mark.parametrize(
    ("files", "seconds", "expected"),
    [
        # no table: collection order, unchanged
        ([A, A, B, C], {}, [A, A, B, C]),
        # a tabled file first, its tests in their order; the rest as collected
        ([A, B, C, C, C, D], {C: 400.0}, [C, C, C, A, B, D]),
        # longest first among the tabled ones, whatever their place in the collection
        ([A, B, C, D], {B: 100.0, D: 457.0, C: 445.0}, [D, C, B, A]),
        # a tie: the file collected first goes first
        ([A, B, C], {C: 60.0, B: 60.0}, [B, C, A]),
        # a file in the table that is not collected (a run of tests/unit only) changes nothing
        ([A, B], {"tests/lab/test_real_engine_lab.py": 457.0}, [A, B]),
        # a file whose tests are not adjacent (pytest collects a file once, but keep them grouped)
        ([A, B, A], {B: 90.0}, [B, A, A]),
    ],
)
def test_lpt_order_puts_the_longest_files_first(
    files: list[str], seconds: dict[str, float], expected: list[str]
) -> None:
    order = scheduling.lpt_order(files, seconds)
    assert sorted(order) == list(range(len(files)))  # a permutation: every item once
    assert [files[i] for i in order] == expected


def test_lpt_order_keeps_each_files_tests_in_their_order() -> None:
    files = [A, C, C, B, C, A]
    order = scheduling.lpt_order(files, {C: 300.0, A: 100.0})
    assert order == [1, 2, 4, 0, 5, 3]


def test_file_of_a_node_id() -> None:
    assert scheduling.file_of("tests/lab/test_x.py::TestY::test_z[a::b]") == "tests/lab/test_x.py"
    assert scheduling.file_of("tests/unit/test_x.py") == "tests/unit/test_x.py"


REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="0" skipped="0" tests="5"
 time="900.0" timestamp="2026-11-27T05:00:00.000000+00:00" hostname="ci">
<testcase classname="tests.lab.test_real" name="test_one" time="300.5" />
<testcase classname="tests.lab.test_real" name="test_two" time="150.25" />
<testcase classname="tests.unit.test_klass.TestThing" name="test_a" time="0.5" />
<testcase classname="tests.unit.test_klass.TestThing" name="test_b" time="0.25" />
<testcase classname="tests.gone.test_removed" name="test_c" time="99.0" />
</testsuite></testsuites>"""


def _tree(root: Path) -> Path:
    for f in ("tests/lab/test_real.py", "tests/unit/test_klass.py", "tests/lab/test_old.py"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def test_seconds_per_file_sums_testcases_of_each_file(tmp_path: Path) -> None:
    measured = scheduling.seconds_per_file(REPORT, _tree(tmp_path))
    # a class's tests count for its file; a testcase whose file is not there is left out
    assert measured == {"tests/lab/test_real.py": 450.75, "tests/unit/test_klass.py": 0.75}


def test_seconds_per_file_reads_the_file_attribute_of_xunit1(tmp_path: Path) -> None:
    report = '<testsuite><testcase classname="x.y" file="tests/lab/test_real.py" time="2.5"/></testsuite>'
    assert scheduling.seconds_per_file(report, tmp_path) == {"tests/lab/test_real.py": 2.5}


def test_refreshed_replaces_measured_keeps_others_while_their_file_exists(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    old = {
        "tests/lab/test_real.py": {"seconds": 457, "source": "by hand"},
        "tests/lab/test_old.py": {"seconds": 120, "source": "an older run"},
        "tests/lab/test_deleted.py": {"seconds": 500, "source": "a file since removed"},
        "tests/unit/test_klass.py": {"seconds": 70, "source": "when it was slow"},
    }
    measured = {"tests/lab/test_real.py": 450.75, "tests/unit/test_klass.py": 0.75}
    new = scheduling.refreshed(old, measured, "run X", 60.0, root)
    assert new == {
        "tests/lab/test_real.py": {"seconds": 451, "source": "run X"},
        "tests/lab/test_old.py": {"seconds": 120, "source": "an older run"},
    }
    assert list(new) == ["tests/lab/test_real.py", "tests/lab/test_old.py"]  # longest first


def test_main_rewrites_the_table_and_the_table_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "ci.xml"
    report.write_text(
        REPORT.replace("tests.lab.test_real", "tests.lab.test_real_engine_lab").replace(
            "tests.unit.test_klass", "tests.unit.test_test_scheduling"
        )
    )
    table = tmp_path / "file_seconds.json"
    table.write_text(json.dumps({"about": "kept", "files": {}}))
    assert scheduling.main([str(report), "--table", str(table), "--note", "2 cores"]) == 0
    raw = json.loads(table.read_text())
    assert raw["about"] == "kept"
    (entry,) = raw["files"].values()
    assert list(raw["files"]) == ["tests/lab/test_real_engine_lab.py"] and entry["seconds"] == 451
    assert entry["source"] == "sum of testcase times in ci.xml (2026-11-27T05:00), 2 cores"
    assert scheduling.load_table(table) == {"tests/lab/test_real_engine_lab.py": 451.0}
    assert "451 s  tests/lab/test_real_engine_lab.py" in capsys.readouterr().out


def test_main_refuses_a_report_without_testcases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "empty.xml"
    report.write_text("<testsuites/>")
    assert scheduling.main([str(report), "--table", str(tmp_path / "t.json")]) == 2
    assert "holds no testcase" in capsys.readouterr().err
    report.write_text("not xml")
    assert scheduling.main([str(report), "--table", str(tmp_path / "t.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_the_committed_table_names_existing_files_with_a_source() -> None:
    raw = json.loads(scheduling.TABLE.read_text())
    assert raw["files"], "the table is empty"
    for f, entry in raw["files"].items():
        assert (scheduling.REPO / f).is_file(), f
        assert float(entry["seconds"]) >= scheduling.MIN_SECONDS and entry["source"], (f, entry)
