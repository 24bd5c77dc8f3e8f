"""The lab's package index: a PEP 503 "simple" index on the control machine's 127.0.0.1.

Lab hosts install vLLM the way an air-gapped fleet would, from a mirror:
``pip install --index-url <url> vllm==0.33.0``. The index holds exactly what a deploy needs:

* the lab's vLLM stand-in, built with ``pip wheel --no-deps`` from its source: ``lab/vllm-standin``
  in a fleet checkout, or the same files shipped inside the fleet package as
  ``fleetlab/standin_src`` (so an installed fleet can run ``fleet lab up``); its in-tree build
  backend vendors fleet's vLLM argument surface into the wheel;
* the wheels the stand-in and a deploy need (``DEPLOY_REQUIREMENTS``: nvidia-ml-py,
  prometheus_client, setproctitle), fetched once with ``pip download --no-deps
  --only-binary=:all:`` for the lab hosts' Python (Debian bookworm's 3.11) through this
  machine's own pip configuration (no index host is named here).

Layout under ``<lab_dir>/index/``: ``files/`` (wheels), ``simple/`` (PEP 503 pages with
``#sha256=`` fragments and ``data-requires-python``), ``server.pid``, ``server.port``,
``server.log``. The server is ``python -m http.server`` bound to 127.0.0.1, detached in its own
session so it outlives the caller; lab hosts share the control machine's network namespace and
reach it at 127.0.0.1. ``ensure_index`` is idempotent: it rebuilds only what changed and reuses
a live server.
"""

from __future__ import annotations

import contextlib
import email.parser
import hashlib
import html
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import fleet
from fleet.localfs import atomic_write
from fleet.operations.layout import NVML_PY_REQUIREMENT
from fleetlab.errors import LabError
from fleetlab.locks import file_lock

LAB_DIR = Path(__file__).resolve().parent
FLEET_DIR = Path(fleet.__file__).resolve().parent
REPO_ROOT = LAB_DIR.parent
#: The stand-in's source: the checkout's ``lab/vllm-standin`` or the copy shipped in the package.
CHECKOUT_STANDIN_DIR = REPO_ROOT / "lab" / "vllm-standin"
PACKAGED_STANDIN_DIR = LAB_DIR / "standin_src"
STANDIN_DIR = CHECKOUT_STANDIN_DIR if (CHECKOUT_STANDIN_DIR / "pyproject.toml").is_file() else PACKAGED_STANDIN_DIR
#: Files outside the stand-in's directory that go into its wheel (the vendored surface).
STANDIN_EXTRA_INPUTS = (
    FLEET_DIR / "plan" / "vllm_surface.py",
    FLEET_DIR / "plan" / "data" / "vllm" / "serve-args-0.33.0.json",
)
STANDIN_DIST = "vllm"
#: Third-party wheels a lab deploy installs: the stand-in's dependencies (vLLM 0.33.0 requires
#: ``prometheus_client>=0.18.0`` and ``setproctitle`` too) and fleet's NVML probe's.
DEPLOY_REQUIREMENTS: tuple[str, ...] = (
    NVML_PY_REQUIREMENT,
    "prometheus_client==0.26.0",
    "setproctitle==1.3.8",
)
#: The lab hosts' Python (``python3`` of Debian bookworm, the lab's base): wheels are fetched for it.
HOST_PYTHON = (3, 11)
#: ... and its glibc (bookworm's 2.36): the newest manylinux wheels the hosts can load.
HOST_GLIBC_MINOR = 36
BIND_HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def index_root(lab_dir: Path) -> Path:
    return Path(lab_dir) / "index"


def _locked(root: Path) -> AbstractContextManager[None]:
    """Serialise builders of the same index: one builds, the others wait, then reuse."""
    return file_lock(root / ".lock")


# -- wheels -----------------------------------------------------------------------------------


def _standin_inputs() -> list[Path]:
    def wanted(path: Path) -> bool:
        parts = path.relative_to(STANDIN_DIR).parts  # not the absolute path: a venv may sit under "build/"
        return path.is_file() and "__pycache__" not in parts and "build" not in parts and path.suffix != ".pyc"

    files = [p for p in sorted(STANDIN_DIR.rglob("*")) if wanted(p)]
    return files + list(STANDIN_EXTRA_INPUTS)


