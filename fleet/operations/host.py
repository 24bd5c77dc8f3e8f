"""The deploys of one serving host: what ``deploys/vllm_host.py`` runs under the plain ``pyinfra``
CLI and what ``fleet deploy`` runs through pyinfra's API.

Each deploy takes the host's part of the fleet plan as data (``fleet.render.part.HostPart``: the
driver to pin, the release, its units and env files, their revisions), built by the caller
before any operation (``fleet deploy`` from its fleet plan, the deploy files from the host's
data): nothing here plans or validates. What the operations read from the host are facts.

GPUs: each host is planned from its NVML probe (the ``NvmlProbe`` fact, gathered once per host
and run: :func:`probe`); the inventory's ``gpu`` entry, when there is one, is checked against it,
and used only while NVML does not answer yet (``fleet.plan.gpu_source``). A host with neither is
not refused: its units wait for the driver (``vllm_units`` renders nothing for it in that run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary, WeakSet

from pyinfra.api.deploy import deploy
from pyinfra.api.host import Host
from pyinfra.api.state import State
from pyinfra.context import ctx_host, host
from pyinfra.operations import systemd

from fleet.errors import FleetError
from fleet.facts.driver import PythonVersion
from fleet.facts.hostfacts import HostFacts
from fleet.facts.nvml import NvmlProbe
from fleet.facts.releases import VllmReleases, running_release
from fleet.facts.revisions import InstanceRevision, InstanceRevisions, fact_instances
from fleet.operations import layout, nvidia, revisions, units, vllm
from fleet.operations.gpuwatch import gpu_watcher
from fleet.render.part import DriverSettings, HostDataError, HostPart
from fleet.render.revision import Revision
from fleet.render.units import HostPaths

DEFAULT_DRIVER = layout.DEFAULT_DRIVER

#: one probe per host of a pyinfra run (pyinfra 3 keeps no fact cache; its ``Host`` objects are
#: single-use, so an entry lives as long as its run)
_PROBES: WeakKeyDictionary[Host, HostFacts | str] = WeakKeyDictionary()


def release_spec(part: HostPart, python_version: str) -> layout.ReleaseSpec:
    """The vLLM release the host's part asks for, on a host with that Python."""
    return layout.ReleaseSpec(
        vllm_version=part.vllm_version,
        python_version=python_version,
        index_url=part.index_url,
        extras=part.extras,
        extra_requirements=(layout.NVML_PY_REQUIREMENT,),
        pins=part.pins,
    )


def probe(target: Host | None = None) -> HostFacts | str:
    """The host's NVML probe (the ``NvmlProbe`` fact), gathered once per host of a pyinfra run
    (``target``: that host; default: pyinfra's current host). A string: why there is no answer."""
    h: Host = target if target is not None else ctx_host.get()  # type: ignore[no-untyped-call]
    answer = _PROBES.get(h)
    if answer is None:
        answer = remember_probe(h, lambda: h.get_fact(NvmlProbe))
    return answer


def remember_probe(h: Host, read: Callable[[], HostFacts | None]) -> HostFacts | str:
    """The probe's answer as ``read`` gives the ``NvmlProbe`` fact's value (pyinfra's
    ``get_fact``, or the deploy's first round, ``fleet.facts.drain.UnlessDrained``), kept as
    :func:`probe`'s answer for the host. A string: why there is no answer."""
    answer: HostFacts | str
    try:
        facts = read()
    except FleetError as exc:  # ProbeOutputError: an answer this fleet does not understand
        answer = f"the probe's output was not understood: {exc}"
    else:  # pyinfra gives the fact's default (None) when its command could not run
        answer = facts if facts is not None else "the probe could not run on the host"
    _PROBES[h] = answer
    return answer


#: unit states in which the instance's process runs (or is about to): its files are not touched
RUNNING_STATES = ("active", "activating", "reloading", "deactivating")


def _live(found: InstanceRevision | None) -> str | None:
    return found["live"] if found is not None else None


def running(found: InstanceRevision | None) -> bool:
    return found is not None and found["state"] in RUNNING_STATES


@dataclass
class Staged:
    """What a deploy left for the rolling engine on one host (``staged_of``)."""

    release: str = ""  #: the release the host's data asks for
    revisions: dict[str, str] = field(default_factory=dict)  #: instance -> revision it should run
    running: set[str] = field(default_factory=set)  #: instances whose unit ran: their files wait
    live: dict[str, str | None] = field(default_factory=dict)  #: instance -> revision in place
    #: instance -> the release it runs (its process's; ``fleet.facts.releases.running_release``)
    runs: dict[str, str | None] = field(default_factory=dict)
    current: str | None = None  #: the release ``current`` named before this deploy
    found: dict[str, InstanceRevision] | None = None  #: the InstanceRevisions fact, gathered once

    @property
    def waiting(self) -> list[str]:
        """Running instances not on the release or configuration the host's data asks for: each
        instance by what its own process runs, not by the host's ``current`` link (after a canary
        or a halted rollout, instances of one host run different releases)."""
        return sorted(
            i for i in self.running if self.runs.get(i) != self.release or self.live.get(i) != self.revisions.get(i)
        )


_STAGED: WeakKeyDictionary[State, dict[str, Staged]] = WeakKeyDictionary()
#: hosts of a pyinfra run whose units wait for a second probe later in the same run (``units_later``)
_LATER: WeakSet[Host] = WeakSet()


def units_later(hosts: Sequence[Host]) -> None:
    """``vllm_units`` writes nothing on these hosts in this pyinfra run: their NVML does not answer
    yet, and ``fleet deploy`` probes them again once this run's release, driver or reboot lets it
    and writes their units then (from the probe, or the gpu entry if NVML still does not answer).
    Writing them now from the gpu entry would only be written over."""
    _LATER.update(hosts)


