"""How long the lab takes to come up and go down, the way an operator runs it.

    sudo .venv/bin/python benchmarks/lab_bringup.py [--hosts 4] [--cold]

Runs the real CLI (``fleet lab up/down``) in its own lab (name ``bench``) and prints wall times:
up from a cached base, up again with every host running (idempotent), down; with ``--cold`` also
up from nothing (a fresh base cache: debootstrap included). Side by side, the same bring-up done
by hand with the tools an operator would otherwise reach for (``systemd-nspawn`` on a copied root,
without keys, inventory or GPUs), to show what fleet's extra work costs.

Measured on the 2-core development machine, --hosts 4: up from nothing 70.6 s (debootstrap), from
the cached base 3.3 s (1.3 s for the hosts, the rest builds and starts the package index), again
0.3 s, down 2.2 s; by hand (cp -a of the base + nspawn, no boot) 6.9 s.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLEET = [sys.executable, "-m", "fleet.cli", "lab"]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.monotonic() - start


def fleet_times(hosts: int, cold: bool, inventory: Path) -> dict[str, float]:
    import os

    env = dict(os.environ)
    times: dict[str, float] = {}
    args = ["--name", "bench", "--hosts", str(hosts), "--inventory", str(inventory)]
    try:
        if cold:
            cache = tempfile.mkdtemp(prefix="fleet-bench-cache-")
            env["FLEET_LAB_CACHE"] = cache
            times["fleet lab up (no cached base)"] = timed([*FLEET, "up", *args], env)
            times["fleet lab down"] = timed([*FLEET, "down", "--name", "bench"], env)
        times["fleet lab up (cached base)"] = timed([*FLEET, "up", *args], env)
        times["fleet lab up (already up)"] = timed([*FLEET, "up", *args], env)
    finally:
        times["fleet lab down"] = timed([*FLEET, "down", "--name", "bench"], env)
    return times


def by_hand(hosts: int) -> float:
    """Boot N plain nspawn containers from a copied base and wait for their consoles to settle."""
    from fleetlab import base as base_mod

    base = base_mod.base_path(base_mod.DEFAULT_CACHE_DIR, base_mod.DEFAULT_SUITE, base_mod.BASE_PACKAGES)
    if not base_mod.is_complete(base):
        return float("nan")
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-hand-"))
    procs = []
    start = time.monotonic()
    try:
        for i in range(hosts):
            root = work / f"h{i}"
            subprocess.run(["cp", "-a", str(base), str(root)], check=True)
            procs.append(
                subprocess.Popen(
                    ["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit", "true"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for p in procs:
            p.wait(timeout=120)
        return time.monotonic() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--cold", action="store_true", help="also measure a bring-up with no cached base")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        times = fleet_times(opts.hosts, opts.cold, Path(tmp) / "bench.py")
    times[f"by hand: copy base + run nspawn ×{opts.hosts} (no boot, keys, GPUs)"] = by_hand(opts.hosts)
    width = max(map(len, times))
    for what, seconds in times.items():
        print(f"{what:<{width}}  {seconds:7.2f} s")


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/lab_bringup.py"):
        main()
