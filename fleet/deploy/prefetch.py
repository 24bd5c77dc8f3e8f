"""The facts ``fleet.operations.host.vllm_host`` reads on a host, to bring them in one batch.

This list decides nothing: it names which facts :mod:`fleet.deploy.factcache` brings in one
command before the operations ask for them; the operations still read them through
``host.get_fact`` and decide from them. A fact missing here is read on its own (slower, same
result); a fact listed here that no operation reads costs one command's time inside the batch.
The list follows what the operations read on a host where nothing changes (the re-run a fleet
sees most): the driver's repository files, packages and loaded module; Python; the service
user's groups, users and home; the releases; each instance's configuration revisions and unit
state; each rendered unit and env file; whether the units (and the fabric manager, on NVSwitch
hosts) are enabled; the units' states, which the deploy reads after the operations; the GPU
watcher's files and unit.
``tests/lab/test_fleet_deploy_lab.py`` checks that a no-change re-run reads no fact on its own.
"""

from __future__ import annotations

from pyinfra.facts.files import Directory, File, Sha1File
from pyinfra.facts.server import Arch, Groups, LinuxDistribution, Os
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from fleet.facts.batch import FactRequest
from fleet.facts.driver import NvidiaKernelModule, PythonVersion
from fleet.facts.packages import DebPackageStates, RebootRequired
from fleet.facts.releases import VllmReleases
from fleet.facts.revisions import InstanceRevisions, fact_instances
from fleet.facts.unit_states import UnitStates
from fleet.facts.users import UserEntry
from fleet.operations import host as host_deploy
from fleet.operations import nvidia, units, vllm
from fleet.plan.planner import HostPlan
from fleet.render.gpuwatch import UNIT_NAME as WATCH_UNIT
from fleet.render.gpuwatch import WatchSettings, watch_files
from fleet.render.part import HostPart
from fleet.render.units import HostPaths


def _file(path: str) -> list[FactRequest]:
    """What ``fleet.operations.files.atomic_file`` reads of ``path``."""
    return [FactRequest(Sha1File, {"path": path}), FactRequest(File, {"path": path})]


def unit_state_units(plan: HostPlan, paths: HostPaths) -> tuple[tuple[str, tuple[str, str]], ...]:
    """The ``UnitStates`` fact's argument for a host's plan: each unit with its unit and env file
    (one definition, so the deploy's read after its operations hits the batch's answer)."""
    return tuple(
        (f"fleet-{i.unit_name}.service",
         (f"{paths.unit_dir}/fleet-{i.unit_name}.service", f"{paths.env_dir}/{i.unit_name}.env"))
        for i in plan.instances
    )  # fmt: skip


def gpu_watcher_facts(settings: WatchSettings | None = None) -> list[FactRequest]:
    """What ``fleet.operations.gpuwatch.gpu_watcher`` reads: its two directories, its program and
    unit files, whether the unit is enabled and running."""
    settings = settings or WatchSettings()
    out = [FactRequest(Directory, {"path": d}) for d in (settings.state_dir, settings.textfile_dir)]
    for f in watch_files(settings):
        out += _file(f.path)
    out += [
        FactRequest(SystemdEnabled, {"services": [WATCH_UNIT]}),
        FactRequest(SystemdStatus, {"services": [WATCH_UNIT]}),
    ]
    return out


def vllm_host_facts(part: HostPart) -> list[FactRequest]:
    """The facts the ``vllm_host`` deploy reads on the host whose part it is (see the module docstring)."""
    paths = host_deploy.PATHS
    out = [FactRequest(LinuxDistribution), FactRequest(Arch)]
    driver = part.driver
    if driver is not None:
        for path in (nvidia.KEYRING_PATH, nvidia.SOURCES_PATH, nvidia.PREFERENCES_PATH):
            out += _file(path)
        out += [FactRequest(DebPackageStates), FactRequest(NvidiaKernelModule)]
        if driver.fabric_manager:
            out.append(FactRequest(SystemdEnabled, {"services": [nvidia.FABRIC_MANAGER_UNIT]}))
    out += [
        FactRequest(RebootRequired),
        FactRequest(PythonVersion),
        FactRequest(Groups),
        FactRequest(Os),
        FactRequest(UserEntry, {"user": vllm.SERVICE_USER}),
        FactRequest(Directory, {"path": paths.state_dir}),  # the service user's home
        FactRequest(VllmReleases, {"root": vllm.DEFAULT_ROOT}),
        *gpu_watcher_facts(),
    ]
    if part.plan is None:
        return out  # no units to render yet (the host waits for its driver)
    revisions = part.revisions
    out.append(FactRequest(InstanceRevisions, {"instances": fact_instances(revisions)}))
    files = [f for r in revisions for f in (r.unit, r.env)]  # written in place while their unit is idle
    for f in files:
        out += _file(f.path)
    out.append(FactRequest(SystemdEnabled, {"services": units.unit_names(files)}))
    # read by the deploy after the operations (which units to start, which wait for a restart):
    # from this batch where the operations ran no command on the host
    out.append(FactRequest(UnitStates, {"units": unit_state_units(part.plan, paths)}))
    return out
