"""The NVML probe carries its pynvml: it runs on any host with a driver and Python 3.6+.

The command is run here through ``sh`` the way a host runs it (``sh -c CMD``), against Python
interpreters that have no nvidia-ml-py (a venv without packages; the interpreters of every
Python version this machine has, 2.7 and 3.6 to 3.13 under pyenv, skipped where absent), with
the lab's NVML library standing in for the driver where GPUs are the point.
"""

from __future__ import annotations

import ast
import base64
import glob
import hashlib
import json
import marshal
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import FleetError
from fleet.facts.hoststatus import HostStatusProbe
from fleet.facts.nvml import (
    COMMAND_LIMIT,
    MIN_PYTHON,
    NvmlProbe,
    carried_module,
    carried_pynvml,
    probe_command,
    probe_program,
    probe_script,
)

#: Linux's MAX_ARG_STRLEN: the most one argument of execve may be (include/uapi/linux/binfmts.h)
MAX_ARG_STRLEN = 131072
ENV = {"PATH": "/usr/bin:/bin"}


def constants(program: str) -> dict[str, object]:
    """The constants the program starts with (``NAME = literal`` lines before the loader)."""
    out: dict[str, object] = {}
    for node in ast.parse(program).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def run(command: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, object]:
    """Run the probe command through sh as a host does; its JSON answer (the last line)."""
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env or ENV, cwd=cwd,
                          check=True, timeout=120)  # fmt: skip
    assert done.stderr == "", done.stderr
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with nothing installed (no pip, no nvidia-ml-py), like a fresh host's python3."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import pynvml"], capture_output=True, check=False).returncode != 0
    return python


# ---- what travels --------------------------------------------------------------------------------


def test_the_carried_pynvml_is_the_installed_distribution_file_byte_for_byte() -> None:
    carried = carried_pynvml()
    dist = metadata.distribution("nvidia-ml-py")
    assert carried.version == dist.version and carried.distribution == "nvidia-ml-py"
    assert carried.path == Path(str(dist.locate_file("pynvml.py"))) and carried.text == carried.path.read_bytes()
    # BSD licence: its text is the file's own header, so it travels with the unmodified file
    header = carried.text[:2000].decode()
    assert "Copyright (c) 2011-" in header and "NVIDIA Corporation" in header
    assert "Redistribution and use in source and binary forms" in header and "THIS SOFTWARE IS PROVIDED" in header
    values = constants(probe_program())
    assert zlib.decompress(base64.b64decode(str(values["PYNVML"]))) == carried.text
    assert zlib.decompress(base64.b64decode(str(values["PROBE"]))).decode() == probe_script()
    assert values["PYNVML_ORIGIN"] == f"fleet:nvidia-ml-py=={dist.version}/pynvml.py"
    assert values["MIN_PYTHON"] == MIN_PYTHON == (3, 6)


def test_a_changed_pynvml_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """A file that is not what its distribution installed (RECORD hash) is never sent."""
    site = tmp_path / "site"
    info = site / "nvidia_ml_py-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-ml-py\nVersion: 1.0\n")
    (site / "pynvml.py").write_bytes(b"# the original\n")
    good = base64.urlsafe_b64encode(hashlib.sha256(b"# the original\n").digest()).rstrip(b"=")
    (info / "RECORD").write_text(f"pynvml.py,sha256={good.decode()},15\nnvidia_ml_py-1.0.dist-info/RECORD,,\n")
    dist = metadata.PathDistribution(info)
    assert carried_module(dist).text == b"# the original\n"
    (site / "pynvml.py").write_bytes(b"# changed after installation\n")
    with pytest.raises(FleetError, match=r"pynvml.py is not the file nvidia-ml-py 1.0 installed .*force-reinstall"):
        carried_module(dist)
    (info / "RECORD").write_text("example.py,,\n")
    with pytest.raises(FleetError, match=r"nvidia-ml-py 1\.0 lists no pynvml\.py"):
        carried_module(dist)


