"""The NVML probe as a pyinfra fact, carrying the pynvml it needs.

``NvmlProbe`` follows pyinfra's own facts (``pyinfra.facts.*``): ``command()`` gives the shell
command, ``process()`` turns its output into a value. The command runs the self-contained probe
script (``fleet/facts/nvml_probe.py``, package data) with the host's own Python, so one SSH round
trip answers everything. It always exits 0 and prints one JSON line, which ``process()`` validates
into :class:`fleet.facts.hostfacts.HostFacts`.

**What travels.** The host needs an NVIDIA driver and a Python 3.6 or newer, nothing else: the
command carries ``pynvml.py``, the one pure-Python module of the nvidia-ml-py distribution
installed in fleet's own environment, byte for byte (checked against the distribution's
``RECORD`` hash; its BSD licence is the file's own header, so it travels with it). The Python
program fed to the interpreter on stdin (:func:`probe_program`) is a small loader plus the probe
script and pynvml, each zlib-compressed and base64-encoded (about 78 kB; pynvml.py alone is
330 kB); nothing is installed on the host (no temporary file, no pip): the loader registers an
importer for ``pynvml`` first on ``sys.meta_path`` (PEP 451, ``importlib.util.spec_from_loader``)
that compiles the carried text in memory.

**The code cache.** Compiling pynvml.py is most of a probe's CPU on the host, every run on every
host (Python 3.11 here: a probe used 0.09-0.11 s of user CPU compiling, 0.03-0.06 s with the cache).
The probes fleet runs (:class:`NvmlProbe`, the rollout's GPU check, ``fleet status``'s host probe)
keep what they compiled in :data:`CODE_CACHE` when they run as root, as CPython keeps bytecode in
``__pycache__`` (PEP 3147): one file per carried text and bytecode version (named by
``importlib.util.MAGIC_NUMBER``, the interpreter's cache tag and the sha256 of the carried text),
holding the ``marshal``-ed code object after its own sha256. An entry is used only when whole (its
sha256 matches) and root's own: the file regular, owned by root, mode 0600, opened without following
a link, and every directory from ``/`` down to it owned by root and writable by no one else (the
cache is created 0700); anything else is compiled as before and the entry written anew (atomically:
a new file renamed over the old). It trusts no one the probe did not trust already: only root can
write an entry, and root can change the Python that runs the probe anyway. It keeps
:data:`CODE_CACHE_KEEP` entries (pynvml and the probe script per Python version), the oldest
removed. ``python -m fleet.facts.nvml`` prints the command without it.

**Which pynvml answers.** Always the carried one, also on a deployed host whose release venv has
its own nvidia-ml-py, and in the rollout executor's GPU check: ``import pynvml`` consults the
finders on ``sys.meta_path`` in order and the carried one is first, so no pynvml on the host's
``sys.path`` (nvidia-ml-py of another version, or the unrelated ``pynvml`` package of older
releases) is ever imported. One definition: every probe of every host reads NVML through the
same code, the version fleet was tested with, whatever each host has installed. The probe
reports it (``pynvml``: the import spec's origin); the host's own nvidia-ml-py and vLLM versions
are still reported under ``packages``.

**Which Python.** The first of :data:`DEFAULT_PYTHONS` that exists: the deployed release's venv
(its ``site-packages`` tells the probe the vLLM version), else ``python3``. It runs with ``-E``
(no ``PYTHONPATH`` or ``PYTHONHOME`` from the login environment) and the loader drops the working
directory from ``sys.path`` before importing anything, so a file in the SSH user's home cannot
stand in for a module of the standard library. A Python older than 3.6 (or a Python 2 given as
``python``) answers status ``python-too-old``; none at all answers ``no-python``; both name the
interpreter and the way out.

**Size.** The command travels as one argument (``sh -c CMD`` on the host, ``sudo ... sh -c CMD``
where it runs as root); Linux refuses a single argument over ``MAX_ARG_STRLEN`` (32 pages,
131072 bytes, ``include/uapi/linux/binfmts.h``), so :func:`probe_command` refuses to build one
over :data:`COMMAND_LIMIT`.

**Run it without fleet on the host.** ``python -m fleet.facts.nvml [--python PATH] > probe.sh``
writes the exact command fleet sends, less the code cache; ``sh probe.sh`` on any machine with a driver and python3
prints the probe's JSON (docs/audit.md).

**Example:**

.. code:: python

    facts = host.get_fact(NvmlProbe)
    facts.status, [g.name for g in facts.gpus]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shlex
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.facts.hostfacts import SCHEMA, HostFacts, parse_probe_output

#: Interpreters tried in order when none is given: the release of vLLM fleet deployed (its
#: site-packages gives the vLLM version), the venv of older layouts, then the system's python3.
DEFAULT_PYTHONS = ("/opt/fleet/vllm/current/bin/python", "/opt/fleet/vllm/bin/python", "python3")
#: The oldest Python the probe runs on (Ubuntu 18.04's python3); older ones answer ``python-too-old``.
MIN_PYTHON = (3, 6)
#: The distribution whose ``pynvml.py`` the probe carries.
PYNVML_DISTRIBUTION = "nvidia-ml-py"
#: Linux's ``MAX_ARG_STRLEN`` (131072) less room for the wrapping (``sudo``, quoting, other facts
#: sharing the command): the most one probe command may be.
COMMAND_LIMIT = 120_000
#: Where a probe run as root keeps the carried modules compiled (the loader's ``_compiled``), on
#: the host; the entries it keeps there at most.
CODE_CACHE = "/var/cache/fleet/probe-code"
CODE_CACHE_KEEP = 8
_END = "FLEET_NVML_PROBE_EOF"

#: Runs first on the host. Parses (and answers) on any Python, 2.7 included, up to the version
#: check; everything newer than that is inside the carried texts, compiled after it.
_LOADER = """\
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # the program comes from stdin: never import from the working directory
if sys.version_info < MIN_PYTHON:
    import json
    found = "%d.%d.%d" % tuple(sys.version_info[:3])
    message = "%s is Python %s; the probe needs %d.%d or newer" % ((sys.executable, found) + MIN_PYTHON)
    answer = {"schema": SCHEMA, "status": "python-too-old", "python": sys.executable, "python_version": found,
              "error": {"class": "PythonTooOld", "message": message}}
    sys.stdout.write("\\n" + json.dumps(answer) + "\\n")
    sys.exit(TOO_OLD_EXIT)
