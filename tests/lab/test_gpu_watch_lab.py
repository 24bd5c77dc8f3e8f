"""The GPU watcher on a lab host, under the host's real systemd, with the shared session lab.

The watcher's program and hardened unit (exactly what ``fleet deploy`` writes:
``fleet.render.gpuwatch.watch_files``) run on the 8x H100 PCIe host; a fault is injected into the
simulated NVML (XID 79 on GPU 2, through the library's events file); then, all through fleet's own
code over SSH: the watcher records and exports it, the ``GpuWatchState`` fact sees GPU 2
quarantined, the rollout's read of events since a unit started sees it on GPU 2 only, ``fleet
plan`` plans the host around GPU 2, and ``fleet gpu clear`` lifts the quarantine (kept with who
and why). The unit and its files are removed at the end, pass or fail.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.facts.runner import SshTarget, run_command, targets_from_inventory
from fleet.gpuwatch.state import GpuWatchState, WatchState, parse_since_start, parse_watch_state, since_start_argv
from fleet.gpuwatch.watcher import TEXTFILE
from fleet.inventory.load import load_pyinfra_inventory
from fleet.render.gpuwatch import STATE_DIR, TEXTFILE_DIR, UNIT_NAME, watch_files
from fleetlab.hostfiles import NVML_STATE_DIR
from fleetlab.nvml.faults import EVENTS_FILE, fault_line
from tests.lab.conftest import LabFleet
from tests.lab.polling import wait_for

PROFILE = "h100-pcie-8-bridged"


def sh(target: SshTarget, command: str, timeout: float = 60.0) -> str:
    rc, out, err = run_command(target, command, timeout)
    assert rc == 0, f"{command[:200]}: exit {rc}: {err[-500:]}"
    return out


def put(target: SshTarget, path: str, content: str, mode: int) -> None:
    data = base64.b64encode(content.encode()).decode()
    directory = os.path.dirname(path)
    sh(target, f"echo {data} | base64 -d | sudo -n install -D -m {mode:o} /dev/stdin {shlex.quote(path)}"
               f" && sudo -n test -d {shlex.quote(directory)}")  # fmt: skip


def fleet_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], capture_output=True, text=True, check=False)


def quarantined_series(target: SshTarget) -> dict[str, str]:
    """``fleet_gpu_quarantined`` of the exported textfile: gpu label -> value."""
    out = {}
    for m in sh(target, f"cat {TEXTFILE_DIR}/{TEXTFILE}").splitlines():
        if m.startswith("fleet_gpu_quarantined{"):
            out[m.split('gpu="', 1)[1].split('"', 1)[0]] = m.rsplit(" ", 1)[1]
    return out


def state(target: SshTarget) -> WatchState:
    _rc, out, _err = run_command(target, GpuWatchState().command(), 30.0)
    return parse_watch_state(out.splitlines())


@pytest.fixture(scope="module")
def watched(lab_fleet: LabFleet) -> Iterator[SshTarget]:
    inventory = lab_fleet.opts.inventory
    host = next(h for h in lab_fleet.state.hosts if h.profile == PROFILE)
    (target,) = targets_from_inventory(load_pyinfra_inventory(str(inventory)), [host.name])
    try:
        sh(target, f"sudo -n install -d -m 0700 {STATE_DIR} && sudo -n install -d -m 0755 {TEXTFILE_DIR}")
        for f in watch_files():
            put(target, f.path, f.content, f.mode)
        sh(target, f"sudo -n systemctl daemon-reload && sudo -n systemctl start {UNIT_NAME}")
        assert wait_for(lambda: state(target).ok and len(state(target).gpus) == 8, timeout=60, step=0.5), sh(
            target,
            f"sudo -n systemctl status --no-pager {UNIT_NAME}; "
            f"sudo -n journalctl -u {UNIT_NAME} --no-pager | tail -30; true",
        )
        yield target
    finally:
        run_command(target, f"sudo -n systemctl stop {UNIT_NAME}; sudo -n rm -rf {STATE_DIR} "
                            f"{TEXTFILE_DIR}/{TEXTFILE} /etc/systemd/system/{UNIT_NAME} "
                            f"{watch_files()[0].path}; sudo -n systemctl daemon-reload", 60.0)  # fmt: skip


@pytest.mark.lab
def test_the_unit_runs_hardened_under_systemd(watched: SshTarget) -> None:
    shown = sh(
        watched,
        f"systemctl show -p ActiveState,SubState,User,Nice,CPUQuotaPerSecUSec,MemoryMax,PrivateNetwork {UNIT_NAME}",
    )
    props = dict(line.split("=", 1) for line in shown.split())
    assert (props["ActiveState"], props["SubState"]) == ("active", "running")
    assert props["Nice"] == "19" and props["PrivateNetwork"] == "yes" and props["MemoryMax"] == str(96 * 2**20)
    assert all(g.events == () for g in state(watched).gpus)  # nothing recorded before a fault


@pytest.mark.lab
def test_an_xid_79_on_gpu_2_is_recorded_exported_quarantined_planned_around_and_cleared(
    watched: SshTarget, lab_fleet: LabFleet, tmp_path: Path
) -> None:
    line = fault_line(2, "xid", 79, time.time())
    sh(watched, f"printf '%s\\n' {shlex.quote(line)} >> {NVML_STATE_DIR}/{EVENTS_FILE}")
    assert wait_for(lambda: set(state(watched).quarantined()) == {2}, timeout=30, step=0.25)
    (event,) = state(watched).quarantined().values()
    assert (event.kind, event.xid, event.action) == ("xid", 79, "reboot")
    assert wait_for(lambda: quarantined_series(watched) == {**{str(i): "0" for i in range(8)}, "2": "1"}, timeout=20)
    exported = sh(watched, f"cat {TEXTFILE_DIR}/{TEXTFILE}")
    assert 'xid="79"' in exported and "fleet_gpu_watch_up 1" in exported

    # the rollout gate's read: events on the instance's GPUs since its unit started
    def since(gpu: int) -> tuple[str, list[tuple[int, int | None]]]:
        status, events = parse_since_start(sh(watched, "sudo -n " + shlex.join(since_start_argv(UNIT_NAME, [gpu]))))
        return status, [(g, e.xid) for g, e in events]

    assert since(2) == ("ok", [(2, 79)]) and since(3) == ("ok", [])

    # fleet plan plans the host around GPU 2 (the real command, as a subprocess)
    planned = fleet_cli("plan", str(lab_fleet.opts.inventory), "--limit", watched.name, "--json")
    assert planned.returncode == 0, planned.stderr
    (mine,) = [h for h in json.loads(planned.stdout)["hosts"] if h["host"] == watched.name]
    gpus = [g for i in mine["instances"] for g in i["gpus"]]
    assert gpus and 2 not in gpus, mine

    why = "reseated the riser"
    journal = str(tmp_path / "j.sqlite")  # fleet's journal: the clear is kept there too, never in $HOME
    cleared = fleet_cli("gpu", "clear", str(lab_fleet.opts.inventory), watched.name, "2", "--why", why,
                        "--journal", journal)  # fmt: skip
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared of XID 79 (reboot)" in cleared.stdout and why in cleared.stdout
    listed = fleet_cli("history", "--journal", journal, "--json")
    (entry,) = json.loads(listed.stdout)["rollouts"]
    assert (entry["kind"], entry["status"]) == ("gpu-clear", "done") and why in entry["reason"], entry
    assert f"journaled as {entry['id']}" in cleared.stdout
    assert state(watched).quarantined() == {}
    assert wait_for(lambda: quarantined_series(watched).get("2") == "0", timeout=20, step=0.5)
    again = fleet_cli("gpu", "clear", str(lab_fleet.opts.inventory), watched.name, "2", "--why", why,
                      "--journal", journal)  # fmt: skip
    assert again.returncode == 2 and "GPU 2 is not quarantined" in again.stderr
    unknown = fleet_cli("gpu", "clear", str(lab_fleet.opts.inventory), watched.name, "9", "--why", why,
                        "--journal", journal)  # fmt: skip
    assert unknown.returncode == 2 and "GPU 9 is not in the watcher's record" in unknown.stderr
    assert len(json.loads(fleet_cli("history", "--journal", journal, "--json").stdout)["rollouts"]) == 1

    # a corrupt clears.json (it keeps who cleared what): its GPUs count as never cleared, and the
    # clear refuses to write over it (exit 1: the host's state), naming the way out
    clears = f"{STATE_DIR}/clears.json"
    sh(watched, f"sudo -n cp -p {clears} {clears}.good && echo '{{half' | sudo -n tee {clears} >/dev/null")
    try:
        assert set(state(watched).quarantined()) == {2}
        refused = fleet_cli("gpu", "clear", str(lab_fleet.opts.inventory), watched.name, "2", "--why", why,
                            "--journal", journal)  # fmt: skip
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"host {watched.name}: clears.json is not JSON" in refused.stderr
        assert "fleet does not write over it; nothing was cleared" in refused.stderr
        assert sh(watched, f"sudo -n cat {clears}").strip() == "{half"
    finally:
        sh(watched, f"sudo -n mv -f {clears}.good {clears}")
    assert state(watched).quarantined() == {}
    assert len(json.loads(fleet_cli("history", "--journal", journal, "--json").stdout)["rollouts"]) == 1
