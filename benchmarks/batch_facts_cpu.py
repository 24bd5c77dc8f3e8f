"""The host CPU of each fact in a no-change ``fleet deploy``'s fact batch, and of the batch's wrapper.

    sudo .venv/bin/python benchmarks/batch_facts_cpu.py [--repeat 20] [--against /work/main]

Brings up one lab host (``rtx4090-2``, as ``rerun_cpu.py``), deploys it, then runs a no-change
``fleet deploy`` in this process with ``FactBatch.command`` recorded, so the fact commands are the
ones this checkout sends. On the host, as root (the deploy's ``sudo``), each fact's command runs
``--repeat`` times in a subshell with its output discarded; the shell's ``times`` builtin gives the
children's CPU (user + system), per run. Then the whole batch, with this checkout's wrapper and,
with ``--against``, another checkout's ``fleet/facts/batch.py`` wrapping the same commands. Prints
the facts by CPU, most first. The lab is taken down at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def children_cpu(lab: Any, script: str, repeat: int) -> tuple[float, float]:
    """Milliseconds of CPU (user + system) and of wall time that ``script`` costs per run on the
    lab's host, as root."""
    from fleetlab import ssh

    loop = (
        f"t0=$(date +%s%N); i=0; while [ $i -lt {repeat} ]; do i=$((i+1)); ( {script}\n) >/dev/null 2>&1 </dev/null; "
        "done; t1=$(date +%s%N); times; echo $((t1 - t0))"
    )
    h = lab.state.hosts[0]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        rc, out, err = ssh.run(client, f"sudo sh -c {shlex.quote(loop)}", timeout=600)
    finally:
        client.close()
    if rc != 0:
        raise SystemExit(f"on the host: {err[-2000:]}")
    words = out.split()
    user, system = (float(t.split("m")[0]) * 60 + float(t.split("m")[1].rstrip("s")) for t in words[-3:-1])
    return (user + system) / repeat * 1000, int(words[-1]) / repeat / 1e6


def one_after_another(commands: list[str]) -> str:
    """The batch's framing with the facts run one after another (each still in its own subshell)."""
    from fleet.facts.batch import HEADER

    jobs = "\n".join(f'(\n{c}\n) >"$d/{i}" 2>/dev/null; h="$h $?"' for i, c in enumerate(commands))
    files = " ".join(f'"$d/{i}"' for i in range(len(commands)))
    return (
        f"d=$(mktemp -d) || exit 0\nh={HEADER}\n{jobs}\n"
        f'printf \'%s\\n\' "$h"\nstat -c %s -- {files}\ncat -- {files} | base64 -w0\necho\nrm -rf "$d"'
    )


def wrapper_of(checkout: Path) -> Any:
    spec = importlib.util.spec_from_file_location("other_batch", checkout / "fleet" / "facts" / "batch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_batch"] = module
    spec.loader.exec_module(module)
    return module.FactBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--against", type=Path, help="another checkout whose batch wrapper to compare")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.deploy_vs_ansible import Lab, installed_env
    from fleet.facts import batch

    root = Path(tempfile.mkdtemp(prefix="fleet-batch-cpu-"))
    env = installed_env(root)
    lab = Lab(1, root, "b")
    try:
        fleet = str(Path(sys.executable).parent / "fleet")
        argv = [fleet, "deploy", str(lab.opts.inventory), "--json"]
        subprocess.run(argv, env=env, capture_output=True, check=True, timeout=1800)
        recorded: list[list[str]] = []
        command = batch.FactBatch.command

        def recording(self: batch.FactBatch, commands: list[str]) -> str:
            recorded.append(list(commands))
            return command(self, commands)

        batch.FactBatch.command = recording  # type: ignore[method-assign]
        from fleet.cli import main as fleet_main

        os.environ["FLEET_LAB_API_KEY"] = env["FLEET_LAB_API_KEY"]
        with contextlib.suppress(SystemExit):
            fleet_main(argv[1:], standalone_mode=False)
        batch.FactBatch.command = command  # type: ignore[method-assign]
        facts = max(recorded, key=len)
        others = [c for r in recorded if r is not facts for c in r]  # the first round: the NVML probe's
        rows = sorted(((*children_cpu(lab, c, args.repeat), c) for c in facts + others), reverse=True)
        print(
            f"{len(facts)} facts in the batch, {len(others)} in the first round ([first]); "
            f"host CPU and wall per run, ms ({args.repeat} runs each):"
        )
        for ms, wall, c in rows:
            print(f"{ms:7.1f} {wall:7.1f}  {'[first] ' if c in others else ''}{' '.join(c.split())[:130]}")
        batch_rows = [r for r in rows if r[2] in facts]
        print(f"{sum(r[0] for r in batch_rows):7.1f} {sum(r[1] for r in batch_rows):7.1f}  the batch's facts' sum")
        wrappers = {"this checkout": batch.FactBatch().command(facts), "one after another": one_after_another(facts)}
        if args.against:
            wrappers[str(args.against)] = wrapper_of(args.against)().command(facts)
        for _ in range(3):
            for name, script in wrappers.items():
                ms, wall = children_cpu(lab, script, args.repeat)
                print(f"{ms:7.1f} {wall:7.1f}  the whole batch: {name}")
    finally:
        lab.down()


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/batch_facts_cpu.py"):
        main()