import base64
import zlib
from importlib.util import spec_from_loader


def _text(blob):
    return zlib.decompress(base64.b64decode(blob)).decode("utf-8")


class CarriedModules(object):
    \"\"\"Finder and loader (PEP 451) of the modules sent with the probe, compiled in memory.\"\"\"

    def __init__(self, modules):
        self.modules = modules  # name -> (origin, blob)

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        return spec_from_loader(name, self, origin=self.modules[name][0])

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        origin, blob = self.modules[module.__name__]
        exec(compile(_text(blob), origin, "exec"), module.__dict__)

    def get_source(self, name):
        return _text(self.modules[name][1])


sys.meta_path.insert(0, CarriedModules(dict({"pynvml": (PYNVML_ORIGIN, PYNVML)}, **CARRIED)))
exec(compile(_text(PROBE), PROGRAM_NAME, "exec"), {"__name__": "__main__"})
"""

#: The loader's code cache (``code_cache``, see the module's docstring): defined before the
#: finder, whose two ``compile`` calls it takes over; a program without a cache (the GPU
#: watcher's) is the loader alone, byte for byte as before the cache.
_CACHE = """\
def _root_only(st, kind):
    import stat
    return kind(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def _code_cache():
    \"\"\"CODE_CACHE, created 0700 where missing, when this process is root and every directory from /
    down to it is root's own (owned by root, no link, writable by no one else); else None.\"\"\"
    import os
    import stat
    if not CODE_CACHE or os.geteuid() != 0:
        return None
    path = "/"
    for part in [""] + CODE_CACHE.strip("/").split("/"):
        path = os.path.join(path, part)
        if not os.path.lexists(path):
            os.mkdir(path, 0o700)
        if not _root_only(os.lstat(path), stat.S_ISDIR):
            return None
    return path


def _cached(path):
    import hashlib
    import marshal
    import os
    import stat
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not _root_only(st, stat.S_ISREG) or st.st_mode & 0o077:
            return None
        data = f.read()
    if hashlib.sha256(data[32:]).digest() != data[:32]:
        return None
    return marshal.loads(data[32:])


def _store(path, code):
    import hashlib
    import marshal
    import os
    payload = marshal.dumps(code)
    part = "%s.%d" % (path, os.getpid())
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(payload).digest() + payload)
        os.rename(part, path)
    finally:
        if os.path.lexists(part):
            os.unlink(part)
    folder = os.path.dirname(path)
    kept = sorted((os.path.join(folder, n) for n in os.listdir(folder)), key=os.path.getmtime)
    for old in kept[:-CODE_CACHE_KEEP]:
        os.unlink(old)


