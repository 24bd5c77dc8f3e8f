"""The GPU watcher on a host (``fleet.render.gpuwatch``): its program, record dir, unit, running.

The record directory (root-only: ``clears.json`` names who cleared a GPU) and node_exporter's
textfile directory are made if missing (one command); the program and unit are written
atomically, the unit enabled at boot, and started, or restarted when its program or unit changed
(``units.installed``: one command). The watcher never touches a GPU, so this
runs on every host in every deploy, whatever the vLLM instances are doing.
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy

from fleet.operations import files, units
from fleet.render.gpuwatch import UNIT_NAME, WatchSettings, watch_files


@deploy("GPU watcher")
def gpu_watcher(settings: WatchSettings | None = None) -> None:
    """Write, enable and run the watcher; restart it only when its program or unit changed."""
    settings = settings or WatchSettings()
    files.directories(
        name="GPU watcher record dir",  # and node_exporter's textfile dir, in the same command
        dirs=[files.WantedDir(settings.state_dir, 0o700), files.WantedDir(settings.textfile_dir)],
    )
    units.installed(
        name=f"GPU watcher program and unit, {UNIT_NAME} running", files=watch_files(settings), restart=[UNIT_NAME]
    )
