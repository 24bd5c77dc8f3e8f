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
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.api.state import State
from pyinfra.context import host
from pyinfra.operations import systemd

from fleet.errors import FleetError
from fleet.facts.driver import PythonVersion
from fleet.facts.releases import VllmReleases
from fleet.facts.revisions import InstanceRevision, InstanceRevisions, fact_instances
from fleet.gpus import Fabric
from fleet.inventory.spec import HostSpec, host_spec
from fleet.operations import layout, nvidia, revisions, units, vllm
from fleet.plan.planner import HostPlan
from fleet.render.revision import Revision, revisions_of
from fleet.render.units import HostPaths, RenderedFile, render_host
from fleet.secret_store import SecretError, read_secret

DEFAULT_DRIVER = layout.DEFAULT_DRIVER


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


def host_plan(name: str, data: Mapping[str, Any]) -> HostPlan:
    """The host's serving plan (GPUs from the inventory or its lab profile)."""
    from fleet.model.arch import load_model
    from fleet.plan.outcomes import gpus_for
    from fleet.plan.planner import plan_host

    spec = _spec(name, data)
    return plan_host(spec, gpus_for(spec), load_model(spec.model, spec.model_config))


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


def rendered_files(name: str, data: Mapping[str, Any], paths: HostPaths) -> list[RenderedFile]:
    """The host's units and env files from its plan (API key from ``env:`` refs, if set)."""
    ref = _spec(name, data).api_key_ref
    return render_host(host_plan(name, data), api_key(name, data), str(ref) if ref else None, paths)


def served_model(name: str, data: Mapping[str, Any]) -> str:
    """The model name the host's instances answer to (``/v1/models``)."""
    return _spec(name, data).served_model_name or host_plan(name, data).model


def host_revisions(name: str, data: Mapping[str, Any], paths: HostPaths) -> list[Revision]:
    return revisions_of(rendered_files(name, data, paths), served_model(name, data))


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
    current: str | None = None  #: the release ``current`` named before this deploy

    @property
    def waiting(self) -> list[str]:
        """Running instances whose release or configuration this deploy changed (not yet live)."""
        moved = self.current != self.release
        return sorted(i for i in self.running if moved or self.live.get(i) != self.revisions.get(i))


_STAGED: weakref.WeakKeyDictionary[State, dict[str, Staged]] = weakref.WeakKeyDictionary()


def staged_of(state: State) -> dict[str, Staged]:
    """Per host, what the deploy prepared on ``state`` left for the rolling engine."""
    return _STAGED.setdefault(state, {})


def _staged() -> Staged:
    return staged_of(host.state).setdefault(host.name, Staged())


def _found(paths: HostPaths) -> dict[str, InstanceRevision]:
    revs = host_revisions(host.name, _data(), paths)
    return host.get_fact(InstanceRevisions, instances=fact_instances(revs))


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


@deploy("vLLM release")
def vllm_release(root: str = vllm.DEFAULT_ROOT) -> None:
    """Build the release; make it ``current`` unless an instance runs (then the engine does, per
    instance, between its stop and its start)."""
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
    if not any(running(f) for f in _found(_paths()).values()):
        vllm.activate(name="current release", release_id=spec.release_id, root=root)
    vllm.prune(name="prune old releases", keep=releases_kept(host.name, data), root=root)


@deploy("vLLM units")
def vllm_units(paths: HostPaths | None = None) -> None:
    """Store every instance's configuration as a revision; write it in place for idle units only."""
    data = _data()
    revs = host_revisions(host.name, data, paths or _paths())
    found = host.get_fact(InstanceRevisions, instances=fact_instances(revs))
    staged = _staged()
    staged.revisions = {r.instance: r.id for r in revs}
    staged.running = {r.instance for r in revs if running(found.get(r.instance))}
    staged.live = {r.instance: _live(found.get(r.instance)) for r in revs}
    revisions.stored(name="configuration revisions", revisions=revs, keep=releases_kept(host.name, data))
    idle = [f for r in revs if r.instance not in staged.running for f in (r.unit, r.env)]
    units.installed(name="vLLM units and env files", files=idle)


@deploy("vLLM start")
def vllm_start() -> None:
    """Start (first deploy) the host's units that are not running; running ones are left alone."""
    for unit in unit_names(rendered_files(host.name, _data(), HostPaths(venv=f"{vllm.DEFAULT_ROOT}/current"))):
        systemd.service(name=f"start {unit}", service=unit, running=True)


@deploy("vLLM host")
def vllm_host() -> None:
    nvidia_driver()
    vllm_release()
    vllm_units()
