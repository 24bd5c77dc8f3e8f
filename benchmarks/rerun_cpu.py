"""The CPU a no-change ``fleet deploy`` costs, in the fleet process and on the lab's hosts.

    sudo .venv/bin/python benchmarks/rerun_cpu.py [--hosts 4] [--runs 4] [--fleet CMD ...]

Wall times on the shared 2-core development machine move by more than the changes being measured
(``deploy_vs_ansible.py``'s docstring); CPU seconds move much less. Brings up a lab of its own
(``rtx4090-2`` hosts, the model's config staged, as ``deploy_vs_ansible.py``), deploys it once,
then runs ``fleet deploy`` again ``--runs`` times, each time measuring the wall time, the CPU of
the fleet process (``RUSAGE_CHILDREN``) and the CPU of the lab's hosts (each host's cgroup
``cpu.stat`` ``usage_usec``, less the hosts' idle rate measured before). ``--fleet`` gives other
``fleet`` programs to run alternately with this checkout's (another checkout's, to compare).
Fleet runs with its bytecode (``deploy_vs_ansible.installed_env``). The lab is taken down at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def hosts_cpu(lab_name: str, count: int) -> float:
    """CPU seconds the lab's hosts have used (their cgroups, ``fleetlab``'s ``fleet-lab/<host>``)."""
    total = 0
    for i in range(1, count + 1):
        stat = Path(f"/sys/fs/cgroup/unified/fleet-lab/{lab_name}-h{i}/cpu.stat")
        if not stat.is_file():
            stat = Path(f"/sys/fs/cgroup/fleet-lab/{lab_name}-h{i}/cpu.stat")
        for line in stat.read_text().splitlines():
            if line.startswith("usage_usec "):
                total += int(line.split()[1])
    return total / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--fleet", action="append", default=[], help="another fleet program to alternate with")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.deploy_vs_ansible import Lab, installed_env

    root = Path(tempfile.mkdtemp(prefix="fleet-rerun-cpu-"))
    env = installed_env(root)
    programs = [str(Path(sys.executable).parent / "fleet"), *args.fleet]
    lab = Lab(args.hosts, root, "c")
    name = lab.opts.name
    rows: dict[str, list[tuple[float, float, float]]] = {p: [] for p in programs}
    try:

        def deploy(program: str, check: bool = True) -> tuple[float, float, float]:
            r0, h0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), hosts_cpu(name, args.hosts), time.monotonic()
            done = subprocess.run(
                [program, "deploy", str(lab.opts.inventory), "--json"], env=env, capture_output=True, text=True,
                check=False, timeout=1800,
            )  # fmt: skip
            wall, h1, r1 = (
                time.monotonic() - t0,
                hosts_cpu(name, args.hosts),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            )
            if done.returncode != 0:
                raise SystemExit(
                    f"{program} deploy exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
                )
            statuses = {h["status"] for h in json.loads(done.stdout)["hosts"]}
            if check and statuses != {"unchanged"}:
                raise SystemExit(f"{program}: a re-run changed something: {statuses}")
            return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), h1 - h0

        for program in programs:  # the first deploy, then each program once (its bytecode written)
            deploy(program, check=False)
        h0 = hosts_cpu(name, args.hosts)
        time.sleep(5)
        idle = (hosts_cpu(name, args.hosts) - h0) / 5
        loads = []
        for _ in range(args.runs):
            for program in programs:
                loads.append(os.getloadavg()[0])
                wall, cpu, on_hosts = deploy(program)
                rows[program].append((wall, cpu, on_hosts - idle * wall))
    finally:
        lab.down()
    print(f"{args.hosts} lab hosts, {args.runs} no-change re-runs each, load {min(loads):.1f}-{max(loads):.1f}; "
          f"hosts idle {idle:.3f} CPU s/s")  # fmt: skip
    print(f"{'fleet program':<48} {'wall':>6} {'fleet CPU':>9} {'hosts CPU':>9}  (medians; s)")
    for program, got in rows.items():
        wall, cpu, on_hosts = (statistics.median(c) for c in zip(*got, strict=True))
        print(f"{program[-48:]:<48} {wall:>6.2f} {cpu:>9.2f} {on_hosts:>9.2f}")


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/rerun_cpu.py"):
        main()
