"""Which top-level keys an inventory may hold, and every problem on every host in one pass.

A key is fleet's (``schema.KNOWN_KEYS``), pyinfra's own (read from the installed pyinfra), or the
operator's (``x_...`` or listed in ``user_keys``); anything else is an error with "did you mean"
and the way to keep it. A missing model config on one host is reported together with a bad value
on another (``load_for_planning``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api.arguments import all_global_arguments
from pyinfra.connectors.docker import DockerConnector
from pyinfra.connectors.ssh import SSHConnector

from fleet.errors import InventoryError
from fleet.inventory.pyinfra_keys import pyinfra_keys
from fleet.inventory.schema import KNOWN_KEYS
from fleet.inventory.spec import host_spec, load_inventory
from fleet.model.arch import load_model
from fleet.plan.outcomes import load_for_planning

REPO = Path(__file__).resolve().parents[2]
WL = {"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 8}
BASE: dict[str, Any] = {"model": "meta-llama/Llama-3.1-8B-Instruct", "workload": WL}


def problems(extra: dict[str, Any]) -> list[str]:
    try:
        host_spec("inv.py", "h1", (), {**BASE, **extra})
    except InventoryError as exc:
        return [str(p) for p in exc.problems]
    return []


@pytest.mark.parametrize(
    "extra",
    [
        {"ssh_user": "fleet", "ssh_key": "/k", "ssh_strict_host_key_checking": "yes", "ssh_connect_retries": 2},
        {"ssh_paramiko_connect_kwargs": {"banner_timeout": 30}, "ssh_file_transfer_protocol": "scp"},
        {"_sudo": True, "_sudo_user": "root", "_su_user": "x", "_env": {"A": "1"}, "_shell_executable": "bash"},
        {"_retries": 2, "_timeout": 30, "_get_pty": False, "_chdir": "/tmp", "_serial": False},
        {"docker_identifier": "img", "docker_platform": "linux/amd64", "chroot_directory": "/srv/c"},
        {"x_rack": "r12", "x_owner": {"team": "infra"}},
        {"rack": "r12", "datacenter": "ams", "user_keys": ["rack", "datacenter"]},
        {"rack": "r12", "user_keys": ("rack",)},
        {"fleet_lab": {"name": "lab", "state_root": "/var/lib/fleet-lab"}},
        {"reboot_command": ["/usr/local/bin/power-cycle", "--host", "gpu 07"]},
        {"reboot_command": ("/usr/bin/ipmitool", "power", "cycle")},
    ],
    ids=["ssh", "ssh-more", "privileges", "execution", "other-connectors", "x_-prefix", "user_keys", "user_keys-tuple",
         "fleet_lab", "reboot_command", "reboot_command-tuple"],
)  # fmt: skip
def test_keys_that_are_someones(extra: dict[str, Any]) -> None:
    assert problems(extra) == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"served_name": "x"}, ["served_name='x': unknown field", "did you mean 'served_model_name'?",
                                "name it x_served_name, or list it in user_keys"]),
        ({"modle": "a/b"}, ["did you mean 'model'?"]),
        ({"tensor_parallel": 2}, ["did you mean 'tensor_parallel_size'?"]),
        ({"rack": "r12"}, ["rack='r12': unknown field (not fleet's, not pyinfra's own). If it is your own data: "
                           "name it x_rack, or list it in user_keys (e.g. user_keys = ['rack'] in group_data/all.py)"]),
        ({"ssh_usr": "fleet"}, ["did you mean 'ssh_user'?"]),
        ({"ssh_hostnme": "a"}, ["did you mean 'ssh_hostname'?"]),
        ({"_sudoo": True}, ["_sudoo=True: unknown field", "did you mean '_sudo'?", "name it x_sudoo"]),
        ({"winrm_user": "a"}, ["winrm_user='a': unknown field"]),  # no winrm connector in pyinfra 3.10
        ({"rack": "r12", "user_keys": ["datacenter"]}, ["rack='r12': unknown field"]),
        ({"user_keys": "rack"}, ["user_keys='rack': must be a valid list"]),
        ({"user_keys": ["port"]}, ["user_keys=['port']: 'port' is a key fleet reads, not your own data"]),
        ({"user_keys": ["two words"]}, ["user_keys=['two words']: a key name"]),
        ({"fleet_lab": {"name": "lab"}}, ["fleet_lab.state_root=None: required"]),
        ({"fleet_lab": {"name": "lab", "state_root": "rel"}}, ["fleet_lab.state_root='rel': an absolute path"]),
        ({"fleet_lab": {"name": "lab", "state_root": "/s", "root": "/"}}, ["fleet_lab.root='/': unknown key"]),
        ({"reboot_command": "/sbin/reboot now"}, ["reboot_command='/sbin/reboot now'", "a list of words"]),
        ({"reboot_command": []}, ["reboot_command=[]", "at least 1 item"]),
        ({"reboot_command": ["power-cycle", "h1"]}, ["the first an absolute path"]),
        ({"reboot_command": ["/bin/cycle", "h1\nreboot"]}, ["'h1\\nreboot']", "no line breaks"]),
        ({"reboot_command": ["/bin/cycle", 7]}, ["reboot_command=['/bin/cycle', 7]"]),
    ],
    ids=["served_name", "modle", "tensor_parallel", "rack", "ssh_usr", "ssh_hostnme", "_sudoo", "winrm", "undeclared",
         "user_keys-str", "user_keys-fleet-key", "user_keys-bad-name", "lab-missing", "lab-relative", "lab-extra",
         "reboot-string", "reboot-empty", "reboot-relative", "reboot-newline", "reboot-not-a-word"],
)  # fmt: skip
def test_keys_that_are_nobodys(extra: dict[str, Any], expected: list[str]) -> None:
    found = problems(extra)
    assert len(found) == 1, found
    for text in expected:
        assert text in found[0]


def test_pyinfra_keys_come_from_pyinfra() -> None:
    keys = pyinfra_keys()
    assert {name for name, _ in all_global_arguments()} <= keys  # every operation global argument
    assert set(SSHConnector.data_meta) <= keys and set(DockerConnector.data_meta) <= keys
    assert {"ssh_user", "ssh_port", "_sudo", "_su_user", "_env", "_shell_executable", "chroot_directory"} <= keys
    assert not keys & set(KNOWN_KEYS)  # no key is both fleet's and pyinfra's
    assert "served_name" not in keys and "rack" not in keys


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.py"
    path.write_text(text)
    return path


def test_every_problem_on_every_host_in_one_pass(tmp_path: Path) -> None:
    gpu = {"sku": "a10-24gb"}
    path = write(
        tmp_path,
        f"g = [\n"
        f"  ('a', {{**{BASE!r}, 'gpu': {gpu!r}, 'served_name': 'x', 'port': '8000'}}),\n"
        f"  ('b', {{'model': 'nobody/none', 'workload': {WL!r}, 'gpu': {gpu!r}}}),\n"
        f"  ('c', {{'model': 'nobody/none', 'workload': {WL!r}, 'port': 1}}),\n"
        f"  ('d', {{**{BASE!r}, 'gpu': {gpu!r}, 'port': 9000}}),\n"
        f"]\n",
    )
    with pytest.raises(InventoryError) as err:
        load_for_planning(path)
    found = [(p.host, p.field) for p in err.value.problems]
    assert found == [("a", "served_name"), ("a", "port"), ("b", "model"), ("c", "port"), ("c", "model")]
    b = err.value.problems[2]
    assert (b.inventory, b.value) == (str(path), "nobody/none")
    assert "no config.json for model 'nobody/none'" in b.allowed
    assert "model_config" in b.allowed  # the way out
    with pytest.raises(InventoryError) as only:  # without a model check (status, audit) only the inventory's own
        load_inventory(path)
    assert [(p.host, p.field) for p in only.value.problems] == [("a", "served_name"), ("a", "port"), ("c", "port")]


def test_model_config_is_named_when_it_is_the_one_given(tmp_path: Path) -> None:
    path = write(tmp_path, f"g = [('a', {{**{BASE!r}, 'model_config': '{tmp_path}/none.json'}})]\n")
    with pytest.raises(InventoryError) as err:
        load_for_planning(path)
    (problem,) = err.value.problems
    assert (problem.field, problem.value) == ("model_config", f"{tmp_path}/none.json")
    assert "no such file" in problem.allowed


def test_each_model_is_read_once(tmp_path: Path) -> None:
    hosts = ", ".join(f"('h{i}', {{**{BASE!r}, 'port': {8000 + i * 10}}})" for i in range(50))
    path = write(tmp_path, f"g = [{hosts}]\n")
    calls: list[tuple[str, str | None]] = []

    def counting(model: str, config: str | None) -> object:
        calls.append((model, config))
        return load_model(model, config)

    assert len(load_inventory(path, model_check=counting).hosts) == 50
    assert calls == [("meta-llama/Llama-3.1-8B-Instruct", None)]


def test_example_inventory_loads_for_planning() -> None:
    assert len(load_for_planning(REPO / "inventory" / "prod.py").hosts) == 6


def test_the_labs_own_inventory_loads_for_planning(tmp_path: Path) -> None:
    from fleetlab.apt_repo import AptRepo
    from fleetlab.balancer import balancer_entry
    from fleetlab.inventory_writer import render_inventory
    from fleetlab.state import HostRecord, LabDir, LabState

    lab = LabDir("keys", state_root=tmp_path / "state")
    keyring = tmp_path / "nvidia.gpg"
    keyring.write_bytes(b"key")
    state = LabState("keys", 42, hosts=[HostRecord("keys-h1", 1, "127.0.42.11", "h100-sxm-8"),
                                         HostRecord("keys-h2", 2, "127.0.42.12", "l40s-4", bare=True)])  # fmt: skip
    apt = AptRepo("http://127.0.0.1:9/apt", "debian12/x86_64", keyring, "ABCD", tmp_path)
    path = tmp_path / "inventory.py"
    for balancer in (None, balancer_entry(lab, state)):  # `fleet lab up`, and `fleet lab up --lb`
        path.write_text(render_inventory(lab, state, "http://127.0.0.1:9/simple", apt, balancer))
        loaded = load_for_planning(path)
        assert [h.name for h in loaded.hosts] == ["keys-h1", "keys-h2"]
        assert (loaded.hosts[0].balancer is not None) == (balancer is not None)
        data = loaded.pyinfra.get_host("keys-h1").data.dict()  # type: ignore[no-untyped-call]
        assert data["fleet_lab"] == {"name": "keys", "state_root": str(tmp_path / "state")}
        # a deploy power-cycles a lab host through what the lab wrote, not through an import of the lab
        assert loaded.hosts[1].reboot_command == (
            sys.executable, "-m", "fleet.cli", "lab", "restart", "--name", "keys", "--state-root",
            str(tmp_path / "state"), "keys-h2",
        )  # fmt: skip


def test_a_balancer_host_holds_pyinfras_keys_and_its_own_only(tmp_path: Path) -> None:
    balancer = {"role": "balancer", "ssh_hostname": "127.0.0.9", "ssh_user": "lb", "x_rack": "r1", "ssh_usr": "x"}
    serving = {**BASE, "balancer": {"kind": "haproxy", "on": "lb1", "bind": "127.0.0.9:8080"}}
    path = write(tmp_path, f"balancers = [('lb1', {balancer!r})]\nservers = [('h1', {serving!r})]\n")
    with pytest.raises(InventoryError) as err:
        load_for_planning(path)
    mine = [p for p in err.value.problems if p.host == "lb1"]
    assert [(p.field, "did you mean 'ssh_user'?" in p.allowed) for p in mine] == [("ssh_usr", True)]
    fixed = {k: v for k, v in balancer.items() if k != "ssh_usr"}
    path.write_text(f"balancers = [('lb1', {fixed!r})]\nservers = [('h1', {serving!r})]\n")
    assert [b.name for b in load_for_planning(path).balancer_hosts] == ["lb1"]
