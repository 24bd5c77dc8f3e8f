"""Rendered units read back by a real systemd: hostile-but-valid values arrive exactly as planned.

A plan whose served model name and model directory hold spaces, quotes, ``%``, ``$``,
backslashes, a lone ``;`` and non-ASCII letters, and an API key with the characters systemd's
environment-file parser treats specially, is rendered, installed on a lab host (Debian's
systemd 252 as PID 1) and then:

* ``systemctl show -p ExecStart`` and the unit's D-Bus ``ExecStart`` property give exactly the
  plan's argv, in systemd's stored form (``$`` kept as ``$$`` until exec, systemd.service(5)
  "Command lines"); ``Description=`` and ``Environment=`` come back as written;
* the unit is started: its ``vllm`` is a recorder that writes the argv it was executed with and
  its environment, so the argv the process got and the ``EnvironmentFile`` values are compared
  exactly with the plan and the key.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from fleet.gpus import HostGpus
from fleet.model.arch import load_model
from fleet.plan.planner import HostPlan, plan_host
from fleet.render.units import HostPaths, render_host
from fleetlab import ssh
from tests.unit.conftest import spec

from .conftest import LabFleet
from .polling import wait_for

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B_CONFIG = REPO / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
SERVED = "llama 8b \"prod\" 'q' $HOME ${X} 100%n %% \\back\\ ; ünïcødé ✓"
MODEL_DIR = '/srv/models/My Model "v2" 50% $PATH \\x41 ; Ω'
API_KEY = "k\"e y $HOME `id` \\n 'q' #x %h ünï"
#: variant -> (model directory, served model name): a lone ";" is a command separator in ExecStart=
VARIANTS = {"quotes": (MODEL_DIR, SERVED), "semicolon": ("/srv/models/-rf ;", ";")}

RECORDER = """#!/usr/bin/python3
import json, os, sys
with open(os.path.join(os.environ["HOME"], "seen.json"), "w") as f:
    json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)
"""


def paths(variant: str) -> HostPaths:
    return HostPaths(
        venv=f"/opt/fleet-esc-{variant}/venv",
        env_dir=f"/etc/fleet-esc-{variant}",
        state_dir=f"/var/lib/fleet-esc-{variant}",
        user="fleetesc",
    )


def unit_name(variant: str) -> str:
    return f"fleet-esc-test-{variant}.service"


def bus_path(unit: str) -> str:
    """systemd's D-Bus object path of a unit (sd_bus_path_encode: non-alphanumerics as _xx)."""
    return "/org/freedesktop/systemd1/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in unit)


class Host:
    def __init__(self, lab: LabFleet):
        self.lab = lab
        self.record = lab.state.hosts[-1]
        d = lab.dir
        self.client: paramiko.SSHClient = ssh.connect(
            self.record.address, lab.state.ssh_port, d.control_key, d.known_hosts
        )

    def run(self, command: str, timeout: float = 60.0, check: bool = True) -> str:
        rc, out, err = ssh.run(self.client, command, timeout=timeout)
        if check:
            assert rc == 0, f"{command}: rc {rc}\n{out}\n{err}"
        return out

    def put(self, path: str, content: str, mode: str) -> None:
        tmp = f"/home/fleet/.esc-upload-{abs(hash(path))}"
        with self.client.open_sftp() as sftp, sftp.open(tmp, "wb") as f:
            f.write(content.encode("utf-8"))
        self.run(f"sudo -n install -D -m {mode} {shlex.quote(tmp)} {shlex.quote(path)} && rm -f {shlex.quote(tmp)}")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def plan(variant: str) -> HostPlan:
    model, served = VARIANTS[variant]
    s = spec(model=model, model_config=str(LLAMA_8B_CONFIG), served_model_name=served, shutdown_timeout=5)
    return plan_host(s, HostGpus.from_catalogue("h100-sxm-80gb", 1), load_model(model, str(LLAMA_8B_CONFIG)))


