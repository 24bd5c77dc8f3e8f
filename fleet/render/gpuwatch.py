"""The GPU watcher's files on a host: the carried program and its hardened systemd unit (pure).

The program is :func:`fleet.gpuwatch.program.watcher_program` (the watcher, the XID catalogue and
fleet's own pynvml in one file, run by the host's ``python3 -I``); the unit is
``templates/fleet-gpu-watch.service.j2``: root (NVML's device nodes, the kernel log through
``journalctl --dmesg``) with every capability dropped, no network (``PrivateNetwork=``), a
read-only system but for its record and the textfile directory, ``Nice=19``, idle I/O class and
CPU, memory and task caps (``systemd.exec(5)``, ``systemd.resource-control(5)``), so it never
takes what the vLLM engine on the same host needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.escape import check_host_path
from fleet.gpuwatch.program import PROGRAM_PATH, PYTHON, TOO_OLD_EXIT, watcher_program
from fleet.render.units import RenderedFile, _environment

UNIT_NAME = "fleet-gpu-watch.service"
STATE_DIR = "/var/lib/fleet/gpu-watch"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


@dataclass(frozen=True)
class WatchSettings:
    """Where the watcher keeps its record and writes its textfile, and what it may use."""

    state_dir: str = STATE_DIR
    textfile_dir: str = TEXTFILE_DIR
    unit_dir: str = "/etc/systemd/system"
    cpu_quota_percent: int = 5
    memory_max_mib: int = 96

    def __post_init__(self) -> None:
        for path in (self.state_dir, self.textfile_dir, self.unit_dir):
            check_host_path(path)
        if not 1 <= self.cpu_quota_percent <= 100:
            raise ValueError(f"cpu_quota_percent {self.cpu_quota_percent}: 1 to 100")
        if not 32 <= self.memory_max_mib <= 4096:
            raise ValueError(f"memory_max_mib {self.memory_max_mib}: 32 to 4096")


def watch_unit(settings: WatchSettings | None = None) -> RenderedFile:
    settings = settings or WatchSettings()
    content = (
        _environment()
        .get_template("fleet-gpu-watch.service.j2")
        .render(
            python=PYTHON,
            program=PROGRAM_PATH,
            state_dir=settings.state_dir,
            textfile_dir=settings.textfile_dir,
            too_old_exit=TOO_OLD_EXIT,
            cpu_quota_percent=settings.cpu_quota_percent,
            memory_max_mib=settings.memory_max_mib,
        )
    )
    return RenderedFile(f"{settings.unit_dir}/{UNIT_NAME}", content, 0o644)


def watch_files(settings: WatchSettings | None = None) -> list[RenderedFile]:
    """The program (root-owned, 0644: nothing secret in it) and its unit."""
    settings = settings or WatchSettings()
    return [RenderedFile(PROGRAM_PATH, watcher_program(), 0o644), watch_unit(settings)]