def test_the_command_fits_one_shell_argument_with_room_to_spare() -> None:
    """Hosts run it as ``sh -c CMD`` (sshd) and ``sudo -n sh -c CMD``: one argument each."""
    command = probe_command()
    size = len(command.encode())
    assert 50_000 < size <= COMMAND_LIMIT < MAX_ARG_STRLEN, size
    assert len(probe_script().encode()) + len(carried_pynvml().text) > 300_000  # what it would be uncompressed
    wrapped = shlex.join(["sudo", "-n", "sh", "-c", command])
    assert len(wrapped.encode()) < MAX_ARG_STRLEN
    assert len(HostStatusProbe().command().encode()) < MAX_ARG_STRLEN
    # the real limit, through execve: sh -c with the command as one argument, wrapped again in sh -c
    done = subprocess.run(["sh", "-c", f"sh -c {shlex.quote(command)}"], capture_output=True, text=True, env=ENV,
                          check=True, timeout=120)  # fmt: skip
    assert json.loads(done.stdout.splitlines()[-1])["schema"] == 1


def test_python_m_prints_the_exact_command_and_program(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "fleet.facts.nvml", "--python", "/usr/bin/python3"],
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    assert done.stdout == probe_command("/usr/bin/python3")
    done = subprocess.run([sys.executable, "-m", "fleet.facts.nvml", "--program"], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    assert done.stdout == probe_program()


# ---- on a host without nvidia-ml-py --------------------------------------------------------------


def test_a_python_without_nvidia_ml_py_reaches_nvml(bare_python: Path) -> None:
    """No pynvml installed: the carried one loads and asks NVML (none here: no-nvml-library), where
    fleet before carrying answered no-pynvml."""
    answer = run(probe_command(str(bare_python)))
    assert answer["status"] == "no-nvml-library", answer
    assert answer["pynvml"] == carried_pynvml().origin
    assert answer["error"] == {"class": "LibraryNotFound", "message": "NVML Shared Library Not Found"}
    facts = NvmlProbe().process([json.dumps(answer)])
    assert facts.pynvml == carried_pynvml().origin and facts.packages == {"nvidia-ml-py": None, "vllm": None}


def test_the_carried_pynvml_wins_over_one_installed_and_the_working_directory_is_not_imported(
    tmp_path: Path, bare_python: Path
) -> None:
    """A pynvml on the interpreter's path (another version), a PYTHONPATH and modules in the working
    directory named like the standard library: none is imported; the installed version is still reported."""
    marker = tmp_path / "imported"
    bomb = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise SystemExit('imported ' + __name__)\n"
    site = next((bare_python.parent.parent / "lib").glob("python3*/site-packages"))
    (site / "pynvml.py").write_text(bomb)
    info = site / "nvidia_ml_py-11.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-ml-py\nVersion: 11.0\n")
    home = tmp_path / "home"
    home.mkdir()
    for name in ("json", "base64", "zlib", "ctypes", "pynvml"):
        (home / f"{name}.py").write_text(bomb)
    try:
        answer = run(probe_command(str(bare_python)), env={**ENV, "PYTHONPATH": str(home)}, cwd=home)
    finally:
        (site / "pynvml.py").unlink()
        shutil.rmtree(info)
    assert not marker.exists(), marker.read_text()
    assert answer["pynvml"] == carried_pynvml().origin and answer["status"] == "no-nvml-library", answer
    assert answer["packages"] == {"nvidia-ml-py": "11.0", "vllm": None}


def test_a_python_older_than_the_probe_needs_is_a_status_naming_it(bare_python: Path) -> None:
    """What an old interpreter answers, here by raising the minimum above this Python (see
    test_probe_on_every_python for a real Python 2.7)."""
    command = probe_command(str(bare_python))
    assert command.count(f"MIN_PYTHON = {MIN_PYTHON!r}\n") == 1
    answer = run(command.replace(f"MIN_PYTHON = {MIN_PYTHON!r}\n", "MIN_PYTHON = (99, 0)\n"))
    found = ".".join(str(x) for x in sys.version_info[:3])
    assert answer["status"] == "python-too-old" and answer["python_version"] == found
    facts = NvmlProbe().process([json.dumps(answer)])
    assert facts.status == "python-too-old" and facts.error_class == "PythonTooOld"
    assert facts.error_message is not None and facts.error_message.endswith(
        f"is Python {found}; the probe needs 99.0 or newer"
    )
    assert str(facts.python).startswith(str(bare_python.parent))


