"""The GPU watcher on a host (``fleet.render.gpuwatch``): its program, record dir, unit, running.

The program and unit are written atomically (``units.installed``: ``daemon-reload`` only when
the unit changed, enabled at boot); the record directory (root-only: ``clears.json`` names who
cleared a GPU) and node_exporter's textfile directory are made if missing; the unit is started,
and restarted only when its program or unit changed. The watcher never touches a GPU, so this
runs on every host in every deploy, whatever the vLLM instances are doing.
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.operations import files, systemd

from fleet.operations import units
from fleet.render.gpuwatch import UNIT_NAME, WatchSettings, watch_files


@deploy("GPU watcher")
def gpu_watcher(settings: WatchSettings | None = None) -> None:
    """Write, enable and run the watcher; restart it only when its program or unit changed."""
    settings = settings or WatchSettings()
    files.directory(name="GPU watcher record dir", path=settings.state_dir, user="root", group="root", mode="0700")
    files.directory(name="node_exporter textfile dir", path=settings.textfile_dir, present=True)
    written = units.installed(name="GPU watcher program and unit", files=watch_files(settings))
    # restart starts a stopped unit too; the running= check after it is then a no-op
    systemd.service(name=f"restart {UNIT_NAME}", service=UNIT_NAME, restarted=True, _if=written.did_change)
    systemd.service(name=f"run {UNIT_NAME}", service=UNIT_NAME, running=True)
