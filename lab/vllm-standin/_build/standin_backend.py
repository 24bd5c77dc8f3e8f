"""A minimal PEP 517 build backend for the fleet lab's vLLM stand-in.

Why not setuptools: building must work on an air-gapped control machine without fetching a
build backend, and the wheel must carry fleet's vLLM argument surface, which lives outside this
directory (``fleet/plan/vllm_surface.py`` and ``fleet/plan/data/vllm/serve-args-0.33.0.json``), both in
a fleet checkout and in an installed fleet (where this directory is ``fleetlab/standin_src``). This
backend reads ``[project]`` from ``pyproject.toml``, copies every file under ``src/`` into a
pure-Python wheel, and adds the surface under ``vllm/_vendor/`` at build time, so there is one
surface and no hand-written second list. Only the standard library is used.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where fleet's ``plan`` package is: in a fleet checkout the stand-in is ``lab/vllm-standin``;
#: in an installed fleet it is package data at ``fleetlab/standin_src``.
PLAN_DIRS = (ROOT.parent.parent / "fleet" / "plan", ROOT.parent.parent / "plan")
SURFACE_VERSION = "0.33.0"


def _project() -> dict[str, object]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project: dict[str, object] = data["project"]
    return project


def _surface_files() -> dict[str, bytes]:
    """The vendored surface: ``vllm/_vendor/vllm_surface.py`` and its JSON dump.

    ``vllm_surface`` finds its data at ``<module dir>/data/vllm/``, so the JSON goes there and
    the module is copied byte for byte.
    """
    plan = next((d for d in PLAN_DIRS if (d / "vllm_surface.py").is_file()), PLAN_DIRS[0])
    module = plan / "vllm_surface.py"
    data = plan / "data" / "vllm" / f"serve-args-{SURFACE_VERSION}.json"
    if not (module.is_file() and data.is_file()):
        raise FileNotFoundError(
            f"cannot vendor the vLLM argument surface: {module} or {data} is missing "
            "(build the stand-in from a fleet checkout or an installed fleet)"
        )
    return {
        "vllm/_vendor/__init__.py": b'"""Files copied from fleet at build time; do not edit."""\n',
        "vllm/_vendor/vllm_surface.py": module.read_bytes(),
        f"vllm/_vendor/data/vllm/serve-args-{SURFACE_VERSION}.json": data.read_bytes(),
    }


def _source_files() -> dict[str, bytes]:
    src = ROOT / "src"
    files: dict[str, bytes] = {}
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files[path.relative_to(src).as_posix()] = path.read_bytes()
    return files


def _metadata(project: dict[str, object]) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project['description']}",
        f"Requires-Python: {project['requires-python']}",
    ]
    deps = project.get("dependencies", [])
    assert isinstance(deps, list)
    lines += [f"Requires-Dist: {dep}" for dep in deps]
    readme = ROOT / "README.md"
    body = readme.read_text() if readme.is_file() else ""
    return "\n".join(lines) + "\nDescription-Content-Type: text/markdown\n\n" + body


def _entry_points(project: dict[str, object]) -> str:
    scripts = project.get("scripts", {})
    assert isinstance(scripts, dict)
    return "[console_scripts]\n" + "".join(f"{name} = {target}\n" for name, target in scripts.items())


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def get_requires_for_build_wheel(config_settings: object = None) -> list[str]:
    return []


def build_wheel(
    wheel_directory: str, config_settings: object = None, metadata_directory: object = None
) -> str:
    project = _project()
    name, version = str(project["name"]), str(project["version"])
    dist_info = f"{name}-{version}.dist-info"
    files = _source_files()
    files.update(_surface_files())
    files[f"{dist_info}/METADATA"] = _metadata(project).encode()
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: fleet-standin-backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist_info}/entry_points.txt"] = _entry_points(project).encode()
    record_name = f"{dist_info}/RECORD"
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    record += f"{record_name},,\n"
    files[record_name] = record.encode()

    filename = f"{name}-{version}-py3-none-any.whl"
    target = Path(wheel_directory) / filename
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as whl:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, data)
    return filename