def standin_source_hash() -> str:
    """SHA-256 over the stand-in's sources and the vendored surface: one build's identity."""
    digest = hashlib.sha256()
    for path in _standin_inputs():
        rel = path.relative_to(STANDIN_DIR) if path.is_relative_to(STANDIN_DIR) else Path("fleet/plan", path.name)
        digest.update(str(rel).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _run(cmd: Sequence[str], what: str) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
        raise LabError(f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))


def build_standin_wheel(out_dir: Path) -> Path:
    """Build the stand-in's wheel into ``out_dir``; skipped if an identical build is there.

    A stamp file next to the wheel records the source hash. Older stand-in wheels in
    ``out_dir`` are removed so the index offers one build.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / ".vllm-standin.sha256"
    wanted = standin_source_hash()
    # the stand-in's builds only (local label +fleetlab...): not the real engine's alias wheel
    # ``vllm-<version>+cpu`` that shares its name (``fleetlab.real_engine``)
    existing = sorted(out_dir.glob(f"{STANDIN_DIST}-*+fleetlab*.whl"))
    if len(existing) == 1 and stamp.is_file() and stamp.read_text().strip() == wanted:
        return existing[0]
    with tempfile.TemporaryDirectory(prefix="standin-wheel-") as tmp:
        _run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", tmp, str(STANDIN_DIR)],
            "building the vLLM stand-in wheel",
        )
        built = sorted(Path(tmp).glob(f"{STANDIN_DIST}-*.whl"))
        if len(built) != 1:
            raise LabError(f"pip wheel of {STANDIN_DIR} produced {len(built)} wheels, expected 1")
        for old in existing:
            old.unlink()
        target = out_dir / built[0].name
        shutil.move(str(built[0]), target)
    stamp.write_text(wanted + "\n")
    return target


def _wheel_matches(path: Path, requirement: str, python: tuple[int, int]) -> bool:
    name, _, version = requirement.partition("==")
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) < 5 or normalize(parts[0]) != normalize(name) or parts[1] != version:
        return False
    python_tags = parts[-3].split(".")
    return any(tag.startswith("py3") or tag == f"cp{python[0]}{python[1]}" for tag in python_tags)


def _target_args(python: tuple[int, int]) -> list[str]:
    """``pip download`` options that pick wheels for a CPython ``python`` on this architecture."""
    machine = platform.machine()
    tag = f"{python[0]}{python[1]}"
    args = ["--python-version", f"{python[0]}.{python[1]}", "--implementation", "cp", "--abi", f"cp{tag}"]
    args += ["--abi", "abi3", "--abi", "none"]
    # every manylinux tag a host with Debian bookworm's glibc (2.36) installs (PEP 600: glibc 2.x
    # and older), not just the common ones: vLLM's CPU build needs e.g. llguidance's manylinux_2_31
    plats = [f"manylinux_2_{minor}" for minor in range(HOST_GLIBC_MINOR, 4, -1)]
    for plat in (*plats, "manylinux2014", "manylinux2010", "manylinux1"):
        args += ["--platform", f"{plat}_{machine}"]
    return [*args, "--platform", "any"]


def fetch_wheels(
    out_dir: Path, requirements: Sequence[str] = DEPLOY_REQUIREMENTS, python: tuple[int, int] = HOST_PYTHON
) -> list[Path]:
    """Wheels for ``name==version`` requirements, downloaded once into ``out_dir``.

    Uses ``pip download`` with this machine's pip configuration, binary wheels only, no deps
    (the lab's requirements are chosen to have none), for CPython ``python`` (the lab hosts'
    by default; pass ``sys.version_info[:2]`` to install on this machine).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    found: list[Path] = []
    for requirement in requirements:
        if "==" not in requirement:
            raise LabError(f"lab index requirement {requirement!r} must pin a version (name==version)")
        matches = [p for p in out_dir.glob("*.whl") if _wheel_matches(p, requirement, python)]
        if not matches:
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 *_target_args(python), "-d", str(out_dir), requirement],
                f"downloading {requirement}",
            )  # fmt: skip
            matches = [p for p in out_dir.glob("*.whl") if _wheel_matches(p, requirement, python)]
        if not matches:
            raise LabError(f"pip download of {requirement} left no matching wheel in {out_dir}")
        found.extend(sorted(matches))
    return found


# -- PEP 503 tree -----------------------------------------------------------------------------


def _requires_python(wheel: Path) -> str | None:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if not names:
            return None
        meta = email.parser.Parser().parsestr(archive.read(names[0]).decode())
    value = meta.get("Requires-Python")
    return str(value) if value else None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)


