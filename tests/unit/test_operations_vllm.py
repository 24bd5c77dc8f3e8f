"""vLLM release, activation, pruning and unit operations against recorded facts."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from fleet.facts.releases import MARKER, VllmReleases
from fleet.operations import layout, units, vllm
from fleet.operations.files import atomic_file
from fleet.render.units import RenderedFile

from .opharness import Command, Value, key, run_op, written

ROOT = "/opt/fleet/vllm"
SPEC = layout.ReleaseSpec("0.33.0", "3.11.2", "http://127.0.0.1:9000/simple/", (), (layout.NVML_PY_REQUIREMENT,))
RID = SPEC.release_id


def releases(*rows: tuple[int, int, str], current: str = "", previous: str = "") -> list[str]:
    """What VllmReleases' command prints: ``release <mtime> <complete> <name>`` lines, then links."""
    lines = [f"release {m} {c} {n}" for m, c, n in rows]
    cur = f"releases/{current}" if current else ""
    prev = f"releases/{previous}" if previous else ""
    return [*lines, f"current {cur}", f"previous {prev}"]


def _file_stat(mode: str, user: str = "root") -> list[str]:
    return [f"user={user} group={user} mode={mode} atime=1 mtime=1 ctime=1 size=1 '/x'"]


# -- releases ---------------------------------------------------------------------------------


def test_release_id_is_named_by_content() -> None:
    assert RID.startswith("vllm-0.33.0-py3.11.2-") and len(RID.rsplit("-", 1)[1]) == 12
    assert layout.ReleaseSpec("0.33.0", "3.11.2", SPEC.index_url, (), SPEC.extra_requirements).release_id == RID
    for changed in (
        layout.ReleaseSpec("0.33.1", "3.11.2", SPEC.index_url, (), SPEC.extra_requirements),
        layout.ReleaseSpec("0.33.0", "3.12.1", SPEC.index_url, (), SPEC.extra_requirements),
        layout.ReleaseSpec("0.33.0", "3.11.2", "http://mirror.invalid/simple/", (), SPEC.extra_requirements),
        layout.ReleaseSpec("0.33.0", "3.11.2", SPEC.index_url, ("audio",), SPEC.extra_requirements),
    ):
        assert changed.release_id != RID
    assert layout.ReleaseSpec("0.33.0", "3", "u", ("b", "a")).requirements() == ["vllm[a,b]==0.33.0"]


def _build_argv(command: Command) -> list[str]:
    argv = shlex.split(command.text)
    assert argv[:3] == ["sh", "-s", "--"] and command.stdin == vllm.BUILD  # the script on stdin, not in argv
    return argv[3:]


def test_release_on_a_bare_host_builds_the_venv_from_the_index_only() -> None:
    facts = {key(VllmReleases, root=ROOT): releases()}
    run = run_op(vllm.release, facts, spec=SPEC, root=ROOT)
    assert len(run.commands) == 1  # one command: checked, built, cleaned up on failure, marker last
    root, rid, python, floor, margin, marker_name, marker_json, *pip = _build_argv(run.commands[0])
    assert (root, rid, python, marker_name) == (ROOT, RID, "python3", MARKER)
    assert int(floor) == vllm.FIRST_RELEASE_KIB and margin == "110"
    assert pip == [
        "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir", "--timeout", "60",
        "--index-url", "http://127.0.0.1:9000/simple/", "vllm==0.33.0", "nvidia-ml-py==13.615.71",
    ]  # fmt: skip
    marker = json.loads(marker_json)
    assert marker["id"] == RID and marker["index_url"] == SPEC.index_url


def test_complete_release_is_not_touched_and_a_half_built_one_is_rebuilt() -> None:
    done = {key(VllmReleases, root=ROOT): releases((100, 1, RID))}
    assert run_op(vllm.release, done, spec=SPEC, root=ROOT).texts == []
    half = {key(VllmReleases, root=ROOT): releases((100, 0, RID))}
    run = run_op(vllm.release, half, spec=SPEC, root=ROOT)
    assert _build_argv(run.commands[0])[1] == RID  # BUILD removes what is there first
    assert 'rm -rf -- "$target"' in vllm.BUILD.split("largest=0", 1)[0]


# -- the build script itself, run by a real shell with stand-ins for python3 and pip -------------

