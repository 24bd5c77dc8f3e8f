"""Inventories: pyinfra's format, data precedence, and errors that name file, host, field, value."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.errors import InventoryError
from fleet.inventory.spec import load_inventory

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


def test_unrelated_keys_are_left_alone(tmp_path: Path) -> None:
    path = write(tmp_path, f'h = [("h1", {{"model": "m/x", "workload": {WL}, "rack": "r12", "ssh_user": "x"}})]\n')
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
