"""SSH sessions and round trips per host for ``fleet deploy`` (first run, no-change run) and ``fleet restart``.

    sudo .venv/bin/python benchmarks/ssh_rounds.py [--hosts 2] [--keep]

Brings up a lab of its own (``rtx4090-2`` hosts, driver loaded, the model's config staged as in
``deploy_vs_ansible.py``), then runs each command in a child process of its own through fleet's
real CLI (``fleet.cli.main``), with paramiko wrapped so that whichever code opens it (pyinfra's
connector, fleet's fact runner, preflight, the rollout executor), every SSH session
(``Transport.start_client``: one key exchange and login) and every round trip (``Channel.exec_command``
up to its exit status; an SFTP session counts as one) is counted per host address. The lab is
taken down at the end (``--keep`` leaves it up). Prints a table per command: sessions and round
trips per host (min-max over the hosts) and the command's wall time; ``--json`` prints the rows.

Targets (issue 26): a first deploy without reboot opens at most 2 SSH sessions per host, a
no-change run 1.

Measured 2026-11-26 19:00 (2 hosts, load ~20): first deploy 2 sessions / 74 round trips per host,
no-change run 1 / 4, ``fleet restart`` 1 / 40. On main at 5e600f8 a restart opened 4 sessions per
host (the NVML probe, the GPU watcher record and the drain markers each on a connection of their
own, then the executor's: 4 sessions / 42 round trips, measured on a 4-host lab); the read round
and the drain markers now go over the executor's connection.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def child(out: str, argv: list[str]) -> None:
    """Run ``fleet ARGV`` in this process with paramiko counted; write the counts to ``out``."""
    import paramiko

    sessions: Counter[str] = Counter()
    rounds: Counter[str] = Counter()

    real_start = paramiko.Transport.start_client

    def start_client(self: paramiko.Transport, *args: Any, **kwargs: Any) -> Any:
        sessions[str(self.getpeername()[0])] += 1
        return real_start(self, *args, **kwargs)

    real_exec = paramiko.Channel.exec_command

    def exec_command(self: paramiko.Channel, command: str | bytes) -> Any:
        rounds[str(self.get_transport().getpeername()[0])] += 1
        return real_exec(self, command)

    real_subsystem = paramiko.Channel.invoke_subsystem

    def invoke_subsystem(self: paramiko.Channel, subsystem: str) -> Any:
        rounds[str(self.get_transport().getpeername()[0])] += 1
        return real_subsystem(self, subsystem)

    for cls, name, wrapper in (
        (paramiko.Transport, "start_client", start_client),
        (paramiko.Channel, "exec_command", exec_command),
        (paramiko.Channel, "invoke_subsystem", invoke_subsystem),
    ):
        setattr(cls, name, wrapper)

    from fleet.cli import main

    t0 = time.monotonic()
    code = 0
    try:
        main.main(argv, prog_name="fleet", standalone_mode=False)
    except SystemExit as exc:
        code = int(exc.code or 0)
    Path(out).write_text(
        json.dumps({"argv": argv, "exit": code, "seconds": time.monotonic() - t0,
                    "sessions": dict(sessions), "rounds": dict(rounds)})
    )  # fmt: skip


def run_counted(argv: list[str], work: Path, env: dict[str, str]) -> dict[str, Any]:
    out = work / "counts.json"
    out.unlink(missing_ok=True)
    with (work / "fleet.log").open("a") as log:
        log.write(f"\n$ fleet {' '.join(argv)}\n")
        log.flush()
        subprocess.run(
            [sys.executable, __file__, "--child", str(out), *argv],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=1800,
        )  # fmt: skip
    if not out.is_file():
        raise SystemExit(f"fleet {argv[0]} left no counts; see {work / 'fleet.log'}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def spread(counts: dict[str, int], hosts: list[str]) -> str:
    values = [counts.get(h, 0) for h in hosts]
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1:])
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.deploy_vs_ansible import KEY, Lab

    work = Path(tempfile.mkdtemp(prefix="fleet-ssh-rounds-"))
    lab = Lab(args.hosts, work, "r")
    env = {**os.environ, "FLEET_LAB_API_KEY": KEY}
    inventory = str(lab.opts.inventory)
    hosts = [h.address for h in lab.state.hosts]
    rows = []
    try:
        for label, argv in (
            ("deploy, first run", ["deploy", inventory, "--json"]),
            ("deploy, no change", ["deploy", inventory, "--json"]),
            ("restart", ["restart", inventory, "--json", "--soak", "0", "--journal", str(work / "journal.db")]),
        ):
            counts = run_counted(argv, work, env)
            rows.append({
                "command": label, "exit": counts["exit"], "seconds": round(counts["seconds"], 1),
                "sessions": spread(counts["sessions"], hosts), "rounds": spread(counts["rounds"], hosts),
            })  # fmt: skip
    finally:
        if not args.keep:
            lab.down()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.hosts} lab hosts (rtx4090-2), per host; log: {work / 'fleet.log'}")
    print(f"{'command':<20} {'exit':>4} {'seconds':>8} {'SSH sessions':>13} {'round trips':>12}")
    for r in rows:
        print(f"{r['command']:<20} {r['exit']:>4} {r['seconds']:>8} {r['sessions']:>13} {r['rounds']:>12}")


if __name__ == "__main__":
    main()
