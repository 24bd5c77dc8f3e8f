"""Property test: random values of random types in every inventory field never get through unsafely.

Each example is an inventory of one or two hosts: valid data with some fields (and sometimes the
host name, or an extra key) replaced by a random value of a random type, hostile text included
(line breaks, NUL, quotes, ``%``, ``$``, backslashes, ``;``, leading ``-``, unicode) and a
planted key. Values are handed to the inventory through a pickle so that any Python value
(NaN, bytes, nested containers) reaches fleet exactly. ``fleet plan --render DIR`` and
``fleet plan --json`` must then:

* exit 0, 1 or 2 (never 3, a bug), with no traceback;
* print the planted key nowhere (stdout, stderr, ``--json``);
* write nothing outside ``DIR`` (the work folder holds only the inventory and ``DIR``), and
  under ``DIR`` only ``<host>/etc/...`` files;
* render units that ``systemd-analyze verify`` accepts, with exactly the template's directives
  (the same sequence as a unit rendered from plain values) and nothing more.

Example count: ``FLEET_FUZZ_EXAMPLES`` (default 150; CI has 2 cores and ``verify`` is slow, so
the units of each planned example are verified in one call).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleet.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json")
SECRET = "sk-fuzz-Qm7Rt2Lp9Vx4Nw8Kz3Hy6Jb1"
VENV_BIN = "/opt/fleet/vllm/bin/vllm"

BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "model_config": CONFIG,
    "workload": {"p95_input_tokens": 1000, "p95_output_tokens": 200, "prefix_reuse": 0.2, "target_concurrency": 4},
    "gpu": {"sku": "a10-24gb", "count": 1},
}
FIELDS = [
    "model",
    "model_config",
    "served_model_name",
    "weights",
    "kv_cache_dtype",
    "workload",
    "port",
    "bind_address",
    "vllm_version",
    "api_key_ref",
    "api_key",
    "gpu",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "prefix_caching",
    "allow_pcie_tensor_parallel",
    "shutdown_timeout",
    "pip_index_url",
    "ssh_port",
    "ssh_hostname",
    "Port",
    "api_key_rf",
    "rack",
]

NESTED = [f"workload.{k}" for k in BASE["workload"]] + ["gpu.count", "gpu.sku", "gpu.memory_gib", "gpu.nvlink"]

hostile_text = st.text(
    alphabet=st.sampled_from(list("ab-_./:;%$\\\"' \n\r\t\x00#=[]{}~éΩ✓")) | st.characters(),
    max_size=40,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | hostile_text
    | st.binary(max_size=20)
    | st.just(SECRET)
    | st.builds(lambda t: f"/models/{t}", hostile_text)
    | st.sampled_from(["8000", "0.0.0.0", "fp8", "env:KEY", "file:/k", "http://x/simple", "switch", "-x"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=3),
    max_leaves=6,
)
#: Text that is valid where any printable text is (served names, model paths) but hostile where it lands.
printable_hostile = st.text(
    alphabet=st.sampled_from(list("ab09 .:;%$\\\"'#=[]{}~éΩ✓")) | st.characters(categories=["L", "N", "P", "S"]),
    min_size=1,
    max_size=30,
).filter(lambda t: t[0] not in "- " and t[-1] != " ")
landing = st.fixed_dictionaries(
    {},
    optional={
        "served_model_name": printable_hostile,
        "model": st.builds(lambda t: f"/models/{t}", printable_hostile),
        "bind_address": st.sampled_from(["0.0.0.0", "::", "10.0.0.1", "fe80::1"]),
        "pip_index_url": st.sampled_from(["https://idx.internal/simple", "http://10.0.0.1:8080/x?y=%24"]),
    },
)
host_names = st.sampled_from(["h1", "gpu-01", "a.b"]) | hostile_text


@st.composite
def hosts(draw: st.DrawFn) -> list[tuple[Any, Any]]:
    out = []
    for i in range(draw(st.integers(min_value=1, max_value=2))):
        data: Any = {**BASE, "port": 8000 + 10 * i, **draw(landing)}
        for key in draw(st.lists(st.sampled_from(FIELDS + NESTED), max_size=2, unique=True)):
            if "." in key:
                top, sub = key.split(".")
                inner = data[top] if isinstance(data[top], dict) else {}
                data[top] = {**inner, sub: draw(values)}
            else:
                data[key] = draw(values)
        if draw(st.integers(0, 9)) == 0:
            data = draw(values)  # host data that is not a dict at all
        name = draw(host_names) if draw(st.integers(0, 3)) == 0 else f"h{i}"
        out.append((name, data))
    return out


def _keys(unit: str) -> list[str]:
    """Directive names in order, as systemd reads them (continuation lines joined, comments skipped)."""
    keys, logical = [], ""
    for line in unit.splitlines():
        if not logical and line.lstrip().startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        if logical.strip():
            keys.append(logical.split("=", 1)[0].strip() if not logical.startswith("[") else logical.strip())
        logical = ""
    return keys


def _reference_keys(tmp: Path) -> list[str]:
    inv = tmp / "ref.py"
    inv.write_text(f"g = [('ref', {BASE!r})]\n")
    result = CliRunner().invoke(main, ["plan", str(inv), "--render", str(tmp / "ref")])
    assert result.exit_code == 0, result.output
    (unit,) = (tmp / "ref").rglob("*.service")
    return [k for k in _keys(unit.read_text()) if k != "DeviceAllow"]


def _run(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {result.exception!r}")
    return result.exit_code, result.stdout, result.stderr


def _verify(units: list[Path], tmp: Path) -> None:
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    (venv / "bin" / "vllm").chmod(0o755)
    copies = []
    for i, unit in enumerate(units):
        copy = tmp / "verify" / f"fuzz-{i}.service"
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(unit.read_text().replace(VENV_BIN, str(venv / "bin" / "vllm")))
        copies.append(str(copy))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *copies],
        capture_output=True,
        text=True,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Unknown key" not in result.stderr and "Ignoring" not in result.stderr, result.stderr


EXAMPLES = int(os.environ.get("FLEET_FUZZ_EXAMPLES", "150"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(inventory=hosts())
def test_random_values_never_get_through_unsafely(inventory: list[tuple[Any, Any]], tmp_path_factory: Any) -> None:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    work = tmp / "work"
    work.mkdir()
    data = work / "hosts.pickle"
    data.write_bytes(pickle.dumps(inventory))
    inv = work / "fleet.py"
    inv.write_text(f"import pickle as _p\nwith open({str(data)!r}, 'rb') as _f:\n    g = _p.load(_f)\n")
    render = work / "render"
    code, out, err = _run(["plan", str(inv), "--render", str(render)])
    jcode, jout, jerr = _run(["plan", str(inv), "--json"])
    everything = out + err + jout + jerr
    assert code in (0, 1, 2) and jcode == code, everything
    assert "Traceback" not in everything and "internal error" not in everything
    assert SECRET not in everything
    event(f"exit {code}")
    # nothing outside DIR, and inside it only <host>/etc/...
    written = {p.relative_to(work) for p in work.rglob("*") if p.is_file()}
    assert all(p.parts[0] == "render" or p in (Path("hosts.pickle"), Path("fleet.py")) for p in written), written
    for p in written:
        if p.parts[0] == "render":
            assert len(p.parts) >= 4 and p.parts[2] == "etc", p
    if code == 2:
        assert not render.exists() or not any(render.rglob("*"))
        assert json.loads(jout)["exit_code"] == 2
        return
    units = sorted(render.rglob("*.service")) if render.exists() else []
    planned = json.loads(jout)["hosts"]
    assert len(units) == sum(len(h.get("instances", [])) for h in planned)
    if not units:
        return
    reference = _reference_keys(tmp)
    gpus = {(h["host"], i["unit"]): len(i["gpus"]) for h in planned for i in h.get("instances", []) if h["ok"]}
    for unit in units:
        keys = _keys(unit.read_text())
        assert [k for k in keys if k != "DeviceAllow"] == reference, unit.read_text()
        host = unit.relative_to(render).parts[0]
        assert keys.count("DeviceAllow") == 3 + gpus[host, unit.name]
        assert all(math.isfinite(float(v)) for v in re.findall(r"--gpu-memory-utilization (\S+)", unit.read_text()))
    _verify(units, tmp)
    event("units rendered and verified")
