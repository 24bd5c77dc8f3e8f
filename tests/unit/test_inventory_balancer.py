"""The ``balancer`` entry and ``role: balancer`` hosts at the inventory boundary: every bad value
is an error naming the file, the host, the field, the value and the way out, before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError
from fleet.inventory.schema import FLEET_KEYS, haproxy_name
from fleet.inventory.spec import HostSpec, host_spec, load_inventory

BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}
LB: dict[str, Any] = {"kind": "haproxy", "on": "local", "bind": "127.0.0.1:8080"}


def spec(balancer: Any, **extra: Any) -> HostSpec:
    return host_spec("inv.py", "gpu-1", (), {**BASE, "balancer": balancer, **extra})


def problems(balancer: Any, **extra: Any) -> list[str]:
    with pytest.raises(InventoryError) as err:
        spec(balancer, **extra)
    return [str(p) for p in err.value.problems]


def test_the_keys_are_known_to_the_one_validator() -> None:
    assert "balancer" in FLEET_KEYS and "role" in FLEET_KEYS


def test_defaults_and_the_backend_named_after_the_served_model() -> None:
    b = spec(LB).balancer
    assert b is not None
    assert (b.kind, b.on, b.bind, b.admin_socket, b.config, b.timeout_s) == (
        "haproxy", "local", "127.0.0.1:8080", "/run/haproxy/admin.sock", "/etc/haproxy/haproxy.cfg", 5.0,
    )  # fmt: skip
    assert b.backend == "meta-llama_Llama-3.1-8B-Instruct"  # '/' is not a character HAProxy takes in a name
    assert spec(LB, served_model_name="chat model").balancer.backend == "chat_model"  # type: ignore[union-attr]
    assert spec({**LB, "backend": "chat", "timeout_s": 2}).balancer.backend == "chat"  # type: ignore[union-attr]
    assert spec(None).balancer is None


@pytest.mark.parametrize(
    ("text", "name"),
    [("a/b", "a_b"), ("x y\n", "x_y_"), ("ok.name:1-2_3", "ok.name:1-2_3"), ("", "_"), ("é", "_")],
)
def test_haproxy_name(text: str, name: str) -> None:
    assert haproxy_name(text) == name


@pytest.mark.parametrize(
    ("balancer", "field", "says"),
    [
        ({**LB, "kind": "nginx"}, "balancer.kind", "haproxy"),
        ({"on": "local", "bind": "127.0.0.1:80"}, "balancer.kind", "required"),
        ({**LB, "on": "../etc"}, "balancer.on", "'local' (this machine) or an inventory host's name"),
        ({**LB, "admin_socket": "run/haproxy.sock"}, "balancer.admin_socket", "an absolute path of letters"),
        ({**LB, "admin_socket": "/run/my sock"}, "balancer.admin_socket", "in HAProxy's configuration and in socat"),
        ({**LB, "admin_socket": "/run/a#b"}, "balancer.admin_socket", "an absolute path of letters"),
        ({**LB, "admin_socket": "/run/../x.sock"}, "balancer.admin_socket", "without '.' or '..'"),
        ({**LB, "admin_socket": "/" + "s" * 120}, "balancer.admin_socket", "at most 107 bytes"),
        ({**LB, "admin_socket": "/run/a\nb"}, "balancer.admin_socket", "printable"),
        ({**LB, "bind": "8080"}, "balancer.bind", "ADDRESS:PORT"),
        ({**LB, "bind": "lb.internal:8080"}, "balancer.bind", "ADDRESS:PORT"),
        ({**LB, "bind": "0.0.0.0:70000"}, "balancer.bind", "port 1-65535"),
        ({**LB, "bind": "::1:8080"}, "balancer.bind", "in brackets"),
        ({**LB, "backend": "chat/8b"}, "balancer.backend", "HAProxy's rule for backend and server names"),
        ({**LB, "backend": "x" * 101}, "balancer.backend", "1 to 100"),
        ({**LB, "timeout_s": 0}, "balancer.timeout_s", "greater than or equal to 1"),
        ({**LB, "timeout_s": True}, "balancer.timeout_s", "number"),
        ({**LB, "config": "haproxy.cfg"}, "balancer.config", "an absolute path of letters"),
        ({**LB, "config": "/etc/haproxy/"}, "balancer.config", "an absolute file path"),
        ({**LB, "socket": "/run/x"}, "balancer.socket", "unknown key; allowed: kind, on, bind, admin_socket"),
        ({**LB, "admin_sock": "/run/x"}, "balancer.admin_sock", "did you mean 'admin_socket'?"),
        ("haproxy", "balancer", "must be a dict"),
    ],
)
def test_bad_balancer_entries(balancer: Any, field: str, says: str) -> None:
    found = problems(balancer)
    assert any(f"inv.py: host gpu-1: {field}=" in p and says in p for p in found), found


def test_a_misspelt_key_near_balancer_says_did_you_mean() -> None:
    found = problems(None, balancr=LB)
    assert any("balancr=" in p and "did you mean 'balancer'?" in p for p in found), found


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "inv.py"
    path.write_text(text)
    return str(path)


SERVING = (
    "_data = {'model': 'meta-llama/Llama-3.1-8B-Instruct', 'workload': {'p95_input_tokens': 2048, "
    "'p95_output_tokens': 512, 'prefix_reuse': 0.5, 'target_concurrency': 8}, 'gpu': {'sku': 'h100-sxm-80gb', "
    "'count': 1}}\n"
)


def test_a_balancer_host_is_not_a_vllm_host(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        SERVING + "gpus = ([('g1', {'ssh_hostname': '10.0.0.5'}), ('g2', {'port': 8001})], {**_data, 'balancer': "
        "{'kind': 'haproxy', 'on': 'lb1', 'bind': '0.0.0.0:8080'}})\n"
        "balancers = [('lb1', {'role': 'balancer', 'ssh_hostname': '10.0.0.2', 'ssh_port': 2222})]\n",
    )
    loaded = load_inventory(inv)
    assert [h.name for h in loaded.hosts] == ["g1", "g2"]
    assert [(b.name, b.ssh_hostname, b.ssh_port) for b in loaded.balancer_hosts] == [("lb1", "10.0.0.2", 2222)]
    assert all(h.balancer is not None and h.balancer.on == "lb1" for h in loaded.hosts)


def test_a_balancer_on_a_host_the_inventory_does_not_have(tmp_path: Path) -> None:
    bad = "{'kind': 'haproxy', 'on': 'lb9', 'bind': ':8080'}"
    inv = write(tmp_path, SERVING + f"gpus = [('g1', {{**_data, 'balancer': {bad}}})]\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    text = str(err.value)
    assert "host g1: balancer.bind=':8080'" in text  # no address
    inv = write(
        tmp_path,
        SERVING + "gpus = [('g1', {**_data, 'balancer': {'kind': 'haproxy', 'on': 'lb9', 'bind': '0.0.0.0:8080'}}),"
        " ('g2', {**_data, 'port': 8001, 'balancer': {'kind': 'haproxy', 'on': 'g2', 'bind': '0.0.0.0:8080'}})]\n",
    )
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    text = str(err.value)
    want = f"{inv}: host g1: balancer.on='lb9': names host 'lb9', which is not in the inventory with role: balancer"
    assert want in text
    assert "or use on: 'local'" in text
    assert "host g2: balancer.on='g2': names this host itself, which serves vLLM" in text


def test_two_backends_on_one_frontend(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        SERVING + "a = [('g1', {**_data, 'balancer': {'kind': 'haproxy', 'on': 'local', 'bind': '0.0.0.0:8080'}})]\n"
        "b = [('g2', {**_data, 'port': 8001, 'served_model_name': 'other', 'balancer': {'kind': 'haproxy', "
        "'on': 'local', 'bind': '0.0.0.0:8080'}})]\n",
    )
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    assert (
        "host g2: balancer.bind='0.0.0.0:8080': haproxy on this machine (/run/haproxy/admin.sock) already listens "
        "there for backend 'meta-llama_Llama-3.1-8B-Instruct' (host g1)"
    ) in str(err.value)


def test_serving_keys_on_a_balancer_host_and_a_bad_role(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        SERVING + "gpus = [('g1', _data)]\nbalancers = [('lb1', {'role': 'balancer', 'model': 'x/y', "
        "'ssh_port': '22'})]\nodd = [('g3', {**_data, 'port': 8100, 'role': 'router'})]\n",
    )
    with pytest.raises(InventoryError) as err:
        load_inventory(inv)
    text = str(err.value)
    assert "host lb1: model='x/y': a host with role: balancer runs a load balancer, not vLLM" in text
    assert "host lb1: ssh_port='22': must be a valid integer" in text
    assert "host g3: role='router': must be 'vllm' or 'balancer'" in text