# ---- every Python this machine has, against the lab's NVML library --------------------------------

VERSIONS = ("2.7", "3.6", "3.7", "3.8", "3.9", "3.10", "3.11", "3.12", "3.13")


def interpreter(version: str) -> str | None:
    """An interpreter of ``version`` on this machine (pyenv's or the system's), or None."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(f"{pyenv}/versions/{version}.*/bin/python{version}"))
    found += [p for p in (f"/usr/bin/python{version}",) if os.path.exists(p)]
    return found[0] if found else None


@pytest.fixture(scope="module")
def nvml(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment under which the lab's NVML library answers as an 8x H100 SXM host."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the lab's NVML library (scripts/install.sh installs it)")
    from fleetlab.nvml import build_shim
    from fleetlab.profiles import load_profile

    root = tmp_path_factory.mktemp("nvml")
    lib = build_shim(root / "lib")
    (root / "profile").write_text(load_profile("h100-sxm-8").render())
    (root / "state").mkdir()
    return {**ENV, "LD_LIBRARY_PATH": str(lib.parent), "FLEET_NVML_PROFILE": str(root / "profile"),
            "FLEET_NVML_STATE_DIR": str(root / "state")}  # fmt: skip


@pytest.fixture(scope="module")
def reference(nvml: dict[str, str], bare_python: Path) -> dict[str, object]:
    """What the probe answers with this machine's Python (fleet's own), less what names the Python."""
    return _without_python(run(probe_command(str(bare_python)), env=nvml))


def _without_python(answer: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in answer.items() if k not in ("python", "python_version", "packages")}


@pytest.mark.parametrize("version", VERSIONS)
def test_probe_on_every_python(version: str, nvml: dict[str, str], reference: dict[str, object]) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    answer = run(probe_command(python), env=nvml)
    if tuple(int(x) for x in version.split(".")) < MIN_PYTHON:
        assert answer["status"] == "python-too-old" and answer["python"] == python, answer
        assert answer["error"] == {
            "class": "PythonTooOld",
            "message": f"{python} is Python {answer['python_version']}; the probe needs 3.6 or newer",
        }
        return
    assert str(answer["python_version"]).startswith(f"{version}."), answer
    assert answer["status"] == "ok" and answer["pynvml"] == carried_pynvml().origin, answer
    facts = NvmlProbe().process([json.dumps(answer)])
    assert [g.name for g in facts.gpus] == ["NVIDIA H100 80GB HBM3"] * 8 and len(facts.gpus[0].active_links) == 18
    assert _without_python(answer) == reference  # every interpreter reads the same facts


# ---- a real H100 (recorded with the command above on a machine with a driver and python3 only) -----

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"


def recorded(name: str) -> list[str]:
    lines: list[str] = json.loads((FIXTURES / f"{name}.json").read_text())["output"]
    return lines


def test_a_real_h100_probed_by_a_python_without_nvidia_ml_py() -> None:
    """The carried pynvml on a real driver reads what the installed one reads on the same machine, and
    what the earlier recording of the same model converted from the driver's own answers says."""
    carried = NvmlProbe().process(recorded("h100-80gb-hbm3-vm-carried"))
    installed = NvmlProbe().process(recorded("h100-80gb-hbm3-vm-installed-pynvml"))
    truth = NvmlProbe().process(recorded("h100-80gb-hbm3-vm"))
    assert carried.ok and carried.packages == {"nvidia-ml-py": None, "vllm": None}
    assert carried.pynvml == "fleet:nvidia-ml-py==13.615.71/pynvml.py" and carried.python == "/tmp/bare/bin/python"
    assert installed.pynvml is not None and installed.pynvml.endswith("site-packages/pynvml.py")
    assert installed.packages["nvidia-ml-py"] == "13.610.43"
    (g,), (h,), (t,) = carried.gpus, installed.gpus, truth.gpus
    assert g == replace(h, power_usage_mw=g.power_usage_mw)  # a live reading; everything else is the same
    assert carried.common_ancestor == installed.common_ancestor and carried.errors == installed.errors
    same = ("name", "memory", "compute_capability", "architecture", "ecc_mode", "persistence", "mig_mode",
            "virtualization_mode", "nvlinks", "nvlink_error", "pcie", "remapped_rows", "power_limit_mw")  # fmt: skip
    assert {k: getattr(g, k) for k in same} == {k: getattr(t, k) for k in same}
    assert (carried.driver_version, carried.cuda_driver_version) == (truth.driver_version, truth.cuda_driver_version)