#: ``python3 -m venv TARGET`` for the build: makes TARGET/bin/pip, a script doing what ``$PIP`` says
FAKE_PYTHON = """#!/bin/sh
[ "$1" = -m ] && [ "$2" = venv ] || exit 2
t=$4
mkdir -p "$t/bin" || exit 1
if [ -n "${VENV_FAILS:-}" ]; then
  echo "Error: Command '[$t/bin/python3, -m, ensurepip]' returned non-zero exit status 1." >&2; exit 1
fi
printf '#!/bin/sh\n%s\n' "$PIP" > "$t/bin/pip"; chmod +x "$t/bin/pip"
head -c 20480 /dev/zero > "$t/bin/python3"
"""


def _build(tmp_path: Path, floor_kib: int, pip: str, **extra: str) -> tuple[int, str, Path]:
    root = tmp_path / "vllm"
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    argv = ["sh", "-s", "--", str(root), "r2", str(python), str(floor_kib), "110", MARKER, '{"id": "r2"}',
            "install", "vllm==0.33.0"]  # fmt: skip
    env = {**os.environ, "PIP": pip, **extra}
    done = subprocess.run(argv, input=vllm.BUILD, capture_output=True, text=True, env=env, check=False)
    return done.returncode, done.stderr, root / "releases"


def test_the_build_writes_the_marker_last(tmp_path: Path) -> None:
    rc, err, releases_dir = _build(tmp_path, 1, "exit 0")
    assert rc == 0, err
    assert json.loads((releases_dir / "r2" / MARKER).read_text()) == {"id": "r2"}
    assert (releases_dir / "r2" / MARKER).stat().st_mode & 0o777 == 0o644
    assert [p.name for p in (releases_dir / "r2").iterdir() if p.name.endswith("fleet-tmp")] == []


def test_not_enough_space_is_refused_before_anything_is_written_with_both_numbers(tmp_path: Path) -> None:
    free_kib = shutil.disk_usage(tmp_path).free // 1024
    rc, err, releases_dir = _build(tmp_path, free_kib + 10 * 1024 * 1024, "exit 0")
    assert rc == 28, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("release r2: No space left on device (ENOSPC): needs ")
    needs = re.search(r"needs (\d+) MiB \(no release here to measure: a venv with pip\), (\d+) MiB free on ", line)
    assert needs is not None and int(needs[1]) > int(needs[2]) > 0, line
    assert " mounted at " in line and line.endswith("nothing was written")
    assert list(releases_dir.iterdir()) == []


def test_the_largest_release_on_the_host_is_what_a_new_one_needs(tmp_path: Path) -> None:
    old = tmp_path / "vllm" / "releases" / "r1"
    old.mkdir(parents=True)
    (old / MARKER).write_text("{}\n")
    (old / "blob").write_bytes(b"x" * (3 * 1024 * 1024))
    rc, err, _rel = _build(tmp_path, 1, "exit 0")
    assert rc == 0, err  # plenty of room here
    measured = re.search(
        r"needs (\d+) MiB \(the largest release here, r1, is (\d+) MiB, \+10%\)", _measure_need(tmp_path)
    )
    assert measured is not None
    need, largest = int(measured[1]), int(measured[2])
    assert largest in (3, 4) and need in (largest, largest + 1)  # du's KiB, + 10 %, rounded up to MiB


def _measure_need(tmp_path: Path) -> str:
    """The build's own account of what it needs, by making it refuse (TMPDIR-independent)."""
    script = vllm.BUILD.replace('if [ "$free" -lt "$need" ]', "if true")
    argv = ["sh", "-c", script, "fleet-release", str(tmp_path / "vllm"), "r3", "false", "1", "110", MARKER, "{}"]
    return subprocess.run(argv, capture_output=True, text=True, check=False).stderr


def test_a_full_disk_during_pip_is_named_and_the_half_built_release_removed(tmp_path: Path) -> None:
    pip = 'echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device" >&2; exit 1'
    rc, err, releases_dir = _build(tmp_path, 1, pip)
    assert rc == 28, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("release r2: No space left on device (ENOSPC) during pip install: needed more than the ")
    assert "MiB were free on " in last and last.endswith("the half-built release was removed")
    assert "[Errno 28]" in err  # pip's own line, above
    assert list(releases_dir.iterdir()) == []


