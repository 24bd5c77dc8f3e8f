"""What carrying pynvml costs the NVML probe: bytes sent and wall time, on a lab host.

    sudo .venv/bin/python benchmarks/probe_carry.py [--runs 20] [--profile h100-sxm-8]

Brings up its own one-host lab (name ``pcbench``; taken down at the end), installs nvidia-ml-py
in a venv on the host from the lab's index (what a deployed release has), and runs, each
``--runs`` times, over a fresh SSH connection as fleet does (``fleet.facts.runner.run_command``):

* ``before``: the probe as fleet ran it before it carried pynvml: the script alone on stdin of a
  Python with nvidia-ml-py installed (the release venv's);
* ``carried, python3``: today's command on the host's python3, which has no nvidia-ml-py (a host
  fleet has not deployed);
* ``carried, venv``: today's command on the venv's python (a deployed host: the carried pynvml
  answers, the installed one is not imported).

For each: the command's size, the median and 90th percentile of the whole round trip (connect,
send, run, read) and of the run alone on the host (``date +%s%N`` around it).

Measured on the 2-core development machine while other work ran on it (load average 7-9),
h100-sxm-8 profile, 30 runs round robin (median, p90):

    case                                     bytes  trip p50  trip p90  host p50  host p90
    before (script only, venv's pynvml)      18322    0.248s    0.354s    0.096s    0.189s
    carried, python3 (no nvidia-ml-py)       77859    0.324s    0.570s    0.153s    0.403s
    carried, venv's python                   77911    0.316s    0.511s    0.161s    0.329s

(An earlier run at load ~4.8: 0.164 / 0.264 / 0.256 s on the host.) Carrying costs 60-100 ms of
the host's CPU here (compiling the 330 kB pynvml.py in memory, where an installed copy has its
.pyc) and 60 kB more per probe. On a real H100 machine (16 cores, driver
580.159.04; the same commands run there with sh, no SSH, 12 runs each round robin) carrying cost
nothing measurable: median 0.17 s (0.14-0.21) carried on a Python without nvidia-ml-py, 0.17 s
(0.16-0.24) carried on a Python with nvidia-ml-py 13.610.43, 0.22 s (0.15-0.23) before,
on that Python with its own pynvml.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.facts.nvml import _END, probe_command, probe_script  # noqa: E402
from fleet.facts.runner import SshTarget, run_command, targets_from_inventory  # noqa: E402
from fleet.inventory.load import load_pyinfra_inventory  # noqa: E402

LAB = "pcbench"
VENV = "/home/fleet/probe-venv"


def before_command(python: str) -> str:
    """The probe as fleet sent it before carrying pynvml (script alone, the interpreter's pynvml)."""
    return f"{shlex.quote(python)} - <<'{_END}'\n{probe_script()}\n{_END}\n"


def timed_on_host(command: str) -> str:
    """``command`` with the host's own clock around it: prints ``elapsed_ns=N`` last."""
    return f's=$(date +%s%N)\n{{ {command}\n}}\ne=$(date +%s%N); echo "elapsed_ns=$((e - s))"\n'


def run_once(target: SshTarget, command: str) -> tuple[float, float]:
    """(round trip, run on the host) in seconds."""
    start = time.monotonic()
    rc, out, err = run_command(target, timed_on_host(command), timeout=120)
    trip = time.monotonic() - start
    assert rc == 0, err
    lines = out.splitlines()
    assert '"status":"ok"' in lines[-2], lines[-2][:300]
    return trip, int(lines[-1].split("=", 1)[1]) / 1e9


def measure(target: SshTarget, cases: dict[str, str], runs: int) -> dict[str, dict[str, float]]:
    """Each case ``runs`` times, round robin (the machine's load drifts; every case sees the same)."""
    trips: dict[str, list[float]] = {name: [] for name in cases}
    hosts: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, command in cases.items():
            trip, on_host = run_once(target, command)
            trips[name].append(trip)
            hosts[name].append(on_host)
    q = lambda xs: statistics.quantiles(xs, n=10)[-1]  # noqa: E731
    return {
        name: {
            "bytes": len(cases[name].encode()),
            "trip_median": statistics.median(trips[name]),
            "trip_p90": q(trips[name]),
            "host_median": statistics.median(hosts[name]),
            "host_p90": q(hosts[name]),
        }
        for name in cases
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--profile", default="h100-sxm-8")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-probe-bench-"))
    inventory = tmp / "inventory.py"
    fleet = [sys.executable, "-m", "fleet.cli", "lab"]
    try:
        subprocess.run([*fleet, "up", "--name", LAB, "--hosts", "1", "--profile", args.profile, "--inventory",
                        str(inventory), "--no-stage-model"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        inv = load_pyinfra_inventory(inventory)
        (target,) = targets_from_inventory(inv)
        index = next(iter(inv)).data.get("pip_index_url")
        install = (
            f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --disable-pip-version-check "
            f"--index-url {shlex.quote(str(index))} nvidia-ml-py"
        )
        rc, _out, err = run_command(target, install, timeout=300)
        assert rc == 0, err
        assert run_command(target, "python3 -c 'import pynvml'")[0] != 0, "the host's python3 has pynvml"
        cases = {
            "before (script only, venv's pynvml)": before_command(f"{VENV}/bin/python"),
            "carried, python3 (no nvidia-ml-py)": probe_command("python3"),
            "carried, venv's python": probe_command(f"{VENV}/bin/python"),
        }
        measure(target, cases, 2)  # warm the page cache and sshd
        print(f"{'':40} {'bytes':>8} {'trip p50':>9} {'trip p90':>9} {'host p50':>9} {'host p90':>9}")
        for name, m in measure(target, cases, args.runs).items():
            print(
                f"{name:40} {m['bytes']:>8.0f} {m['trip_median']:>8.3f}s {m['trip_p90']:>8.3f}s "
                f"{m['host_median']:>8.3f}s {m['host_p90']:>8.3f}s"
            )
    finally:
        subprocess.run([*fleet, "down", "--name", LAB], check=False, stdout=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    os.chdir(REPO)
    main()
