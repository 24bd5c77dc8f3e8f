"""Build the lab's simulated NVML library (``libnvidia-ml.so.1``).

The C source next to this module implements the part of the NVML C ABI that the unmodified
``nvidia-ml-py`` calls; it answers from a profile rendered by :mod:`fleetlab.profiles`. Lab hosts
put the built library where ``dlopen("libnvidia-ml.so.1")`` finds it (``LD_LIBRARY_PATH`` or the
loader cache), so the real probe code runs unchanged against simulated GPUs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakenvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    f"-Wl,-soname,{LIBRARY_NAME}",
)

#: Environment variables the library reads (and their defaults inside a lab host).
PROFILE_ENV = "FLEET_NVML_PROFILE"
STATE_DIR_ENV = "FLEET_NVML_STATE_DIR"
DEFAULT_PROFILE_PATH = Path("/etc/fleet-lab/nvml-profile")
DEFAULT_STATE_DIR = Path("/run/fleet-lab/nvml")


class ShimBuildError(RuntimeError):
    """The simulated NVML library could not be compiled."""


def source_hash() -> str:
    """SHA-256 of the C source and the compiler flags: the identity of one build."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update("\0".join(CFLAGS).encode())
    return digest.hexdigest()


def _find_compiler() -> str:
    """The path of gcc, or a ShimBuildError that says how to get it."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ShimBuildError(
            f"gcc is not installed or not on PATH; it is needed to build {LIBRARY_NAME} "
            f"from {SOURCE} (install it with: apt-get install gcc)"
        )
    return gcc


def build_shim(out_dir: Path) -> Path:
    """Compile the simulated NVML library into ``out_dir/libnvidia-ml.so.1`` and return its path.

    The build is skipped when ``out_dir`` already holds a build of the same source (a stamp file
    records the source hash), so callers may call this on every test session or host boot. The
    library is written to a temporary name and renamed, so a concurrent reader never loads a
    half-written file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY_NAME
    stamp = out_dir / (LIBRARY_NAME + ".sha256")
    wanted = source_hash()
    if library.is_file() and stamp.is_file() and stamp.read_text().strip() == wanted:
        return library
    gcc = _find_compiler()
    fd, tmp_name = tempfile.mkstemp(prefix=".libnvidia-ml.", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run(
            [gcc, *CFLAGS, "-o", tmp_name, str(SOURCE)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise ShimBuildError(f"gcc failed to build {SOURCE} (exit {result.returncode}):\n{result.stderr}")
        os.replace(tmp_name, library)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    stamp.write_text(wanted + "\n")
    return library


__all__ = [
    "DEFAULT_PROFILE_PATH",
    "DEFAULT_STATE_DIR",
    "LIBRARY_NAME",
    "PROFILE_ENV",
    "SOURCE",
    "STATE_DIR_ENV",
    "ShimBuildError",
    "build_shim",
    "source_hash",
]
