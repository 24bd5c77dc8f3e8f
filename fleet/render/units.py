"""Render a host's serving plan into systemd units and environment files (jinja2, ``templates/``).

One unit per vLLM instance (``fleet-vllm-<n>.service``) plus its environment file. The unit runs
the venv's ``vllm serve`` with the plan's argv; the API key only ever travels in the
root-only environment file. Rendering is pure: it returns file contents; writing them
(locally for ``fleet plan --render``, or to hosts in a deploy) is someone else's job.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2

from fleet.plan.planner import HostPlan, Instance

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


@dataclass(frozen=True)
class RenderedFile:
    """A file to put on a host: path there, content, and mode."""

    path: str
    content: str
    mode: int


_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@%+=:,./\-]+$")


def systemd_arg(value: str) -> str:
    """Quote one argument for ``ExecStart=``: systemd expands ``%`` specifiers and ``$`` variables."""
    escaped = value.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(escaped):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_lines(instance: Instance) -> list[str]:
    """``vllm serve`` arguments grouped one flag (and its value) per line, quoted for systemd."""
    lines = [systemd_arg(instance.model)]
    lines += [" ".join(systemd_arg(part) for part in flag.argv()) for flag in instance.flags]
    return lines


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["systemd_arg"] = systemd_arg
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
    timeout_stop = int(dict(f.argv() for f in instance.flags if f.value is not None).get("--shutdown-timeout", 0) or 0)
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
) -> RenderedFile:
    """The instance's environment file; ``api_key=None`` renders a placeholder comment instead."""
    if api_key is not None and (not api_key or any(c in api_key for c in "\n\r\0")):
        raise ValueError("the API key must be one non-empty line")
    content = (
        _environment()
        .get_template("vllm.env.j2")
        .render(plan=plan, instance=instance, api_key=api_key, api_key_ref=api_key_ref)
    )
    return RenderedFile(f"{paths.env_dir}/{instance.unit_name}.env", content, 0o600)


def render_host(
    plan: HostPlan, api_key: str | None = None, api_key_ref: str | None = None, paths: HostPaths = HostPaths()
) -> list[RenderedFile]:
    """All files of one host: a unit and an environment file per instance."""
    files: list[RenderedFile] = []
    for instance in plan.instances:
        files.append(unit_file(plan, instance, paths))
        files.append(env_file(plan, instance, api_key, api_key_ref, paths))
    return files


def write_tree(root: Path, files: list[RenderedFile]) -> list[Path]:
    """Write rendered files under ``root`` (their host paths made relative), with their modes.

    Files are created with their final mode from the start (no window where a secret is
    world-readable).
    """
    written = []
    for f in files:
        target = root / f.path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f.mode)
        with os.fdopen(fd, "w") as out:
            out.write(f.content)
        os.chmod(target, f.mode)
        written.append(target)
    return written
