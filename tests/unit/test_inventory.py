"""Inventories: pyinfra's format, data precedence, and errors that name file, host, field, value."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.errors import FieldProblem, InventoryError
from fleet.inventory.ports import Listener, collisions, plan_port_problems
from fleet.inventory.spec import load_inventory
from fleet.secrets import looks_like_secret, redact, redact_data

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "fleet.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


WL = '{"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 8}'


def test_example_prod_inventory_loads() -> None:
    inv = load_inventory(REPO / "inventory" / "prod.py")
    names = [h.name for h in inv.hosts]
    assert "gpu-h100-01" in names and "edge-a10-01" in names
    h100 = inv.host("gpu-h100-03")
    assert h100.model == "meta-llama/Llama-3.1-70B-Instruct"  # group data
    assert h100.kv_cache_dtype == "fp8"  # host data beats group data
    assert "h100_chat" in h100.groups and "prod" in h100.groups  # file-name group, like pyinfra
    assert h100.api_key_ref is not None and str(h100.api_key_ref) == "env:FLEET_PROD_API_KEY"


def test_group_data_directory_and_precedence(tmp_path: Path) -> None:
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text(f"workload = {WL}\nport = 9000\n")
    (tmp_path / "group_data" / "gpus.py").write_text('model = "mistralai/Mistral-7B-Instruct-v0.3"\n')
    path = write(tmp_path, 'gpus = [("a", {"port": 9100}), "b"]\n_private = ["ignored"]\n')
    inv = load_inventory(path)
    a, b = inv.host("a"), inv.host("b")
    assert (a.port, b.port) == (9100, 9000)
    assert a.model == b.model == "mistralai/Mistral-7B-Instruct-v0.3"
    assert [h.name for h in inv.hosts] == ["a", "b"]


def test_every_problem_is_listed_with_file_host_field_value(tmp_path: Path) -> None:
    text = f"""
