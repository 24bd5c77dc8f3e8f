"""Rendered units: the unit rules of the design, checked by systemd's own analyzer."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import RenderError
from fleet.escape import (
    comment_text,
    env_file_value,
    ssh_command,
    systemd_arg,
    systemd_assignment,
    systemd_text,
)
from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import HostPlan, plan_host
from fleet.render.units import HostPaths, RenderedFile, env_file, host_render_dir, render_host, unit_file, write_tree
from tests.unit.conftest import spec

L70 = "meta-llama/Llama-3.1-70B-Instruct"
CONFIG_8B = Path(__file__).resolve().parents[2] / "fleet/data/models/meta-llama/Llama-3.1-8B-Instruct/config.json"


@pytest.fixture
def plan() -> HostPlan:
    s = spec(model=L70, api_key_ref="env:KEY", served_model_name="llama 70b $prod 100%", shutdown_timeout=45)
    return plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb"), load_model(L70))


def test_unit_follows_the_restart_protocol(plan: HostPlan) -> None:
    unit = unit_file(plan, plan.instances[1]).content
    assert unit_file(plan, plan.instances[1]).path == "/etc/systemd/system/fleet-vllm-1.service"
    assert "KillMode=mixed" in unit  # SIGTERM to the API server only; workers killed after the drain
    assert "TimeoutStopSec=75" in unit  # longer than --shutdown-timeout 45
    assert "--shutdown-timeout 45" in unit
    assert "Restart=always" in unit and "LimitNOFILE=65535" in unit
    assert "ExecStart=/opt/fleet/vllm/bin/vllm serve meta-llama/Llama-3.1-70B-Instruct" in unit
    assert "EnvironmentFile=/etc/fleet/vllm-1.env" in unit
    assert "Environment=CUDA_VISIBLE_DEVICES=4,5,6,7" in unit
    devices = [line for line in unit.splitlines() if re.fullmatch(r"DeviceAllow=/dev/nvidia\d+ rw", line)]
    assert devices == [f"DeviceAllow=/dev/nvidia{i} rw" for i in (4, 5, 6, 7)]
    assert "DevicePolicy=closed" in unit and "NoNewPrivileges=yes" in unit and "User=vllm" in unit


def test_secrets_only_in_the_root_only_env_file(plan: HostPlan) -> None:
    files = render_host(plan, api_key="s3cr3t-key", api_key_ref="env:KEY")
    units = [f for f in files if f.path.endswith(".service")]
    envs = [f for f in files if f.path.endswith(".env")]
    assert len(units) == len(envs) == len(plan.instances)
    assert all("s3cr3t-key" not in u.content for u in units)
    assert all('VLLM_API_KEY="s3cr3t-key"' in e.content and e.mode == 0o600 for e in envs)
    placeholder = env_file(plan, plan.instances[0], None, "env:KEY").content
    assert "VLLM_API_KEY=" not in placeholder and "env:KEY" in placeholder
    with pytest.raises(ValueError):
        env_file(plan, plan.instances[0], "two\nlines")


@pytest.mark.parametrize(
    "raw, quoted",
    [
        ("plain-arg", "plain-arg"),
        ("has space", '"has space"'),
        ("$HOME", '"$$HOME"'),
        ("100%", "100%%"),
        ('a"b', '"a\\"b"'),
    ],
)
def test_systemd_argument_quoting(raw: str, quoted: str) -> None:
    assert systemd_arg(raw) == quoted


def test_write_tree_creates_secret_files_0600(plan: HostPlan, tmp_path: Path) -> None:
    written = write_tree(tmp_path, render_host(plan, api_key="k"))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in written}
    assert modes["vllm-0.env"] == 0o600 and modes["fleet-vllm-0.service"] == 0o644


needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


@needs_systemd
def test_systemd_analyze_verify_accepts_every_unit(plan: HostPlan, tmp_path: Path) -> None:
    """systemd's own parser: no unknown keys, bad quoting, or missing executables."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    vllm = venv / "bin" / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    paths = HostPaths(venv=str(venv), env_dir=str(tmp_path / "etc"), unit_dir=str(tmp_path / "units"))
    files = render_host(plan, api_key="k", paths=paths)
    for f in files:
        Path(f.path).parent.mkdir(parents=True, exist_ok=True)
        Path(f.path).write_text(f.content)
    units = [f.path for f in files if f.path.endswith(".service")]
    result = subprocess.run(
        ["systemd-analyze", "verify", *units],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    assert result.returncode == 0, result.stderr
    assert "Unknown key" not in result.stderr and "Ignoring" not in result.stderr, result.stderr


@needs_systemd
def test_systemd_analyze_security_rates_the_unit_ok(plan: HostPlan, tmp_path: Path) -> None:
    f = unit_file(plan, plan.instances[0])
    path = tmp_path / Path(f.path).name
    path.write_text(f.content)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=40", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-2000:]
    exposure = float(result.stdout.split("Overall exposure level for")[1].split(":")[1].split()[0])
    assert exposure <= 4.0, result.stdout[-1500:]


# -- escaping where values land (fleet/escape.py) ------------------------------------------


@pytest.mark.parametrize(
    "raw, quoted",
    [
        (";", "\\;"),  # a lone ";" separates commands
        ("", '""'),
        ("a\\b", '"a\\\\b"'),
        ("line\nbreak", '"line\\x0abreak"'),
        ("tab\there", '"tab\\x09here"'),
        ("ünï", '"ünï"'),
        ("${X}", '"$${X}"'),
        ("%n", "%%n"),
    ],
)
def test_exec_start_words(raw: str, quoted: str) -> None:
    assert systemd_arg(raw) == quoted


def test_nul_cannot_be_rendered() -> None:
    with pytest.raises(RenderError):
        systemd_arg("a\0b")


def test_environment_assignment_is_one_quoted_word() -> None:
    assert systemd_assignment("CUDA_VISIBLE_DEVICES", "0,1") == "CUDA_VISIBLE_DEVICES=0,1"
    assert systemd_assignment("X", 'a b"%$') == '"X=a b\\"%%$"'  # $ is not expanded in Environment=
    with pytest.raises(RenderError):
        systemd_assignment("BAD NAME", "x")


def test_env_file_values_are_quoted_for_systemds_parser() -> None:
    assert env_file_value('k"e y $HOME `id` \\ #x') == '"k\\"e y \\$HOME \\`id\\` \\\\ #x"'
    with pytest.raises(RenderError):
        env_file_value("two\nlines")


def test_free_text_and_comments_stay_on_their_line() -> None:
    assert systemd_text("a\nb 100%") == "a\\x0ab 100%%"
    assert systemd_text("a\\b") == "a\\b"  # Description= is not unquoted: a backslash is literal
    assert comment_text("ends with \\") == "ends with \\\\"  # would continue an env-file comment


def test_ssh_commands_are_argv_joined() -> None:
    assert ssh_command(["systemctl", "restart", "fleet-vllm-0.service"]) == "systemctl restart fleet-vllm-0.service"
    assert ssh_command(["echo", "a b; rm -rf /", "$(id)"]) == "echo 'a b; rm -rf /' '$(id)'"
    with pytest.raises(ValueError):
        ssh_command([])


def test_host_paths_must_be_plain_absolute_paths() -> None:
    for bad in ("relative/venv", "/opt/../etc", "/opt/with space", "/opt/a\nb", "/opt/$x"):
        with pytest.raises(RenderError):
            HostPaths(venv=bad)
    with pytest.raises(RenderError):
        HostPaths(user="root\nExecStartPre=/bin/sh")


def test_hostile_values_do_not_add_directives(tmp_path: Path) -> None:
    s = spec(
        model='/models/x\\ %n $y "q" ;',
        model_config=str(CONFIG_8B),
        served_model_name="a ; b \\ %% $$ 'c' ü",
    )
    plan = plan_host(s, HostGpus.from_catalogue("a10-24gb", 1), load_model(s.model, s.model_config))
    plain = plan_host(spec(), HostGpus.from_catalogue("a10-24gb", 1), load_model(spec().model))
    hostile_unit, plain_unit = unit_file(plan, plan.instances[0]).content, unit_file(plain, plain.instances[0]).content
    assert directives(hostile_unit) == directives(plain_unit)
    assert 'Description=vLLM /models/x\\ %%n $y "q" ; (instance 0' in hostile_unit


def directives(unit: str) -> list[str]:
    keys, joined = [], ""
    for line in unit.splitlines():
        if not joined and line.startswith("#"):
            continue
        joined += line
        if line.endswith("\\"):
            continue
        if joined.strip():
            keys.append(joined.split("=", 1)[0])
        joined = ""
    return keys


# -- writing under --render DIR --------------------------------------------------------------------


def test_write_tree_stays_inside_root(plan: HostPlan, tmp_path: Path) -> None:
    root = tmp_path / "render"
    with pytest.raises(RenderError):
        write_tree(root, [RenderedFile("/etc/../../escape", "x", 0o644)])
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "fleet").symlink_to(outside)
    with pytest.raises(RenderError, match="symlink"):
        write_tree(root, render_host(plan))
    assert not any(outside.iterdir())