@pytest.fixture(scope="module")
def installed(lab_fleet: LabFleet, plan: HostPlan, variant: str) -> Iterator[Host]:
    host = Host(lab_fleet)
    p, unit_file = paths(variant), unit_name(variant)
    (unit, env) = render_host(plan, api_key=API_KEY, paths=p)
    try:
        host.run("id fleetesc >/dev/null 2>&1 || sudo -n useradd --system --no-create-home fleetesc")
        host.run(f"sudo -n install -d -o fleetesc -g fleetesc {p.state_dir}")
        host.put(f"{p.venv}/bin/vllm", RECORDER, "0755")
        host.put(env.path, env.content, "0600")
        host.put(f"/etc/systemd/system/{unit_file}", unit.content, "0644")
        host.run("sudo -n systemctl daemon-reload")
        yield host
    finally:
        host.run(f"sudo -n systemctl stop {unit_file}", check=False)
        host.run(
            f"sudo -n rm -rf /etc/systemd/system/{unit_file} {p.env_dir} {p.venv.rsplit('/', 1)[0]} {p.state_dir}"
            " && sudo -n systemctl daemon-reload && sudo -n systemctl reset-failed",
            check=False,
        )
        host.client.close()


def expected_argv(plan: HostPlan, variant: str) -> list[str]:
    return [f"{paths(variant).venv}/bin/vllm", "serve", *plan.instances[0].argv]


def test_plan_really_holds_the_hostile_values(plan: HostPlan, variant: str) -> None:
    model, served = VARIANTS[variant]
    argv = expected_argv(plan, variant)
    assert argv[2] == model and served in argv


def test_systemd_reads_back_exactly_the_plans_argv(installed: Host, plan: HostPlan, variant: str) -> None:
    argv, unit, model = expected_argv(plan, variant), unit_name(variant), VARIANTS[variant][0]
    verify = installed.run(
        f"sudo -n systemd-analyze verify /etc/systemd/system/{unit} 2>&1 | grep -v nvidia || true", check=False
    )
    assert "Unknown" not in verify and "Ignoring" not in verify, verify
    # systemd keeps "$$" (a literal "$") until it executes the command: the stored argv has it doubled.
    stored = [a.replace("$", "$$") for a in argv]
    shown = installed.run(f"systemctl show -p ExecStart {unit}")
    assert f"argv[]={' '.join(stored)} ;" in shown, shown
    bus = json.loads(
        installed.run(
            f"busctl get-property --json=short org.freedesktop.systemd1 {bus_path(unit)} "
            "org.freedesktop.systemd1.Service ExecStart"
        )
    )
    ((path, bus_argv, *_rest),) = bus["data"]
    assert path == argv[0]
    assert bus_argv == stored
    description = installed.run(f"systemctl show -p Description --value {unit}").strip()
    assert description.startswith(f"vLLM {model} (instance 0")
    environment = installed.run(f"systemctl show -p Environment --value {unit}")
    assert "CUDA_VISIBLE_DEVICES=0" in environment and f"HOME={paths(variant).state_dir}" in environment


def test_the_process_gets_the_argv_and_the_env_file_values(installed: Host, plan: HostPlan, variant: str) -> None:
    unit, seen_file = unit_name(variant), f"{paths(variant).state_dir}/seen.json"
    installed.run(f"sudo -n rm -f {seen_file}")
    installed.run(f"sudo -n systemctl start {unit}", timeout=60, check=False)

    def seen() -> bool:
        return installed.run(f"sudo -n cat {seen_file} 2>/dev/null", check=False).rstrip().endswith("}")

    journal = f"sudo -n journalctl -u {unit} --no-pager -n 50"
    assert wait_for(seen, timeout=30), installed.run(journal, check=False)
    record = json.loads(installed.run(f"sudo -n cat {seen_file}"))
    assert record["argv"] == expected_argv(plan, variant)
    assert record["env"]["VLLM_API_KEY"] == API_KEY
    assert record["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert record["env"]["HF_HUB_OFFLINE"] == "1"
