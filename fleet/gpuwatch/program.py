"""The GPU watcher as one self-contained file for a host.

The same carrying as the NVML probe (``fleet.facts.nvml.carried_program``): a small loader, the
watcher script (``fleet/gpuwatch/watcher.py``), the XID catalogue (``fleet/gpuwatch/catalog.py``,
imported on the host as ``fleet_gpu_catalog``) and the ``pynvml.py`` of fleet's own nvidia-ml-py,
each compressed, in one Python file the deploy writes to :data:`PROGRAM_PATH` and the unit runs
with the host's ``python3 -I`` (3.6 or newer). Nothing is installed with pip and nothing outside
the file is imported but the standard library: the host's own nvidia-ml-py (or none) never
answers. A Python older than 3.6 exits :data:`TOO_OLD_EXIT` (``EX_CONFIG``), which the unit does
not restart.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fleet.facts.nvml import carried_program

#: Where the deploy puts the program on a host, and the interpreter its unit runs it with.
PROGRAM_PATH = "/usr/local/lib/fleet/fleet-gpu-watch.py"
PYTHON = "/usr/bin/python3"
#: sysexits.h EX_CONFIG: an interpreter too old; the unit's RestartPreventExitStatus.
TOO_OLD_EXIT = 78
CATALOG_MODULE = "fleet_gpu_catalog"


def _source(name: str) -> str:
    return resources.files("fleet.gpuwatch").joinpath(name).read_text()


@cache
def watcher_program() -> str:
    """The file's text (deterministic: the same fleet writes the same bytes, so a deploy that has
    nothing new to write changes nothing)."""
    catalog = _source("catalog.py")
    header = "# fleet GPU watcher, written by fleet deploy: do not edit (fleet/gpuwatch/program.py).\n"
    return header + carried_program(
        _source("watcher.py"),
        "fleet-gpu-watch",
        {CATALOG_MODULE: (f"fleet:{CATALOG_MODULE}.py", catalog.encode())},
        too_old_exit=TOO_OLD_EXIT,
    )