def test_write_tree_replaces_a_symlink_at_a_file_without_following_it(plan: HostPlan, tmp_path: Path) -> None:
    """A link left at a rendered file's own name (not a directory on the way) is replaced by the
    file: nothing is written where it points (before fleet.localfs: OSError ELOOP, a traceback)."""
    root = tmp_path / "render"
    written = write_tree(root, render_host(plan, api_key="k"))
    env = next(p for p in written if p.suffix == ".env")
    outside = tmp_path / "outside.env"
    outside.write_text("untouched")
    env.unlink()
    env.symlink_to(outside)
    write_tree(root, render_host(plan, api_key="k"))
    assert not env.is_symlink() and stat.S_IMODE(env.stat().st_mode) == 0o600
    assert outside.read_text() == "untouched"


def test_write_tree_over_an_older_wider_file_never_shows_the_secret_wider_than_0600(
    plan: HostPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env file rendered again over an older copy someone made world-readable: the secret is
    never in a file anyone else can read, at any moment (before: O_TRUNC wrote it into the old
    0644 inode, then chmod narrowed it), and no reader sees half a file."""
    root = tmp_path / "render"
    written = write_tree(root, render_host(plan, api_key="old-key"))
    env = next(p for p in written if p.suffix == ".env")
    env.chmod(0o644)
    seen: list[tuple[int, bool]] = []

    def look() -> None:  # the env file's name as any other process would see it now
        seen.append((stat.S_IMODE(env.stat().st_mode), b"new-key" in env.read_bytes()))

    real_fdopen, real_replace, real_chmod = os.fdopen, os.replace, os.chmod

    class Watched:
        """The file object the writer writes through, looked at after every write and close."""

        def __init__(self, f: Any) -> None:
            self.f = f

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Watched:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()
            look()

        def write(self, data: Any) -> int:
            n = int(self.f.write(data))
            self.f.flush()
            look()
            return n

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        look()

    def chmod(*args: Any, **kwargs: Any) -> None:
        real_chmod(*args, **kwargs)
        look()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Watched(real_fdopen(*a, **k)))
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "chmod", chmod)
    write_tree(root, render_host(plan, api_key="new-key"))
    monkeypatch.undo()
    assert "new-key" in env.read_text() and stat.S_IMODE(env.stat().st_mode) == 0o600
    assert any(has_secret for _, has_secret in seen), seen  # the new secret was seen landing
    assert all(mode == 0o600 for mode, has_secret in seen if has_secret), seen


def test_host_render_dir_is_one_component(tmp_path: Path) -> None:
    assert host_render_dir(tmp_path, "gpu-01") == tmp_path / "gpu-01"
    for bad in ("../x", "/tmp/x", "/", "", ".", "..", "a/b", "a\nb"):
        with pytest.raises(RenderError):
            host_render_dir(tmp_path, bad)


def test_the_staged_snapshots_are_comments_in_the_env_file_and_a_new_one_is_a_new_revision(plan: HostPlan) -> None:
    """Issue 23: new files under a model's (or adapter's) name are a new snapshot; written into the
    env file, that is a new configuration revision, so the rollout restarts the instance behind its
    gates. As comments, systemd passes nothing of it to the process."""
    from fleet.render.revision import revisions_of

    inst = plan.instances[0]
    weights = (("meta-llama/Llama-3.1-70B-Instruct", "a" * 40), ("fleet-lora/sql", "b" * 40))
    text = env_file(plan, inst, None, "env:KEY", weights=weights).content
    lines = [line for line in text.splitlines() if line.startswith("# weights: ")]
    assert lines == [
        f"# weights: meta-llama/Llama-3.1-70B-Instruct snapshot {'a' * 40} (staged by fleet; a new snapshot is a new "
        "configuration revision)",
        f"# weights: fleet-lora/sql snapshot {'b' * 40} (staged by fleet; a new snapshot is a new configuration "
        "revision)",
    ]
    ids = {
        w: revisions_of(render_host(plan, None, "env:KEY", weights=w), "served")[0].id
        for w in ((), weights, (weights[0], ("fleet-lora/sql", "c" * 40)))
    }
    assert len(set(ids.values())) == 3  # none, one snapshot set, an adapter rewritten under its name
    assert env_file(plan, inst, None, "env:KEY").content == env_file(plan, inst, None, "env:KEY", weights=()).content
    weird = env_file(plan, inst, None, "env:KEY", weights=(("org/x\nVLLM_API_KEY=stolen", "r"),)).content
    assert "\nVLLM_API_KEY=stolen" not in weird  # a comment stays one line (comment_text)