def staged_of(state: State) -> dict[str, Staged]:
    """Per host, what the deploy prepared on ``state`` left for the rolling engine."""
    return _STAGED.setdefault(state, {})


def _staged() -> Staged:
    return staged_of(host.state).setdefault(host.name, Staged())


def _revisions_found(revs: Sequence[Revision]) -> dict[str, InstanceRevision]:
    """The host's InstanceRevisions fact, gathered once per run (pyinfra 3 keeps no fact cache)."""
    staged = _staged()
    if staged.found is None:
        staged.found = host.get_fact(InstanceRevisions, instances=fact_instances(revs))
    return staged.found


@deploy("NVIDIA driver")
def nvidia_driver(driver: DriverSettings | None) -> None:
    if driver is None:
        host.noop("no nvidia_apt_url: the NVIDIA driver is not managed by fleet on this host")
        return
    nvidia.repository(name="NVIDIA apt repository", mirror=driver.mirror, keyring=driver.keyring)
    if driver.version is None:
        host.noop("nvidia_driver_version: keep: the host's NVIDIA driver is left as it is")
    else:
        nvidia.driver(
            name=f"NVIDIA driver {driver.version}", version=driver.version, fabric_manager=driver.fabric_manager
        )
    if driver.cuda_packages:
        pkgs = list(driver.cuda_packages)
        nvidia.cuda_packages(name=f"CUDA packages {' '.join(pkgs)}", packages=pkgs)
    nvidia.reboot_required(name="reboot required?")


#: where the deploy's units find their release, env files and state (``HostPart.files`` are rendered for it)
PATHS = HostPaths(venv=f"{vllm.DEFAULT_ROOT}/current")


def instance_release(found: InstanceRevision | None, current: str | None, root: str = vllm.DEFAULT_ROOT) -> str | None:
    """The release an instance runs, from its InstanceRevisions entry (``running_release``)."""
    return running_release(found.get("exe") if found is not None else None, current, root)


def _runs_another(part: HostPart, release_id: str, current: str | None) -> bool:
    """An instance of the host runs a release other than ``release_id``: ``current`` must stay as it
    is (a crash-restart by systemd starts what ``current`` names: it must be what ran before)."""
    if part.plan is None:
        return False  # no units can be there yet
    found = _revisions_found(part.revisions).values()
    return any(running(f) and instance_release(f, current) != release_id for f in found)


@deploy("vLLM release")
def vllm_release(part: HostPart, root: str = vllm.DEFAULT_ROOT) -> None:
    """Build the release; make it ``current`` unless an instance runs another release (then the
    engine does, per instance, between its stop and its start)."""
    python_version = host.get_fact(PythonVersion)
    if python_version is None:
        raise HostDataError(f"host {host.name}: python3 does not run; install python3 and python3-venv")
    spec = release_spec(part, python_version)
    staged = _staged()
    staged.release = spec.release_id
    staged.current = host.get_fact(VllmReleases, root=root)["current"]
    vllm.service_user(name="vLLM system user")
    vllm.release(name=f"vLLM release {spec.release_id}", spec=spec, root=root)
    if not _runs_another(part, spec.release_id, staged.current):
        vllm.activate(name="current release", release_id=spec.release_id, root=root)
    vllm.prune(name="prune old releases", keep=part.releases_kept, root=root)


@deploy("vLLM units")
def vllm_units(part: HostPart) -> None:
    """Store every instance's configuration as a revision; write it in place for idle units only.

    Idle units are enabled (started at boot) only when the host is planned from its NVML probe: a
    unit written from the inventory's ``gpu`` entry while NVML does not answer yet (no driver, or
    one not loaded until the reboot) would start at boot from a plan the probe is about to
    replace, and a fleet deploy would then roll every such instance through the engine although
    none ever served anyone. ``vllm_start`` enables the units it starts."""
    if ctx_host.get() in _LATER:  # type: ignore[no-untyped-call]
        host.noop("units: written once NVML is probed again, later in this run")
        return
    if part.plan is None:
        host.noop(part.waiting)
        return
    revs = part.revisions
    found = _revisions_found(revs)
    staged = _staged()
    staged.revisions = {r.instance: r.id for r in revs}
    staged.running = {r.instance for r in revs if running(found.get(r.instance))}
    staged.live = {r.instance: _live(found.get(r.instance)) for r in revs}
    current = staged.current
    if not staged.release and staged.running:  # a pass without vllm_release: read the link here
        current = host.get_fact(VllmReleases, root=vllm.DEFAULT_ROOT)["current"]
    staged.runs = {r.instance: instance_release(found.get(r.instance), current) for r in revs}
    revisions.stored(name="configuration revisions", revisions=list(revs), keep=part.releases_kept, found=found)
    idle = [f for r in revs if r.instance not in staged.running for f in (r.unit, r.env)]
    units.installed(name="vLLM units and env files", files=idle, enable=part.from_probe)


@deploy("vLLM start")
def vllm_start(part: HostPart) -> None:
    """Start (first deploy) the host's units that are not running, and enable them (they start at
    boot from now on: they passed preflight); running ones are left alone."""
    names = part.unit_names
    # first: pyinfra orders operations by their place in the code, and hosts with fewer units
    # would run this one in the place of another host's next start
    units.enabled(name="enable the vLLM units", units=names)
    for unit in names:
        systemd.service(name=f"start {unit}", service=unit, running=True)


@deploy("vLLM host")
def vllm_host(part: HostPart) -> None:
    """The whole host, from its part (planned and checked by the caller: an inventory gpu entry the
    probe contradicts stopped the host before this)."""
    nvidia_driver(driver=part.driver)
    gpu_watcher()
    vllm_release(part=part)
    vllm_units(part=part)
