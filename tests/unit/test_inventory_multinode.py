"""The multi-node keys of the inventory (``multi_node``, ``master_port``, ``pipeline_parallel_size``):
checked where they enter, across the hosts of a group, before anything runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError
from fleet.inventory.spec import load_inventory

WORKLOAD = {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8}
ONE_H100 = {"sku": "h100-sxm-80gb", "count": 1}


def write(tmp_path: Path, hosts: dict[str, dict[str, Any]], group: dict[str, Any] | None = None) -> Path:
    rows = [(name, {"ssh_hostname": f"127.0.250.{i + 3}", **data}) for i, (name, data) in enumerate(hosts.items())]
    data = {"model": "meta-llama/Llama-3.1-70B-Instruct", "workload": WORKLOAD, "multi_node": True, **(group or {})}
    path = tmp_path / "fleet.py"
    path.write_text(f"gpu_nodes = ({rows!r}, {data!r})\n")
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(InventoryError) as exc:
        load_inventory(path)
    return [str(p) for p in exc.value.problems]


def test_a_multi_node_group_loads_with_vllms_default_rendezvous_port(tmp_path: Path) -> None:
    path = write(tmp_path, {"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100}})
    loaded = load_inventory(path)
    assert [(s.multi_node, s.master_port, s.pipeline_parallel_size) for s in loaded.hosts] == [(True, 29501, None)] * 2


@pytest.mark.parametrize(
    ("hosts", "field", "names"),
    [
        ({"n1": {"gpu": ONE_H100}, "n2": {"gpu": {"sku": "h200-sxm-141gb", "count": 1}}}, "gpu", "n2"),
        ({"n1": {"gpu": ONE_H100}, "n2": {"gpu": {"sku": "h100-sxm-80gb", "count": 2}}}, "gpu", "n2"),
        (
            {"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100, "nvidia_driver_version": "580.105.08"}},
            "nvidia_driver_version",
            "n2",
        ),
        ({"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100, "weights": "fp8"}}, "weights", "n2"),
        ({"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100, "port": 8100}}, "port", "n2"),
    ],
)
def test_hosts_that_cannot_share_an_instance_are_refused_and_named(
    tmp_path: Path, hosts: dict[str, dict[str, Any]], field: str, names: str
) -> None:
    found = problems(write(tmp_path, hosts))
    assert len(found) == 1, found
    text = found[0]
    assert f"host {names}" in text and f"{field}" in text and "fleet.py" in text
    assert "host n1's" in text and "multi-node instance" in text and f"differing: {names}" in text


def test_a_rendezvous_port_on_a_serving_port_is_refused(tmp_path: Path) -> None:
    found = problems(write(tmp_path, {"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100}}, {"master_port": 8000}))
    assert len(found) == 2
    for host, text in zip(("n1", "n2"), found, strict=True):
        assert f"host {host}" in text and "master_port" in text and "8000" in text
        assert "multi-node rendezvous port 8000" in text and "collides with its own vLLM port 8000" in text


def test_a_rendezvous_port_on_the_ssh_port_is_refused(tmp_path: Path) -> None:
    found = problems(write(tmp_path, {"n1": {"gpu": ONE_H100, "ssh_port": 2222}}, {"master_port": 2222}))
    assert len(found) == 1 and "ssh port 2222" in found[0] and "master_port" in found[0]


def test_rendezvous_keys_without_multi_node_are_refused_with_the_way_out(tmp_path: Path) -> None:
    path = write(tmp_path, {"n1": {"gpu": ONE_H100}}, {"multi_node": False, "master_port": 29600})
    (text,) = problems(path)
    assert "master_port" in text and "29600" in text and "set multi_node: true" in text


def test_a_pinned_pipeline_longer_than_the_group_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, {"n1": {"gpu": ONE_H100}, "n2": {"gpu": ONE_H100}}, {"pipeline_parallel_size": 3})
    (text,) = problems(path)
    assert "pipeline_parallel_size" in text and "has 2 multi-node host(s) (n1, n2)" in text and "at most 2" in text


@pytest.mark.parametrize(
    ("key", "value"),
    [("multi_node", 1), ("multi_node", "yes"), ("master_port", 80), ("master_port", "29501"),
     ("pipeline_parallel_size", 1), ("pipeline_parallel_size", True)],
)  # fmt: skip
def test_multi_node_values_are_typed_as_written(tmp_path: Path, key: str, value: object) -> None:
    (text,) = problems(write(tmp_path, {"n1": {"gpu": ONE_H100}}, {key: value}))
    assert key in text and "host n1" in text