def _compiled(origin, blob):
    \"\"\"The carried text compiled, through the code cache where there is one (CODE_CACHE): an entry
    is named by the interpreter's bytecode version and the carried text, holds the code object
    (marshal) after its sha256, and is used only when root's own and whole.\"\"\"
    import hashlib
    import os
    from importlib.util import MAGIC_NUMBER
    try:
        folder = _code_cache()
    except Exception:
        folder = None
    path = None
    if folder is not None:
        key = hashlib.sha256(MAGIC_NUMBER + origin.encode("utf-8") + b"\\0" + blob.encode("ascii")).hexdigest()
        path = os.path.join(folder, "%s-%s" % (sys.implementation.cache_tag, key))
        try:
            code = _cached(path)
        except Exception:
            code = None
        if code is not None:
            return code
    code = compile(_text(blob), origin, "exec")
    if path is not None:
        try:
            _store(path, code)
        except Exception:
            pass
    return code
"""
_COMPILES = (
    ('compile(_text(blob), origin, "exec")', "_compiled(origin, blob)"),
    ('compile(_text(PROBE), PROGRAM_NAME, "exec")', "_compiled(PROGRAM_NAME, PROBE)"),
)


def _loader(code_cache: str | None) -> str:
    """The loader, with the code cache where there is one."""
    if code_cache is None:
        return _LOADER
    loader = _LOADER
    for plain, cached in _COMPILES:
        loader = loader.replace(plain, cached)
    return loader.replace("class CarriedModules(object):", _CACHE + "\n\nclass CarriedModules(object):")


@dataclass(frozen=True)
class CarriedModule:
    """A pure-Python module of fleet's own environment, sent with the probe."""

    name: str  #: the import name: ``pynvml``
    distribution: str
    version: str
    path: Path  #: where it is installed here
    text: bytes  #: the file, byte for byte

    @property
    def origin(self) -> str:
        """The import spec's origin on the host (what the probe reports as its ``pynvml``)."""
        return f"fleet:{self.distribution}=={self.version}/{self.name}.py"


def _record_hash(data: bytes) -> str:
    """A file's hash as wheel ``RECORD`` files write it (PEP 376/427: urlsafe base64, no padding)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def carried_module(dist: metadata.Distribution, name: str = "pynvml") -> CarriedModule:
    """The module ``name`` of an installed distribution, read byte for byte and checked against the
    distribution's ``RECORD`` hash (a file changed after installation is refused)."""
    label = f"{dist.metadata['Name']} {dist.version}"
    how = f"reinstall it in fleet's environment ({sys.prefix}): pip install --force-reinstall {PYNVML_DISTRIBUTION}"
    entry = next((f for f in dist.files or () if str(f) == f"{name}.py"), None)
    if entry is None:
        raise FleetError(f"{label} lists no {name}.py: {how}")
    path = Path(str(dist.locate_file(entry)))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FleetError(f"cannot read {path} of {label} ({exc.strerror}): {how}") from None
    recorded = f"{entry.hash.mode}={entry.hash.value}" if entry.hash is not None else None
    if recorded is not None and recorded != _record_hash(data):
        raise FleetError(f"{path} is not the file {label} installed (its RECORD hash differs): {how}")
    return CarriedModule(name, str(dist.metadata["Name"]), dist.version, path, data)


@cache
def carried_pynvml() -> CarriedModule:
    """``pynvml.py`` of the nvidia-ml-py installed with fleet: what every probe carries."""
    try:
        dist = metadata.distribution(PYNVML_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FleetError(
            f"{PYNVML_DISTRIBUTION} is not installed in fleet's environment ({sys.prefix}): install fleet with "
            "its dependencies (pip install -e .)"
        ) from None
    return carried_module(dist)


@cache
def probe_script() -> str:
    """The probe script's text (shipped with fleet as package data)."""
    return resources.files("fleet.facts").joinpath("nvml_probe.py").read_text()


def _blob(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 6)).decode()  # level 9: 2% smaller, 5x the time