def test_judging_a_recorded_output_off_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.audit.rules import Expectation
    from tests.fixtures.probe.judge import judge, main

    report = judge(recorded("h100-80gb-hbm3-vm-carried"), "h1", Expectation(1, "h100-sxm-80gb", "0.33.0"), "x")
    assert [(f.rule, f.severity.label, f.gpu) for f in report.findings] == [("nvlink-not-visible-vm", "info", 0)]
    wrong = judge(recorded("h100-80gb-hbm3-vm-carried"), "h1", Expectation(8, "h200-sxm-141gb", None), "x")
    assert {f.rule for f in wrong.findings} >= {"gpu-missing", "gpu-model-mismatch"}
    out = tmp_path / "probe.out"
    out.write_text("\n".join(recorded("h100-80gb-hbm3-vm-carried")) + "\n")
    assert main([str(out), "--sku", "h100-sxm-80gb", "--count", "1", "--json"]) == 0
    (host,) = json.loads(capsys.readouterr().out)["hosts"]
    assert (
        host["pynvml"] == "fleet:nvidia-ml-py==13.615.71/pynvml.py"
        and host["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    )
    assert main([str(out), "--count", "8"]) == 1  # gpu-missing is critical
    assert "gpu-missing" in capsys.readouterr().out


# ---- the code cache (root's own: fleet.facts.nvml, "The code cache") -------------------------------


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A directory whose every parent is root's own and writable by no one else (the cache is
    used only in such a place, and only by root): under /run, removed after the test."""
    if os.geteuid() != 0:
        pytest.skip("the probe's code cache is root's: run as root (as the lab tests are)")
    path = Path(tempfile.mkdtemp(prefix="fleet-code-cache-", dir="/run"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _entry(cache: Path, program: str, name: str, python: str) -> Path:
    """The cache's file for the carried text ``name`` (``PYNVML``, ``PROBE``) under ``python``."""
    values = constants(program)
    origin = str(values["PYNVML_ORIGIN"] if name == "PYNVML" else values["PROGRAM_NAME"])
    asked = "import importlib.util, sys; print(importlib.util.MAGIC_NUMBER.hex(), sys.implementation.cache_tag)"
    magic, tag = subprocess.run([python, "-c", asked], capture_output=True, text=True, check=True).stdout.split()
    key = hashlib.sha256(bytes.fromhex(magic) + origin.encode() + b"\0" + str(values[name]).encode()).hexdigest()
    return cache / f"{tag}-{key}"


def _whole(path: Path) -> bytes:
    """The entry's code (marshal), checked against the sha256 in front of it."""
    data = path.read_bytes()
    assert hashlib.sha256(data[32:]).digest() == data[:32]
    return data[32:]


def _plant(path: Path, source: str, origin: str) -> None:
    """A whole entry of root's holding ``source`` compiled by this Python (as the loader writes one)."""
    code = marshal.dumps(compile(source, origin, "exec"))
    path.write_bytes(hashlib.sha256(code).digest() + code)
    path.chmod(0o600)


CACHED = 'import json, sys\nsys.stdout.write(json.dumps({"schema": 1, "status": "from-the-cache"}) + "\\n")\n'


def test_a_probe_run_as_root_keeps_what_it_compiled_and_uses_only_whole_entries_of_roots(
    root_dir: Path, nvml: dict[str, str]
) -> None:
    """The first run compiles and keeps pynvml and the probe script (files 0600 in directories
    0700 it creates); the next loads them: an entry planted there runs instead of the script. An
    entry that is not root's own (readable by others, another owner, a link), not whole, or in a
    directory others can write is not used: the probe compiles the carried text and answers as
    before (and writes the entry anew, except in the directory it does not trust)."""
    cache = root_dir / "fleet" / "probe-code"
    python = sys.executable
    command = probe_command(python, str(cache))
    program = probe_program(str(cache))
    first = run(command, env=nvml)
    assert first["status"] == "ok" and first["pynvml"] == carried_pynvml().origin, first
    for folder in (root_dir / "fleet", cache):
        assert (folder.stat().st_mode & 0o777, folder.stat().st_uid) == (0o700, 0)
    pynvml_entry, script = _entry(cache, program, "PYNVML", python), _entry(cache, program, "PROBE", python)
    assert sorted(cache.iterdir()) == sorted([pynvml_entry, script])
    for entry, origin in ((pynvml_entry, carried_pynvml().origin), (script, "fleet-nvml-probe")):
        assert (entry.stat().st_mode & 0o777, entry.stat().st_uid) == (0o600, 0)
        assert marshal.loads(_whole(entry)).co_filename == origin
    kept = _whole(script)
    assert run(command, env=nvml) == first  # from the cache: the same answer

    _plant(script, CACHED, "fleet-nvml-probe")
    assert run(command, env=nvml)["status"] == "from-the-cache"  # the entry is what runs

    def untrusted(change: Any) -> None:
        _plant(script, CACHED, "fleet-nvml-probe")
        change()
        assert run(command, env=nvml) == first
        assert not script.is_symlink() and _whole(script) == kept  # written anew
        assert (script.stat().st_mode & 0o777, script.stat().st_uid) == (0o600, 0)

    untrusted(lambda: script.chmod(0o640))
    untrusted(lambda: os.chown(script, 65534, 65534))
    untrusted(
        lambda: script.write_bytes(script.read_bytes()[:-1] + bytes([script.read_bytes()[-1] ^ 0xFF]))
    )  # not whole

    def link() -> None:
        elsewhere = root_dir / "elsewhere"
        os.replace(script, elsewhere)
        script.symlink_to(elsewhere)

    untrusted(link)
    _plant(script, CACHED, "fleet-nvml-probe")
    cache.chmod(0o777)
    assert run(command, env=nvml) == first  # not used, and not written: the directory is not root's own
    assert _whole(script) != kept


def test_a_probe_not_run_as_root_neither_reads_nor_writes_the_cache(root_dir: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run the probe as another user")
    cache = root_dir / "cache"
    cache.mkdir(mode=0o755)
    root_dir.chmod(0o755)
    python = "/usr/bin/python3"
    program = probe_program(str(cache))
    _plant(_entry(cache, program, "PROBE", python), CACHED, "fleet-nvml-probe")

    def as_nobody(command: str) -> dict[str, object]:
        return run(f"setpriv --reuid=65534 --regid=65534 --clear-groups sh -c {shlex.quote(command)}")

    answer = as_nobody(probe_command(python, str(cache)))
    assert answer["status"] != "from-the-cache" and answer["pynvml"] == carried_pynvml().origin, answer
    assert answer == as_nobody(probe_command(python))  # as without the cache
    assert len(list(cache.iterdir())) == 1  # nothing written


@pytest.mark.parametrize("version", ["3.6", "3.11", "3.13"])
def test_the_cache_on_the_oldest_and_newest_pythons(
    version: str, root_dir: Path, nvml: dict[str, str], reference: dict[str, object]
) -> None:
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    command = probe_command(python, str(root_dir / "cache"))
    for _ in range(2):  # compiled and kept, then loaded
        assert _without_python(run(command, env=nvml)) == reference
    program = probe_program(str(root_dir / "cache"))
    assert _entry(root_dir / "cache", program, "PYNVML", python).is_file()
