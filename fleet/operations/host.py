"""The deploys of one serving host, read from its inventory data: what ``deploys/vllm_host.py``
runs under the plain ``pyinfra`` CLI and what ``fleet deploy`` runs through pyinfra's API.

Every key is validated by ``fleet.inventory`` (``schema.py``, exposed on ``HostSpec``); the deploy
keys read here are:

* ``nvidia_apt_url``: mirror root of NVIDIA's apt repository (the lab's signed stand-in in the
  lab); without it the driver is left to whoever manages it.
* ``nvidia_apt_keyring``: path, on the control machine, of that repository's public key.
* ``nvidia_driver_version``: the driver to pin (default: the one the vLLM release is tested with).
* ``nvidia_fabric_manager``: force the fabric manager on or off (default: on for NVSwitch hosts).
* ``vllm_extras``: vLLM extras (list of names); ``releases_kept``: releases kept (default 3).

GPUs: each host is planned from its NVML probe (the ``NvmlProbe`` fact, gathered once per host
and run); the inventory's ``gpu`` entry, when there is one, is checked against it, and used only
while NVML does not answer yet (``fleet.plan.gpu_source``). A host with neither is not refused:
its units wait for the driver (``vllm_units`` renders nothing for it in that run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
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
from fleet.gpus import Fabric
from fleet.inventory.spec import HostSpec, host_spec
from fleet.operations import layout, nvidia, revisions, units, vllm
from fleet.plan.gpu_source import GpusNotKnownYet, gpu_source
from fleet.plan.planner import HostPlan
from fleet.render.revision import Revision, revisions_of
from fleet.render.units import HostPaths, RenderedFile, render_host
from fleet.secret_store import SecretError, read_secret

DEFAULT_DRIVER = layout.DEFAULT_DRIVER

#: What a host's NVML probe answered (``HostFacts``), or why there is no answer (a string); None
#: where the host is not probed at all (planning offline: the inventory's ``gpu`` entry).
Probe = HostFacts | str | None
#: one probe per host of a pyinfra run (pyinfra 3 keeps no fact cache; its ``Host`` objects are
#: single-use, so an entry lives as long as its run)
_PROBES: WeakKeyDictionary[Host, HostFacts | str] = WeakKeyDictionary()


class HostDataError(FleetError):
    """A host's data cannot drive a deploy; names the host, the key, the value and the way out."""


@dataclass(frozen=True)
class DriverSettings:
    mirror: str
    keyring: str
    version: str
    fabric_manager: bool


def _spec(name: str, data: Mapping[str, Any]) -> HostSpec:
    return host_spec("(inventory)", name, (), dict(data))


def fabric_of(spec: HostSpec) -> Fabric:
    """The host's NVLink fabric as the inventory declares it (its gpu entry)."""
    if spec.gpu is not None:
        return spec.gpu.nvlink
    return Fabric.NONE


def driver_settings(name: str, data: Mapping[str, Any]) -> DriverSettings | None:
    """The driver to install on a host, or None when the inventory names no apt mirror."""
    spec = _spec(name, data)
    if spec.nvidia_apt_url is None:
        return None
    # the inventory's checks guarantee these with nvidia_apt_url (schema.driver_problem)
    assert spec.nvidia_apt_keyring is not None and spec.nvidia_driver_version is not None
    fm = spec.nvidia_fabric_manager
    fabric_manager = fm if fm is not None else fabric_of(spec) is Fabric.SWITCH
    return DriverSettings(spec.nvidia_apt_url, spec.nvidia_apt_keyring, spec.nvidia_driver_version, fabric_manager)


def release_spec(name: str, data: Mapping[str, Any], python_version: str) -> layout.ReleaseSpec:
    """The vLLM release a host's data asks for, on a host with that Python."""
    spec = _spec(name, data)
    if not spec.pip_index_url:
        raise HostDataError(f"host {name}: pip_index_url is not set: the package index the venv installs from")
    return layout.ReleaseSpec(
        vllm_version=spec.vllm_version,
        python_version=python_version,
        index_url=spec.pip_index_url,
        extras=spec.vllm_extras,
        extra_requirements=(layout.NVML_PY_REQUIREMENT,),
    )


def releases_kept(name: str, data: Mapping[str, Any]) -> int:
    return _spec(name, data).releases_kept