def test_another_failure_is_not_called_a_full_disk_and_is_cleaned_up(tmp_path: Path) -> None:
    rc, err, releases_dir = _build(tmp_path, 1, 'echo "ERROR: No matching distribution found for vllm" >&2; exit 1')
    assert rc == 1, err
    assert "No matching distribution found for vllm" in err
    assert err.strip().splitlines()[-1] == "release r2: pip install failed; the half-built release was removed"
    assert "ENOSPC" not in err and list(releases_dir.iterdir()) == []
    rc, err, releases_dir = _build(tmp_path, 1, "exit 0", VENV_FAILS="1")
    assert rc == 1 and "ensurepip" in err and "python3 -m venv (ensurepip) failed" in err, err
    assert list(releases_dir.iterdir()) == []


#: An interpreter whose ensurepip has bundled wheels (``WHEELS`` names them; empty: none): it
#: answers the build's question about them, makes a venv without pip where asked, and that venv's
#: python records how it was run and then runs ``$PIP`` (exit status and output, as pip would).
FAKE_PYTHON_BUNDLED = """#!/bin/sh
if [ "$1" = -I ] && [ "$2" = - ]; then cat >/dev/null; [ -n "$WHEELS" ] && printf '%s\\n' "$WHEELS"; exit 0; fi
[ "$1" = -m ] && [ "$2" = venv ] || exit 2
if [ "$3" = --without-pip ]; then t=$5; else t=$4; fi
mkdir -p "$t/bin" || exit 1
[ -z "${VENV_FAILS:-}" ] || { echo "venv failed" >&2; exit 1; }
printf '#!/bin/sh\\nfor a in "$@"; do printf "%%s\\\\n" "$a"; done > "$RAN"\\n%s\\n' "$PIP" > "$t/bin/python"
cp "$t/bin/python" "$t/bin/pip"; chmod +x "$t/bin/python" "$t/bin/pip"
"""


def _build_bundled(tmp_path: Path, wheels: str, pip: str = "exit 0", **extra: str) -> tuple[int, str, Path, list[str]]:
    root = tmp_path / "vllm"
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON_BUNDLED)
    python.chmod(0o755)
    ran = tmp_path / "ran"
    argv = ["sh", "-s", "--", str(root), "r2", str(python), "1", "110", MARKER, '{"id": "r2"}',
            "install", "--index-url", "http://127.0.0.1:9/simple/", "vllm==0.33.0"]  # fmt: skip
    env = {**os.environ, "PIP": pip, "WHEELS": wheels, "RAN": str(ran), "TMPDIR": str(tmp_path), **extra}
    done = subprocess.run(argv, input=vllm.BUILD, capture_output=True, text=True, env=env, check=False)
    return done.returncode, done.stderr, root / "releases", ran.read_text().splitlines() if ran.exists() else []


def test_with_ensurepips_wheels_the_venv_and_its_pip_come_from_one_pip_run(tmp_path: Path) -> None:
    """Where the interpreter's ensurepip has its wheels (pip's and, before Python 3.12,
    setuptools'), the venv is made without pip and one pip run, pip itself run from its wheel,
    installs the requirements and pip and setuptools from those wheels: one pip start instead of
    two (``python3 -m venv`` runs pip once for its own ensurepip)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pip_whl, st_whl = wheels / "pip-23.0.1-py3-none-any.whl", wheels / "setuptools-66.1.1-py3-none-any.whl"
    pip_whl.write_bytes(b"")
    st_whl.write_bytes(b"")
    rc, err, releases_dir, ran = _build_bundled(tmp_path, f"setuptools pip\n{st_whl}\n{pip_whl}")
    assert rc == 0, err
    assert ran[0] == f"{pip_whl}/pip"  # pip run from its wheel by the venv's python
    links = ran[ran.index("--find-links") + 1]
    assert ran[1:4] == ["install", "--index-url", "http://127.0.0.1:9/simple/"] and "vllm==0.33.0" in ran
    assert ran[-2:] == ["setuptools", "pip"], ran
    assert not Path(links).exists()  # the directory of links to the wheels is gone after the build
    assert json.loads((releases_dir / "r2" / MARKER).read_text()) == {"id": "r2"}
    # Python 3.12 and later: ensurepip installs pip only
    rc, err, releases_dir, ran = _build_bundled(tmp_path, f"pip\n{pip_whl}")
    assert rc == 0 and ran[0] == f"{pip_whl}/pip" and ran[-2] != "setuptools" and ran[-1] == "pip", (err, ran)


def test_without_ensurepips_wheels_the_venv_is_made_as_before(tmp_path: Path) -> None:
    """No bundled wheels found (no ensurepip, a distribution that removed them): ``python3 -m venv``
    with its own ensurepip, then the venv's pip, as before."""
    rc, err, _releases_dir, ran = _build_bundled(tmp_path, "")
    assert rc == 0, err
    assert ran[:1] == ["install"] and "--find-links" not in ran