def write_simple_tree(root: Path) -> None:
    """(Re)write ``root/simple/`` for the wheels in ``root/files/``."""
    files = root / "files"
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(files.glob("*.whl")):
        projects.setdefault(normalize(wheel.name.split("-")[0]), []).append(wheel)
    simple = root / "simple"
    for stale in simple.glob("*/") if simple.is_dir() else []:
        if stale.is_dir() and stale.name not in projects:
            shutil.rmtree(stale)
    links = "".join(f'    <a href="{name}/">{name}</a><br/>\n' for name in sorted(projects))
    _write(simple / "index.html", f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for name, wheels in projects.items():
        rows = []
        for wheel in wheels:
            with open(wheel, "rb") as f:
                sha = hashlib.file_digest(f, "sha256").hexdigest()
            requires = _requires_python(wheel)
            attr = f' data-requires-python="{html.escape(requires)}"' if requires else ""
            rows.append(f'    <a href="../../files/{wheel.name}#sha256={sha}"{attr}>{wheel.name}</a><br/>\n')
        page = f"<!DOCTYPE html>\n<html><body>\n<h1>Links for {name}</h1>\n{''.join(rows)}</body></html>\n"
        _write(simple / name / "index.html", page)


# -- server -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((BIND_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _url(port: int) -> str:
    return f"http://{BIND_HOST}:{port}/simple/"


def _server_pid(root: Path) -> int | None:
    """The pid of our live index server, checked against its command line (pid reuse)."""
    try:
        pid = int((root / "server.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if b"http.server" in cmdline and str(root).encode() in cmdline:
        return pid
    return None


def _responds(port: int) -> bool:
    try:
        with urllib.request.urlopen(_url(port) + f"{STANDIN_DIST}/", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_server(root: Path, port: int) -> int | None:
    """Start the detached server on ``port``; its pid, or ``None`` if it did not come up."""
    log = open(root / "server.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(port), "--bind", BIND_HOST, "--directory", str(root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        if _responds(port):
            return proc.pid
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    return None


def _stop(root: Path) -> None:
    pid = _server_pid(root)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in ("server.pid", "server.port"):
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()


def link_into(wheels: Sequence[Path], files: Path) -> None:
    """Put ``wheels`` in the index's ``files/`` (hard links where the filesystem allows, else copies)."""
    files.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        target = files / wheel.name
        if target.is_file() and target.stat().st_size == wheel.stat().st_size:
            continue
        tmp = files / f".{wheel.name}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(wheel, tmp)
        except OSError:
            shutil.copyfile(wheel, tmp)
        os.replace(tmp, target)


def ensure_index(lab_dir: Path, port: int | None = None, extra_wheels: Sequence[Path] = ()) -> str:
    """Build what is missing, (re)start the server if needed, and return the index URL.

    ``port``: serve on that port (127.0.0.1); ``None`` keeps the running server's port or picks
    a free one. The URL is ``http://127.0.0.1:<port>/simple/`` (pip's ``--index-url``).
    ``extra_wheels``: served too (the real engine's, ``fleetlab.real_engine``), linked from their cache.
    """
    root = index_root(lab_dir)
    with _locked(root):
        files = root / "files"
        build_standin_wheel(files)
        fetch_wheels(files)
        link_into(extra_wheels, files)
        write_simple_tree(root)
        pid = _server_pid(root)
        if pid is not None:
            try:
                current = int((root / "server.port").read_text().strip())
            except (OSError, ValueError):
                current = None
            if current is not None and (port is None or port == current) and _responds(current):
                return _url(current)
        _stop(root)
        attempts = 1 if port is not None else 5
        for _ in range(attempts):
            chosen = port if port is not None else _free_port()
            pid = _start_server(root, chosen)
            if pid is not None:
                _write(root / "server.pid", f"{pid}\n")
                _write(root / "server.port", f"{chosen}\n")
                return _url(chosen)
        log_tail = (root / "server.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise LabError(
            f"the lab package index did not start on {BIND_HOST}:{port or 'a free port'} "
            f"(see {root / 'server.log'}):\n" + "\n".join(log_tail)
        )


def stop_index(lab_dir: Path) -> None:
    """Stop the index server of ``lab_dir`` (no-op when none runs); the files stay."""
    root = index_root(lab_dir)
    if not root.is_dir():
        return
    with _locked(root):
        _stop(root)