def carried_program(
    script: str,
    name: str,
    modules: Mapping[str, tuple[str, bytes]] | None = None,
    too_old_exit: int = 0,
    code_cache: str | None = None,
) -> str:
    """A self-contained Python program: the loader, ``script`` (run as ``__main__``, its code
    object named ``name``), the carried pynvml and ``modules`` (import name -> (origin, text)),
    each compressed and base64-encoded, so no quoting or here-document issue. The NVML probe is one;
    the GPU watcher (``fleet.gpuwatch.program``) is another. An interpreter older than
    :data:`MIN_PYTHON` prints the probe protocol's ``python-too-old`` answer and exits ``too_old_exit``.
    ``code_cache``: a directory where the program, run as root, keeps what it compiled (see the
    module's docstring); None: it compiles every carried text each time it runs."""
    pynvml = carried_pynvml()
    carried = {k: (origin, _blob(text)) for k, (origin, text) in (modules or {}).items()}
    constants = (
        f"SCHEMA = {SCHEMA!r}\nMIN_PYTHON = {MIN_PYTHON!r}\nTOO_OLD_EXIT = {too_old_exit!r}\n"
        f"PYNVML_ORIGIN = {pynvml.origin!r}\nPYNVML = {_blob(pynvml.text)!r}\nCARRIED = {carried!r}\n"
        f"PROGRAM_NAME = {name!r}\nPROBE = {_blob(script.encode())!r}\n"
    )
    if code_cache is None:
        return constants + _LOADER
    return constants + f"CODE_CACHE = {code_cache!r}\nCODE_CACHE_KEEP = {CODE_CACHE_KEEP!r}\n" + _loader(code_cache)


@cache
def probe_program(code_cache: str | None = None) -> str:
    """The Python program the host's interpreter reads on stdin: the loader, the probe script and
    the carried pynvml (:func:`carried_program`); ``code_cache``: see there."""
    program = carried_program(probe_script(), "fleet-nvml-probe", code_cache=code_cache)
    if _END in program:  # pragma: no cover - guards the here-document
        raise RuntimeError(f"the probe program contains the here-document terminator {_END}")
    return program


def probe_command(python: str | None = None, code_cache: str | None = None) -> str:
    """The shell command that runs the probe: the first interpreter found, the program on stdin
    (``code_cache``: where the program keeps what it compiled when it runs as root,
    :data:`CODE_CACHE` for fleet's own probes; None: nowhere)."""
    candidates = (python,) if python else DEFAULT_PYTHONS
    pick = " ".join(shlex.quote(c) for c in candidates)
    no_python = json.dumps(
        {"schema": SCHEMA, "status": "no-python",
         "error": {"class": "NoPython", "message": f"none of: {' '.join(candidates)} found"}}
    )  # fmt: skip
    command = (
        f'PY=; for c in {pick}; do if command -v "$c" >/dev/null 2>&1; then PY=$c; break; fi; done; '
        f"if [ -z \"$PY\" ]; then printf '%s\\n' {shlex.quote(no_python)}; exit 0; fi; "
        f"\"$PY\" -E - <<'{_END}'\n{probe_program(code_cache)}{_END}\n"
    )
    if len(command.encode()) > COMMAND_LIMIT:  # pragma: no cover - a bigger pynvml than any so far
        raise RuntimeError(
            f"the NVML probe command is {len(command.encode())} bytes, over {COMMAND_LIMIT}: one shell argument "
            "on the host can hold 131072"
        )
    return command


class NvmlProbe(FactBase[HostFacts]):
    """
    GPUs, NVLink, PCIe, driver and health of a host through NVML (pynvml carried with the probe).

    + python: the interpreter, Python 3.6+ (default: fleet's vLLM venv, else ``python3``)
    + code_cache: where the probe, run as root, keeps what it compiled (None: nowhere)
    """

    def command(self, python: str | None = None, code_cache: str | None = CODE_CACHE) -> str:
        return probe_command(python, code_cache)

    def process(self, output: list[str]) -> HostFacts:
        return parse_probe_output(output)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m fleet.facts.nvml [--python PATH] [--program]``: print the probe command."""
    parser = argparse.ArgumentParser(
        prog="python -m fleet.facts.nvml",
        description="Print the exact shell command fleet runs on a host to probe its GPUs (run it there "
        "with sh: it needs an NVIDIA driver and Python 3.6+, nothing else).",
    )
    parser.add_argument("--python", help="the interpreter on that host (default: fleet's venv, else python3)")
    parser.add_argument(
        "--program", action="store_true", help="print the Python program instead (feed it to python3 -E - on stdin)"
    )
    args = parser.parse_args(argv)
    sys.stdout.write(probe_program() if args.program else probe_command(args.python))


if __name__ == "__main__":
    main()