def probe(target: Host | None = None) -> HostFacts | str:
    """The host's NVML probe (the ``NvmlProbe`` fact), gathered once per host of a pyinfra run
    (``target``: that host; default: pyinfra's current host). A string: why there is no answer."""
    h: Host = target if target is not None else ctx_host.get()  # type: ignore[no-untyped-call]
    answer = _PROBES.get(h)
    if answer is None:
        try:
            facts = h.get_fact(NvmlProbe)
        except FleetError as exc:  # ProbeOutputError: an answer this fleet does not understand
            answer = f"the probe's output was not understood: {exc}"
        else:  # pyinfra gives the fact's default (None) when its command could not run
            answer = facts if facts is not None else "the probe could not run on the host"
        _PROBES[h] = answer
    return answer


def host_plan(name: str, data: Mapping[str, Any], probed: Probe = None) -> HostPlan:
    """The host's serving plan, from its probe where NVML answers (``fleet.plan.gpu_source``).

    ``GpuMismatch``: the inventory's gpu entry disagrees with the probe; ``GpusNotKnownYet``: no
    GPU facts yet (the host waits for its driver); ``PlanError``: nothing fits.
    """
    from fleet.model.arch import load_model
    from fleet.plan.planner import plan_host

    spec = _spec(name, data)
    source = gpu_source(spec, probed)
    if source.gpus is None:
        raise GpusNotKnownYet(name, source.why)
    return plan_host(spec, source.gpus, load_model(spec.model, spec.model_config))


def api_key(name: str, data: Mapping[str, Any]) -> str | None:
    """The API key the host's ``api_key_ref`` points at (None: the inventory sets no key, the API is
    open); ``SecretError`` when the reference cannot be read here — never a silently open API."""
    ref = _spec(name, data).api_key_ref
    if ref is None:
        return None
    try:
        return read_secret(ref)
    except SecretError as exc:
        raise SecretError(f"{name}: {exc}") from None


def unit_names(files: Sequence[RenderedFile]) -> list[str]:
    return [f.path.rsplit("/", 1)[1] for f in files if f.path.endswith(".service")]


def rendered_files(name: str, data: Mapping[str, Any], paths: HostPaths, probed: Probe = None) -> list[RenderedFile]:
    """The host's units and env files from its plan (API key from ``env:`` refs, if set)."""
    ref = _spec(name, data).api_key_ref
    return render_host(host_plan(name, data, probed), api_key(name, data), str(ref) if ref else None, paths)


def served_name(spec: HostSpec, plan: HostPlan) -> str:
    """The model name a host's instances answer to (``/v1/models``)."""
    return spec.served_model_name or plan.model


def served_model(name: str, data: Mapping[str, Any], probed: Probe = None) -> str:
    return served_name(_spec(name, data), host_plan(name, data, probed))


def host_revisions(name: str, data: Mapping[str, Any], paths: HostPaths, probed: Probe = None) -> list[Revision]:
    plan_model = served_model(name, data, probed)
    return revisions_of(rendered_files(name, data, paths, probed), plan_model)


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


def _data() -> dict[str, Any]:
    return dict(host.data.dict())  # type: ignore[no-untyped-call]


@deploy("NVIDIA driver")
def nvidia_driver() -> None:
    settings = driver_settings(host.name, _data())
    if settings is None:
        host.noop("no nvidia_apt_url: the NVIDIA driver is not managed by fleet on this host")
        return
    nvidia.repository(name="NVIDIA apt repository", mirror=settings.mirror, keyring=settings.keyring)
    nvidia.driver(
        name=f"NVIDIA driver {settings.version}", version=settings.version, fabric_manager=settings.fabric_manager
    )
    nvidia.reboot_required(name="reboot required?")


def _paths() -> HostPaths:
    return HostPaths(venv=f"{vllm.DEFAULT_ROOT}/current")


def instance_release(found: InstanceRevision | None, current: str | None, root: str = vllm.DEFAULT_ROOT) -> str | None:
    """The release an instance runs, from its InstanceRevisions entry (``running_release``)."""
    return running_release(found.get("exe") if found is not None else None, current, root)


