"""``fleet gpu clear``: the decision (pure) and the host-side write, on records the watcher's own
``Record`` class wrote, read back through the fact's command and the watcher's clear rule."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from fleet.gpuwatch.clear import ClearRefused, clear_entry, write_command
from fleet.gpuwatch.state import WatchState, parse_watch_state, watch_command
from fleet.gpuwatch.watcher import Record, cleared_through, read_clears, read_machine_id, textfile

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(4)]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the fact's command and the write run as root")
    r = Record(str(tmp_path), read_machine_id(), "h", 1000.0)
    for i, uuid in enumerate(UUIDS):
        r.gpu(uuid, i, f"00000000:{0x18 + i:02X}:00.0", "NVIDIA H100 80GB HBM3", "nvml")
    r.add(UUIDS[2], "xid", 79, 1001.0, "nvml")
    r.add(UUIDS[1], "sbe", None, 1002.0, "nvml")
    r.save(1003.0)
    return tmp_path


def read(state_dir: Path) -> WatchState:
    out = subprocess.run(["sh", "-c", watch_command(str(state_dir))], capture_output=True, text=True, check=True)
    return parse_watch_state(out.stdout.splitlines())


def write(command: str) -> None:
    argv = shlex.split(command)
    assert argv[:2] == ["sudo", "-n"]
    subprocess.run(argv[2:], check=True, capture_output=True)  # root already


@pytest.mark.parametrize(
    ("gpu", "words"),
    [
        (7, "GPU 7 is not in the watcher's record (GPUs it watches: 0, 1, 2, 3); nothing was cleared"),
        (1, "GPU 1 is not quarantined (no critical event since its last clear); nothing was cleared"),
    ],
)
def test_what_cannot_be_cleared_is_refused(state_dir: Path, gpu: int, words: str) -> None:
    with pytest.raises(ClearRefused, match="host gpu-3: " + words.replace("(", r"\(").replace(")", r"\)")):
        clear_entry(read(state_dir), "gpu-3", gpu, "ops@ctl", "reseated", 2000.0)


def test_an_unreadable_record_is_said() -> None:
    with pytest.raises(Exception, match=r"host h: the GPU watcher's record cannot be read \(foreign: cloned\)"):
        clear_entry(WatchState("foreign", "cloned"), "h", 0, "ops@ctl", "x", 1.0)


def test_a_clear_is_kept_with_who_and_why_and_lifts_the_quarantine(state_dir: Path) -> None:
    before = read(state_dir)
    assert set(before.quarantined()) == {2}
    clears, text = clear_entry(before, "gpu-3", 2, "ops@ctl", "reseated the riser", 2000.0)
    assert text.startswith(f"GPU 2 ({UUIDS[2]}) cleared of XID 79 (reboot)") and text.endswith(
        "by ops@ctl: reseated the riser"
    )
    write(write_command(clears, text, str(state_dir)))
    assert (state_dir / "clears.json").stat().st_mode & 0o777 == 0o600
    after = read(state_dir)
    assert after.quarantined() == {}
    (entry,) = json.loads((state_dir / "clears.json").read_text())["gpus"][UUIDS[2]]
    assert entry["by"] == "ops@ctl" and entry["why"] == "reseated the riser" and entry["through_seq"] == before.seq
    # the watcher itself reads the clear: its export says the GPU is no longer quarantined
    record = json.loads((state_dir / "record.json").read_text())
    assert cleared_through(read_clears(str(state_dir)), record["record_id"], UUIDS[2]) == before.seq
    assert 'fleet_gpu_quarantined{gpu="2",uuid="' + UUIDS[2] + '"} 0' in textfile(
        record, read_clears(str(state_dir)), True, 1.0
    )
    # a second clear of the same GPU is refused: nothing to clear
    with pytest.raises(ClearRefused):
        clear_entry(after, "gpu-3", 2, "ops@ctl", "again", 2001.0)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["nohost", "2", "--why", "reseated"], "--limit='nohost': matches no host or group; hosts: h1"),
        (["h1", "2", "--why", "   "], "--why '   ':"),
        (["h1", "-1", "--why", "x"], "-1"),
    ],
)
def test_the_command_refuses_bad_input_before_any_host_is_touched(tmp_path: Path, args: list[str], words: str) -> None:
    from click.testing import CliRunner

    from fleet.cli import main

    rows = [("h1", {"model": "meta-llama/Llama-3.1-8B-Instruct", "ssh_hostname": "127.0.250.3",
                    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5,
                                 "target_concurrency": 8}})]  # fmt: skip
    inventory = tmp_path / "fleet.py"
    inventory.write_text(f"gpus = {rows!r}\n")
    result = CliRunner().invoke(main, ["gpu", "clear", str(inventory), *args])
    assert result.exit_code == 2, result.output
    assert words in result.output