def test_a_failed_pip_run_from_the_wheel_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pip_whl = wheels / "pip-23.0.1-py3-none-any.whl"
    pip_whl.write_bytes(b"")
    pip = 'echo "ERROR: No matching distribution found for vllm" >&2; exit 1'
    rc, err, releases_dir, ran = _build_bundled(tmp_path, f"pip\n{pip_whl}", pip)
    assert rc == 1 and "No matching distribution found for vllm" in err, err
    assert err.strip().splitlines()[-1] == "release r2: pip install failed; the half-built release was removed"
    assert list(releases_dir.iterdir()) == [] and not Path(ran[ran.index("--find-links") + 1]).exists()
    rc, err, releases_dir, _ran = _build_bundled(tmp_path, f"pip\n{pip_whl}", VENV_FAILS="1")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        "release r2: python3 -m venv failed; the half-built release was removed"
    ), err
    assert list(releases_dir.iterdir()) == [] and [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")] == []


def test_the_real_build_with_this_pythons_own_wheels(tmp_path: Path) -> None:
    """The build run for real with this machine's Python, no index (``--no-index``): the venv is
    made without pip and the one pip run, pip from ensurepip's own wheel, puts pip and (before
    Python 3.12) setuptools into it from those wheels, as ``python3 -m venv`` would have."""
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    root = tmp_path / "vllm"
    argv = ["sh", "-x", "-s", "--", str(root), "r1", str(python), "1", "110", MARKER, '{"id": "r1"}',
            "install", "--no-input", "--disable-pip-version-check", "--no-cache-dir", "--no-index"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))} | {"TMPDIR": str(tmp_path)}
    done = subprocess.run(argv, input=vllm.BUILD, capture_output=True, text=True, env=env, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = [line for line in done.stderr.splitlines() if line.startswith("+")]  # sh -x: what ran
    assert any(" -m venv --without-pip -- " in line for line in trace), trace
    assert any("-py3-none-any.whl/pip install " in line and " --find-links " in line for line in trace), trace
    venv = root / "releases" / "r1"
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    names = {line.split("==")[0] for line in listed.split()}
    assert names == ({"pip", "setuptools"} if sys.version_info < (3, 12) else {"pip"}), listed
    assert (venv / MARKER).is_file() and [p.name for p in tmp_path.iterdir()] == ["vllm"]  # no links left


def test_activate_flips_current_under_the_hosts_switch_lock() -> None:
    from fleet.operations.vllm import SWITCH_SH

    first = run_op(vllm.activate, {key(VllmReleases, root=ROOT): releases((1, 1, "a"))}, release_id="a", root=ROOT)
    assert first.texts == [shlex.join(["sh", "-c", f"set -e; r=$1; rel=$2; {SWITCH_SH}", "fleet-activate", ROOT, "a"])]
    second = run_op(
        vllm.activate, {key(VllmReleases, root=ROOT): releases((1, 1, "a"), (2, 1, "b"), current="a")},
        release_id="b", root=ROOT,
    )  # fmt: skip
    assert second.texts == [shlex.join(["sh", "-c", f"set -e; r=$1; rel=$2; {SWITCH_SH}", "fleet-activate", ROOT, "b"])]
    again = {key(VllmReleases, root=ROOT): releases((1, 1, "a"), (2, 1, "b"), current="b", previous="a")}
    assert run_op(vllm.activate, again, release_id="b", root=ROOT).texts == []


def _switch(tmp_path: Path, rel: str) -> subprocess.CompletedProcess[str]:
    from fleet.operations.vllm import switch_command

    return subprocess.run(switch_command(str(tmp_path), rel), shell=True, capture_output=True, text=True, check=False)


def test_the_switch_script_flips_current_and_previous_atomically_and_is_a_no_op_when_current(tmp_path: Path) -> None:
    """The shell itself, run here by ``sh`` (flock(1) from util-linux, as on every host)."""
    for r in ("a", "b"):
        (tmp_path / "releases" / r).mkdir(parents=True)
    assert _switch(tmp_path, "a").returncode == 0
    assert os.readlink(tmp_path / "current") == "releases/a" and not (tmp_path / "previous").exists()
    assert _switch(tmp_path, "b").returncode == 0
    assert (os.readlink(tmp_path / "current"), os.readlink(tmp_path / "previous")) == ("releases/b", "releases/a")
    assert _switch(tmp_path, "b").returncode == 0  # already current: previous stays what it was
    assert os.readlink(tmp_path / "previous") == "releases/a"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fleet-switch.lock", "current", "previous", "releases"]


def test_concurrent_switches_on_one_host_never_collide(tmp_path: Path) -> None:
    """Issue 25.2: two instances of one host switching in one batch wrote the same temporary link
    2-3 ms apart (``mv: cannot stat``). Under the host's lock, 4 at once, 30 rounds: all succeed."""
    from concurrent.futures import ThreadPoolExecutor

    for r in ("a", "b"):
        (tmp_path / "releases" / r).mkdir(parents=True)
    with ThreadPoolExecutor(4) as pool:
        for n in range(30):
            rel = "ab"[n % 2]
            done = list(pool.map(lambda _i, rel=rel: _switch(tmp_path, rel), range(4)))
            assert [d.returncode for d in done] == [0] * 4, [d.stderr for d in done]
            assert os.readlink(tmp_path / "current") == f"releases/{rel}"
            if n:
                assert os.readlink(tmp_path / "previous") == f"releases/{'ab'[(n + 1) % 2]}"
    assert not [p for p in tmp_path.iterdir() if "fleet-tmp" in p.name]  # no temporary link left


@pytest.mark.parametrize(
    ("names", "current", "previous", "keep", "pruned"),
    [
        (["a", "b", "c"], "c", "b", 3, []),
        (["a", "b", "c", "d"], "d", "c", 3, ["a"]),
        (["a", "b", "c", "d", "e"], "e", "d", 2, ["a", "b", "c"]),
        (["a", "b", "c", "d"], "a", "b", 2, ["c", "d"]),  # rolled back to an old one: it stays
        (["a", "b"], None, None, 2, []),
    ],
)
def test_prune_never_removes_current_or_previous(
    names: list[str], current: str | None, previous: str | None, keep: int, pruned: list[str]
) -> None:
    assert layout.releases_to_prune(names, current, previous, keep) == pruned


def test_prune_operation_and_its_guard() -> None:
    facts = {
        key(VllmReleases, root=ROOT): releases(
            (1, 1, "a"), (2, 1, "b"), (3, 1, "c"), (4, 1, "d"), current="d", previous="c"
        )
    }
    assert run_op(vllm.prune, facts, keep=3, root=ROOT).texts == [f"rm -rf -- {ROOT}/releases/a"]
    assert run_op(vllm.prune, facts, keep=4, root=ROOT).texts == []
    with pytest.raises(layout.LayoutError, match="keep at least 2"):
        layout.releases_to_prune(["a"], "a", None, 1)


# -- files and units ----------------------------------------------------------------------------


def test_atomic_file_sends_the_secret_on_stdin_only() -> None:
    secret = "VLLM_API_KEY=s3cr3t-value\n"
    path = "/etc/fleet/vllm-0.env"
    run = run_op(atomic_file, {key(Sha1File, path=path): []}, path=path, content=secret, mode=0o600)
    assert "s3cr3t" not in run.texts[0]
    assert shlex.split(run.texts[0])[3:] == ["fleet-write", "/etc/fleet", "vllm-0.env", "root:root", "600"]
    assert "umask 077" in run.texts[0] and "mv -fT" in run.texts[0]
    assert base64.b64decode(run.commands[0].stdin or "").decode() == secret


def test_atomic_file_fixes_only_mode_or_owner_when_content_matches() -> None:
    path = "/etc/fleet/vllm-0.env"
    sha = [f"{hashlib.sha1(b'x').hexdigest()}  {path}"]
    loose = {key(Sha1File, path=path): sha, key(File, path=path): _file_stat("-rw-r--r--", "vllm")}
    assert run_op(atomic_file, loose, path=path, content="x", mode=0o600).texts == [
        f"chown root:root -- {path}",
        f"chmod 600 -- {path}",
    ]
    tight = {key(Sha1File, path=path): sha, key(File, path=path): _file_stat("-rw-------")}
    assert run_op(atomic_file, tight, path=path, content="x", mode=0o600).texts == []


UNIT = RenderedFile("/etc/systemd/system/fleet-vllm-0.service", "[Service]\nExecStart=/bin/true\n", 0o644)
ENV = RenderedFile("/etc/fleet/vllm-0.env", "VLLM_API_KEY=k\n", 0o600)


def _unit_facts(unit_sha: bool, env_sha: bool, enabled: bool) -> dict:
    def sha(f: RenderedFile, same: bool) -> list[str]:
        return [f"{hashlib.sha1(f.content.encode() if same else b'old').hexdigest()}  {f.path}"]

    return {
        key(Sha1File, path=UNIT.path): sha(UNIT, unit_sha),
        key(Sha1File, path=ENV.path): sha(ENV, env_sha),
        key(File, path=UNIT.path): _file_stat("-rw-r--r--") if unit_sha else [],
        key(File, path=ENV.path): _file_stat("-rw-------") if env_sha else [],
        key(SystemdEnabled, services=["fleet-vllm-0.service"]): Value({"fleet-vllm-0.service": enabled}),
    }


def test_units_first_run_writes_and_enables_in_one_command() -> None:
    # one round trip: both files written (each its own rename), then ``systemctl enable``, which
    # reloads systemd itself (systemctl(1), --no-reload): no daemon-reload of its own
    run = run_op(units.installed, _unit_facts(False, False, False), files=[UNIT, ENV])
    assert len(run.texts) == 1
    write, enable = run.texts[0].split(" && ")
    assert enable == "systemctl enable fleet-vllm-0.service"
    assert written(run.commands[0]) == {
        UNIT.path: (UNIT.content.encode(), "root:root", "644"),
        ENV.path: (ENV.content.encode(), "root:root", "600"),
    }
    assert "VLLM_API_KEY" not in write and "k\n" not in write  # the env file's content is on stdin only


def test_units_read_every_fact_together_before_their_command() -> None:
    # before: each file's facts were read after the previous file's write (a round trip each in a
    # deploy, whose fact cache every command empties), and whether the units were enabled after
    # the writes: 2 writes + 1 read alone + daemon-reload + 1 read alone + enable = 6 round trips
    run = run_op(units.installed, _unit_facts(False, False, False), files=[UNIT, ENV])
    assert run.late_reads == []
    assert run.round_trips == 2  # the facts together, then the one command


def test_units_second_run_changes_nothing() -> None:
    run = run_op(units.installed, _unit_facts(True, True, True), files=[UNIT, ENV])
    assert run.texts == [] and run.round_trips == 1


def test_a_changed_unit_already_enabled_is_enabled_again_which_reloads_systemd() -> None:
    run = run_op(units.installed, _unit_facts(False, True, True), files=[UNIT, ENV])
    assert len(run.texts) == 1 and run.texts[0].endswith(" && systemctl enable fleet-vllm-0.service")
    assert list(written(run.commands[0])) == [UNIT.path]


def test_env_change_alone_does_not_reload_systemd() -> None:
    run = run_op(units.installed, _unit_facts(True, False, True), files=[UNIT, ENV])
    assert len(run.texts) == 1 and "vllm-0.env" in run.texts[0] and "systemctl" not in run.texts[0]


def test_mode_fix_alone_is_chmod_only() -> None:
    facts = {**_unit_facts(True, True, True), key(File, path=ENV.path): _file_stat("-rw-r--r--")}
    assert run_op(units.installed, facts, files=[UNIT, ENV]).texts == [f"chmod 600 -- {ENV.path}"]


def test_restart_units_restart_when_a_file_changed_else_start_unless_running() -> None:
    watch = "fleet-vllm-0.service"

    def facts(unit_same: bool, running: bool) -> dict:
        return {**_unit_facts(unit_same, True, True), key(SystemdStatus, services=[watch]): Value({watch: running})}

    changed = run_op(units.installed, facts(False, True), files=[UNIT, ENV], restart=[watch])
    assert changed.texts[0].endswith(f" && systemctl enable {watch} && systemctl restart {watch}")
    assert changed.round_trips == 2 and changed.late_reads == []
    stopped = run_op(units.installed, facts(True, False), files=[UNIT, ENV], restart=[watch])
    assert stopped.texts == [f"systemctl start {watch}"]
    assert run_op(units.installed, facts(True, True), files=[UNIT, ENV], restart=[watch]).texts == []


def test_units_with_no_unit_files_ask_systemd_nothing() -> None:
    # Only the env file: no SystemdEnabled read is recorded, so reading it would raise KeyError.
    facts = {k: v for k, v in _unit_facts(True, True, True).items() if k[0] is not SystemdEnabled}
    assert run_op(units.installed, facts, files=[ENV]).texts == []
    assert run_op(units.installed, {}, files=[]).texts == []