def _runs_another(release_id: str, current: str | None) -> bool:
    """An instance of the host runs a release other than ``release_id``: ``current`` must stay as it
    is (a crash-restart by systemd starts what ``current`` names: it must be what ran before)."""
    try:
        revs = host_revisions(host.name, _data(), _paths(), probe())
    except GpusNotKnownYet:
        return False  # no units can be there yet
    found = _revisions_found(revs).values()
    return any(running(f) and instance_release(f, current) != release_id for f in found)


@deploy("vLLM release")
def vllm_release(root: str = vllm.DEFAULT_ROOT) -> None:
    """Build the release; make it ``current`` unless an instance runs another release (then the
    engine does, per instance, between its stop and its start)."""
    data = _data()
    python_version = host.get_fact(PythonVersion)
    if python_version is None:
        raise HostDataError(f"host {host.name}: python3 does not run; install python3 and python3-venv")
    spec = release_spec(host.name, data, python_version)
    staged = _staged()
    staged.release = spec.release_id
    staged.current = host.get_fact(VllmReleases, root=root)["current"]
    vllm.service_user(name="vLLM system user")
    vllm.release(name=f"vLLM release {spec.release_id}", spec=spec, root=root)
    if not _runs_another(spec.release_id, staged.current):
        vllm.activate(name="current release", release_id=spec.release_id, root=root)
    vllm.prune(name="prune old releases", keep=releases_kept(host.name, data), root=root)


@deploy("vLLM units")
def vllm_units(paths: HostPaths | None = None) -> None:
    """Store every instance's configuration as a revision; write it in place for idle units only.

    Idle units are enabled (started at boot) only when the host is planned from its NVML probe: a
    unit written from the inventory's ``gpu`` entry while NVML does not answer yet (no driver, or
    one not loaded until the reboot) would start at boot from a plan the probe is about to
    replace, and a fleet deploy would then roll every such instance through the engine although
    none ever served anyone. ``vllm_start`` enables the units it starts."""
    data = _data()
    if ctx_host.get() in _LATER:  # type: ignore[no-untyped-call]
        host.noop("units: written once NVML is probed again, later in this run")
        return
    probed = probe()
    try:
        revs = host_revisions(host.name, data, paths or _paths(), probed)
        from_probe = host_plan(host.name, data, probed).gpus_source == "probe"
    except GpusNotKnownYet as exc:
        host.noop(str(exc))
        return
    found = _revisions_found(revs)
    staged = _staged()
    staged.revisions = {r.instance: r.id for r in revs}
    staged.running = {r.instance for r in revs if running(found.get(r.instance))}
    staged.live = {r.instance: _live(found.get(r.instance)) for r in revs}
    current = staged.current
    if not staged.release and staged.running:  # a pass without vllm_release: read the link here
        current = host.get_fact(VllmReleases, root=vllm.DEFAULT_ROOT)["current"]
    staged.runs = {r.instance: instance_release(found.get(r.instance), current) for r in revs}
    keep = releases_kept(host.name, data)
    revisions.stored(name="configuration revisions", revisions=revs, keep=keep, found=found)
    idle = [f for r in revs if r.instance not in staged.running for f in (r.unit, r.env)]
    units.installed(name="vLLM units and env files", files=idle, enable=from_probe)


@deploy("vLLM start")
def vllm_start() -> None:
    """Start (first deploy) the host's units that are not running, and enable them (they start at
    boot from now on: they passed preflight); running ones are left alone."""
    paths = HostPaths(venv=f"{vllm.DEFAULT_ROOT}/current")
    names = unit_names(rendered_files(host.name, _data(), paths, probe()))
    # first: pyinfra orders operations by their place in the code, and hosts with fewer units
    # would run this one in the place of another host's next start
    units.enabled(name="enable the vLLM units", units=names)
    for unit in names:
        systemd.service(name=f"start {unit}", service=unit, running=True)


@deploy("vLLM host")
def vllm_host() -> None:
    """The whole host. Its GPUs are checked first: an inventory gpu entry the probe contradicts
    (``GpuMismatch``) stops the host before any operation is added."""
    with contextlib.suppress(GpusNotKnownYet):  # the driver and release go on; vllm_units says why not units
        host_plan(host.name, _data(), probe())
    nvidia_driver()
    vllm_release()
    vllm_units()
