"""Render a host's serving plan into systemd units and environment files (jinja2, ``templates/``).

One unit per vLLM instance (``fleet-vllm-<n>.service``) plus its environment file. The unit runs
the venv's ``vllm serve`` with the plan's argv; the API key only ever travels in the
root-only environment file. Rendering is pure: it returns file contents; writing them
(locally for ``fleet plan --render``, or to hosts in a deploy) is someone else's job.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from fleet.errors import RenderError
from fleet.escape import (
    check_host_path,
    comment_text,
    env_file_value,
    systemd_arg,
    systemd_assignment,
    systemd_path,
    systemd_text,
    systemd_word,
)
from fleet.inventory.schema import host_name_problem
from fleet.localfs import atomic_write
from fleet.plan.planner import HostPlan, Instance

__all__ = [
    "HostPaths",
    "RenderedFile",
    "env_file",
    "exec_lines",
    "render_host",
    "systemd_arg",
    "unit_file",
    "write_tree",
]

_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")

#: Extra seconds systemd waits after vLLM's own drain before it SIGKILLs what is left.
STOP_GRACE_SECONDS = 30
#: vLLM loads weights, compiles and captures CUDA graphs before it listens: minutes, not seconds.
TIMEOUT_START_SECONDS = 1800


@dataclass(frozen=True)
class HostPaths:
    """Where things live on a serving host."""

    venv: str = "/opt/fleet/vllm"
    env_dir: str = "/etc/fleet"
    unit_dir: str = "/etc/systemd/system"
    state_dir: str = "/var/lib/vllm"
    user: str = "vllm"

    def __post_init__(self) -> None:
        for path in (self.venv, self.env_dir, self.unit_dir, self.state_dir):
            check_host_path(path)
        if not _USER.fullmatch(self.user):
            raise RenderError(f"not a system user name: {self.user!r}")


@dataclass(frozen=True)
class RenderedFile:
    """A file to put on a host: path there, content, and mode."""

    path: str
    content: str
    mode: int


def exec_lines(instance: Instance) -> list[str]:
    """``vllm serve`` arguments grouped one flag (and its value) per line, quoted for systemd."""
    lines = [systemd_arg(instance.model)]
    lines += [" ".join(systemd_arg(part) for part in flag.argv()) for flag in instance.flags]
    return lines


def _environment() -> jinja2.Environment:
    """The templates' environment: one per templates folder, so each template is parsed and
    compiled once per process (jinja2 keeps compiled templates in its environment's cache and
    reloads one whose file changed); a new environment per file rendered compiled each template
    again for every instance (0.5 s of a no-change deploy's profile of 4 hosts)."""
    return _environment_for(str(templates_dir()))


@functools.cache
def _environment_for(directory: str) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(directory),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["systemd_arg"] = systemd_arg
    env.filters["systemd_word"] = systemd_word
    env.filters["systemd_text"] = systemd_text
    env.filters["systemd_path"] = systemd_path
    env.filters["env_value"] = env_file_value
    env.filters["comment"] = comment_text
    env.globals["systemd_env"] = systemd_assignment
    return env


def templates_dir() -> Path:
    """The ``templates/`` folder (shipped inside the package as ``fleet.templates``)."""
    override = os.environ.get("FLEET_TEMPLATES")
    if override:
        return Path(override)
    try:
        return Path(str(resources.files("fleet.templates")))
    except ModuleNotFoundError:  # running from a source checkout: templates/ beside fleet/
        return Path(__file__).resolve().parents[2] / "templates"


def unit_file(plan: HostPlan, instance: Instance, paths: HostPaths = HostPaths()) -> RenderedFile:
    timeout_stop = int({f.option: f.value for f in instance.flags}.get("--shutdown-timeout") or 0)
    content = (
        _environment()
        .get_template("vllm.service.j2")
        .render(
            plan=plan,
            instance=instance,
            paths=paths,
            timeout_start=TIMEOUT_START_SECONDS,
            timeout_stop=timeout_stop + STOP_GRACE_SECONDS,
            exec_lines=exec_lines(instance),
        )
    )
    return RenderedFile(f"{paths.unit_dir}/fleet-{instance.unit_name}.service", content, 0o644)


def env_file(
    plan: HostPlan,
    instance: Instance,
    api_key: str | None,
    api_key_ref: str | None = None,
    paths: HostPaths = HostPaths(),
    weights: Sequence[tuple[str, str]] = (),
) -> RenderedFile:
    """The instance's environment file; ``api_key=None`` renders a placeholder comment instead.

    ``weights``: the (model id, snapshot revision) pairs fleet stages for the host (model, draft,
    LoRA adapters), written as comments: new files under the same name are a new snapshot, so a
    new configuration revision, which the rollout engine restarts behind its gates. systemd reads
    no comment (``systemd.exec(5)``, ``EnvironmentFile=``), so the process sees nothing of it."""
    if api_key is not None and (not api_key or any(not c.isprintable() for c in api_key)):
        raise ValueError("the API key must be one non-empty line of printable characters")
    content = (
        _environment()
        .get_template("vllm.env.j2")
        .render(plan=plan, instance=instance, api_key=api_key, api_key_ref=api_key_ref, weights=weights)
    )
    return RenderedFile(f"{paths.env_dir}/{instance.unit_name}.env", content, 0o600)


def render_host(
    plan: HostPlan,
    api_key: str | None = None,
    api_key_ref: str | None = None,
    paths: HostPaths = HostPaths(),
    weights: Sequence[tuple[str, str]] = (),
) -> list[RenderedFile]:
    """All files of one host: a unit and an environment file per instance."""
    files: list[RenderedFile] = []
    for instance in plan.instances:
        files.append(unit_file(plan, instance, paths))
        files.append(env_file(plan, instance, api_key, api_key_ref, paths, instance_weights(plan, instance, weights)))
    return files


def instance_weights(
    plan: HostPlan, instance: Instance, weights: Sequence[tuple[str, str]]
) -> Sequence[tuple[str, str]]:
    """The staged snapshots an instance's env file names: all of the host's, except on a host with
    ``models`` (``fleet.plan.models``), where each instance names only its own model's and its
    draft's, so a new snapshot of one model is a new revision of that model's instances only."""
    if not plan.models:
        return weights
    spec_config = next((f.value for f in instance.flags if f.option == "--speculative-config"), None)
    draft = json.loads(spec_config).get("model") if spec_config else None
    return [(repo, snap) for repo, snap in weights if repo in (instance.model, draft)]


def host_render_dir(root: Path, host: str) -> Path:
    """``root/<host>``, refusing a host name that is not one plain path component."""
    why = host_name_problem(host)
    if why is not None:
        raise RenderError(f"host name {host!r} cannot be a directory name: {why}")
    return root / host


def _confined(root: Path, path: str) -> Path:
    """``root/path`` (``path`` absolute on the host, or relative), creating its directories.

    Refuses empty, ``.`` and ``..`` parts, control characters, and symlinks on the way.
    """
    parts = path.removeprefix("/").split("/")
    if any(p in ("", ".", "..") for p in parts) or not path.isprintable():
        raise RenderError(f"{path!r} is not a plain path: it could be written outside {root}")
    folder = root
    for part in parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            raise RenderError(f"{folder} is a symlink: {path} would be written outside {root}")
        folder.mkdir(exist_ok=True)
    return folder / parts[-1]


def write_tree(root: Path, files: list[RenderedFile]) -> list[Path]:
    """Write rendered files under ``root`` (their host paths made relative), with their modes.

    Every file lands inside ``root``: paths are normalized (no ``..``), no directory on the way
    may lead out of ``root`` (a symlink), and a symlink at the file itself is replaced, never
    followed. Each file is written atomically (``fleet.localfs.atomic_write``: a tree written
    again over an older one, as ``fleet monitor export`` does under a running Prometheus, never
    shows a half-written file) with its final mode from the first byte, also over an older file
    that had a wider one (no window where a secret is world-readable). Not fsync-ed: the tree is
    made again by running the command again.
    """
    written = []
    root.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = _confined(root, f.path)
        atomic_write(target, f.content, mode=f.mode, fsync=False)
        written.append(target)
    return written