bad = [
    ("h1", {{"model": "m/x", "workload": {WL}, "port": 80, "weights": "int3"}}),
    ("h2", {{"model": "m/x", "workload": {{"p95_input_tokens": -5, "p95_output_tokens": 1,
            "prefix_reuse": 1.5, "target_concurrency": 1}}, "gpu_memory_utilization": 1.0}}),
    ("h3", {{"workload": {WL}, "gpu": {{"sku": "h100-80gb"}}}}),
]
"""
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    problems = {(p.host, p.field): p for p in err.value.problems}
    assert problems["h1", "port"].value == 80 and "1024" in problems["h1", "port"].allowed
    assert "int4" in problems["h1", "weights"].allowed
    assert problems["h2", "workload.p95_input_tokens"].value == -5
    assert problems["h2", "workload.prefix_reuse"].value == 1.5
    assert "0.95" in problems["h2", "gpu_memory_utilization"].allowed  # never 1.0
    assert ("h3", "model") in problems
    assert "h100-sxm-80gb" in problems["h3", "gpu.sku"].allowed
    text_out = str(err.value)
    assert str(path) in text_out and "host h2" in text_out


def test_a_literal_api_key_is_refused_and_not_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, f'h = [("h1", {{"model": "m/x", "workload": {WL}, "api_key_ref": "sk-live-12345"}})]\n')
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert "sk-live-12345" not in str(err.value)
    assert "env:VARIABLE" in str(err.value)


def test_typo_of_a_fleet_key_is_caught(tmp_path: Path) -> None:
    path = write(tmp_path, f'h = [("h1", {{"model": "m/x", "workload": {WL}, "kv_cache_dtpye": "fp8"}})]\n')
    with pytest.raises(InventoryError, match="did you mean 'kv_cache_dtype'"):
        load_inventory(path)


def test_pyinfra_keys_and_declared_own_keys_are_left_alone(tmp_path: Path) -> None:
    data = f'"model": "m/x", "workload": {WL}, "ssh_user": "x", "_sudo": True, "x_rack": "r12", "dc": "ams"'
    path = write(tmp_path, f'h = [("h1", {{{data}, "user_keys": ["dc"]}})]\n')
    assert load_inventory(path).host("h1").model == "m/x"


def test_limit_by_group_and_glob(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"a = ([\"a1\", \"a2\"], {{'model': 'm/x', 'workload': {WL}}})\n"
        f"b = ([\"b1\"], {{'model': 'm/x', 'workload': {WL}}})\n",
    )
    assert [h.name for h in load_inventory(path, ["b"]).hosts] == ["b1"]
    assert [h.name for h in load_inventory(path, ["a*"]).hosts] == ["a1", "a2"]
    with pytest.raises(InventoryError, match="matches no host"):
        load_inventory(path, ["zzz"])


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="no such file"):
        load_inventory(tmp_path / "nope.py")
    with pytest.raises(InventoryError, match="does not run"):
        load_inventory(write(tmp_path, "hosts = [\n"))


def test_group_data_values_name_their_own_file(tmp_path: Path) -> None:
    (tmp_path / "group_data").mkdir()
    gd = tmp_path / "group_data" / "gpus.py"
    gd.write_text(f'model = "a/b"\nworkload = {WL}\nport = 80\n')
    path = write(tmp_path, 'gpus = [("a", {"weights": "int3"})]\n')
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    where = {p.field: p.inventory for p in err.value.problems}
    assert where == {"port": str(gd), "weights": str(path)}


def test_inventory_exceptions_and_exit_are_invalid_input_with_the_line(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"fleet\.py:3: the file calls sys\.exit\(0\)"):
        load_inventory(write(tmp_path, "import sys\nh = ['a']\nsys.exit(0)\n"))
    with pytest.raises(InventoryError, match=r"fleet\.py:2: the file does not run: FileNotFoundError"):
        load_inventory(write(tmp_path, "h = ['a']\nopen('/nonexistent/x')\n"))


def test_a_host_defined_twice_must_agree(tmp_path: Path) -> None:
    same = f"a = [('h1', {{'model': 'm/x', 'workload': {WL}}})]\nb = [('h1', {{'model': 'm/x'}}), 'h1']\n"
    inv = load_inventory(write(tmp_path, same))
    assert [h.name for h in inv.hosts] == ["h1"] and set(inv.host("h1").groups) >= {"a", "b"}
    differ = f"a = [('h1', {{'model': 'm/x', 'workload': {WL}}})]\nb = [('h1', {{'model': 'm/y'}})]\n"
    with pytest.raises(InventoryError, match="defined twice with different model: group a says 'm/x', group b says"):
        load_inventory(write(tmp_path, differ))


def test_lab_profile_is_refused_with_the_way_out(tmp_path: Path) -> None:
    data = f"{{'model': 'm/x', 'workload': {WL}, 'lab_profile': 'h100-sxm-8'}}"
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, f"lab = [('h1', {data})]\n"))
    message = str(err.value)
    assert "lab_profile='h100-sxm-8': no longer read" in message and "gpu: {sku, count, nvlink}" in message


def test_ssh_fields_load(tmp_path: Path) -> None:
    ssh = "'ssh_port': 2222, 'ssh_hostname': '127.0.0.5'"
    data = f"{{'model': 'm/x', 'workload': {WL}, {ssh}}}"
    spec = load_inventory(write(tmp_path, f"lab = [('h1', {data})]\n")).host("h1")
    assert (spec.ssh_port, spec.ssh_hostname, spec.machine) == (
        2222,
        "127.0.0.5",
        "127.0.0.5",
    )


def test_problems_on_every_host_are_reported_together(tmp_path: Path) -> None:
    path = write(
        tmp_path, f"g = [('h1', {{'workload': {WL}}}), ('h2', {{'model': 'm/x', 'workload': {WL}, 'port': 5}})]\n"
    )
    with pytest.raises(InventoryError) as err:
        load_inventory(path)
    assert {(p.host, p.field) for p in err.value.problems} == {("h1", "model"), ("h2", "port")}


def test_limit_still_sees_other_hosts_ports(tmp_path: Path) -> None:
    data = f"'model': 'm/x', 'workload': {WL}, 'ssh_hostname': 'box'"
    path = write(tmp_path, f"g = [('h1', {{{data}}}), ('h2', {{{data}}})]\n")
    with pytest.raises(InventoryError, match="collides with host h2"):
        load_inventory(path, ["h1"])


# -- secrets (fleet/secrets.py) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "value, secret",
    [
        ("sk-proj-Zx81Qw7Lm2Pv9Rt4Yu6Io3", True),
        ("hf_abcdefghijklmnopqrst", True),
        ("ghp_abcdefghijklmnop1234", True),
        ("AKIAABCDEFGHIJKLMNOP", True),
        ("Bearer abcdefghijkl", True),
        ("https://bob:pw@idx/simple", True),
        ("Zx81Qw7Lm2Pv9Rt4Yu6Io3Pa", True),  # random-looking token
        (b"hf_abcdefghijklmnopqrst", True),
        ({"nested": ["hf_abcdefghijklmnopqrst"]}, True),
        ("meta-llama/Llama-3.1-70B-Instruct", False),
        ("/root/.cache/huggingface/hub/models--x/snapshots/0123456789abcdef0123456789abcdef01234567", False),
        ("env:FLEET_PROD_API_KEY", False),
        ("gpu-h100-01.prod.internal", False),
        ("desk-01", False),
        (8000, False),
    ],
)
def test_what_looks_like_a_secret(value: object, secret: bool) -> None:
    assert looks_like_secret(value) is secret


def test_redact_keeps_the_rest_of_the_text() -> None:
    assert redact("key hf_abcdefghijklmnopqrst here") == "key <redacted> here"
    assert redact("nothing secret: port 8000") == "nothing secret: port 8000"


#: Made with ssh-keygen (test keys, used nowhere): public halves and fingerprints are not secrets.
ED25519_PUB = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINgKGBVBcyLulsPywyQO3Zr0w689J7h/z/nrOqNzGnKS"
ECDSA_PUB = (
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBJHqrsJDQgs3XE2AwgCvzP+g0FTnV7WOFbJcMe"
    "7Qn7h2meOfazlZGseyaJ5a3Z3S7qb1XVQDk44ZFTT7Q5+YRJY="
)
FINGERPRINT = "SHA256:RfGXgN3c0gj9SMkTtqVy1KNm64uHzK5ec2nQcdMGVV0"


@pytest.mark.parametrize(
    "text",
    [
        ED25519_PUB,
        ECDSA_PUB,
        f"[127.0.10.12]:22 {ED25519_PUB}",
        f"expected ED25519 {FINGERPRINT}, the host offered ED25519 SHA256:T+TE05DREb4pnXuqJK8JroM14YSsUa85Jj07ORWvmOg",
        "sk-ecdsa-sha2-nistp256@openssh.com and sk-ssh-ed25519-cert-v01@openssh.com",
    ],
)
def test_public_keys_and_fingerprints_are_shown_as_they_are(text: str) -> None:
    """Issue 25.7: a changed host key's error showed the keys with parts replaced by <redacted>,
    so an operator could not compare them."""
    assert redact(text) == text
    assert not looks_like_secret(text)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"{FINGERPRINT} hf_abcdefghijklmnopqrst", f"{FINGERPRINT} <redacted>"),
        (f"{ED25519_PUB} sk-proj-Zx81Qw7Lm2Pv9Rt4Yu6Io3", f"{ED25519_PUB} <redacted>"),
        ("SHA256:Zx81Qw7Lm2Pv9Rt4Yu6Io3", "SHA256:<redacted>"),  # not a fingerprint's shape: a token
        ("AAAAZx81Qw7Lm2Pv9Rt4Yu6Io3Pa", "<redacted>"),  # base64 that is not a key blob
        # an OpenSSH private key's base64 (b3BlbnNzaC1rZXktdjE = "openssh-key-v1")
        ("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW", "<redacted>"),
    ],
)
def test_real_secrets_beside_public_keys_are_still_redacted(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_redact_data_redacts_every_string_keys_too_however_often_it_repeats() -> None:
    token = "hf_abcdefghijklmnopqrst"
    host = {"argv": ["--api-key", token], token: "x", "note": f"key {token}", "port": 8000, "ok": True}
    data = {"hosts": [host, dict(host), (token, None)], "n": 1.5}
    clean = {"argv": ["--api-key", "<redacted>"], "<redacted>": "x", "note": "key <redacted>", "port": 8000, "ok": True}
    assert redact_data(data) == {"hosts": [clean, clean, ["<redacted>", None]], "n": 1.5}


def test_a_problem_never_keeps_a_secret_value() -> None:
    p = FieldProblem("inv.py", "h1", "rack", "hf_abcdefghijklmnopqrst", "x")
    assert "hf_" not in repr(p) and "hf_" not in str(p) and "hf_" not in str(p.data())
    assert "letmein" not in repr(FieldProblem("inv.py", "h1", "api_key", "letmein", "x", secret=True))


# -- ports across hosts (fleet/inventory/ports.py) ------------------------------------------------


def _listener(host: str, machine: str, address: str | None, first: int, last: int, what: str = "vLLM") -> Listener:
    return Listener(host, "inv.py", machine, address, first, last, what, "port")


@pytest.mark.parametrize(
    "a, b, clash",
    [
        (_listener("a", "m1", None, 8000, 8003), _listener("b", "m1", None, 8003, 8003), True),
        (_listener("a", "m1", None, 8000, 8003), _listener("b", "m1", None, 8004, 8007), False),
        (_listener("a", "m1", "10.0.0.1", 8000, 8000), _listener("b", "m1", "10.0.0.2", 8000, 8000), False),
        (_listener("a", "m1", "10.0.0.1", 8000, 8000), _listener("b", "m1", "0.0.0.0", 8000, 8000), True),
        (_listener("a", "m1", "10.0.0.1", 8000, 8000), _listener("b", "m2", "10.0.0.1", 8000, 8000), True),
        (_listener("a", "m1", "127.0.0.1", 8000, 8000), _listener("b", "m2", "127.0.0.1", 8000, 8000), False),
        (_listener("a", "m1", None, 8000, 8000), _listener("b", "m2", None, 8000, 8000), False),
        (_listener("a", "m1", None, 22, 22, "ssh"), _listener("a", "m1", "10.0.0.1", 20, 23), True),
    ],
)
def test_port_collisions(a: Listener, b: Listener, clash: bool) -> None:
    assert bool(collisions([a, b])) is clash


def test_planned_ports_are_checked_too() -> None:
    from tests.unit.conftest import spec

    one, two = spec("h1", ssh_hostname="box"), spec("h2", ssh_hostname="box", port=8002)
    assert plan_port_problems([(one, [8000, 8001]), (two, [8002])]) == []
    (problem,) = plan_port_problems([(one, [8000, 8001, 8002]), (two, [8002])])
    assert problem.host == "h1" and "host h2" in problem.allowed


def test_port_collisions_name_the_file_the_port_is_written_in(tmp_path: Path) -> None:
    (tmp_path / "group_data").mkdir()
    gd = tmp_path / "group_data" / "g.py"
    gd.write_text(f"model = 'm/x'\nworkload = {WL}\nport = 9000\nssh_hostname = 'box'\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(write(tmp_path, "g = ['h1', 'h2']\n"))
    (problem,) = err.value.problems
    assert problem.inventory == str(gd) and problem.field == "port" and "collides with host h2" in problem.allowed
