"""The deploy's keys (NVIDIA apt repository and driver, vLLM extras, releases kept) and the
``rollout``/``alerts`` keys, validated at the inventory boundary like every other key: the error
names the file, the host, the field, the value and what is allowed."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleet.errors import InventoryError
from fleet.inventory.spec import HostSpec, host_spec, load_inventory

BASE: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "workload": {"p95_input_tokens": 2048, "p95_output_tokens": 512, "prefix_reuse": 0.5, "target_concurrency": 8},
}


@pytest.fixture
def keyring(tmp_path: Path) -> str:
    key = tmp_path / "nvidia.gpg"
    key.write_bytes(b"\x99\x01")
    return str(key)


def spec(extra: dict[str, Any]) -> HostSpec:
    return host_spec("inv.py", "gpu-1", (), {**BASE, **extra})


def problems(extra: dict[str, Any]) -> list[str]:
    with pytest.raises(InventoryError) as err:
        spec(extra)
    return [str(p) for p in err.value.problems]


def with_mirror(keyring: str, **extra: Any) -> dict[str, Any]:
    return {"nvidia_apt_url": "https://mirror.internal/cuda/repos", "nvidia_apt_keyring": keyring, **extra}


# -- good values --------------------------------------------------------------------------------


def test_defaults_when_no_key_is_given() -> None:
    s = spec({})
    assert (s.nvidia_apt_url, s.nvidia_apt_keyring, s.nvidia_fabric_manager) == (None, None, None)
    assert s.nvidia_driver_version == "580.95.05"  # the vLLM 0.33 series' driver
    assert (s.vllm_extras, s.releases_kept) == ((), 3)


@pytest.mark.parametrize(
    ("extra", "field", "want"),
    [
        ({"nvidia_apt_url": "http://10.0.0.5:8080/cuda/"}, "nvidia_apt_url", "http://10.0.0.5:8080/cuda/"),
        ({"nvidia_apt_url": "file:///srv/mirror/cuda"}, "nvidia_apt_url", "file:///srv/mirror/cuda"),
        ({"nvidia_driver_version": "580.65.06"}, "nvidia_driver_version", "580.65.06"),
        ({"nvidia_driver_version": "590.12"}, "nvidia_driver_version", "590.12"),
        ({"nvidia_fabric_manager": False}, "nvidia_fabric_manager", False),
        ({"nvidia_fabric_manager": True}, "nvidia_fabric_manager", True),
        ({"vllm_extras": ["audio", "video"]}, "vllm_extras", ("audio", "video")),
        ({"vllm_extras": ("flash-attn",)}, "vllm_extras", ("flash-attn",)),
        ({"vllm_extras": []}, "vllm_extras", ()),
        ({"releases_kept": 2}, "releases_kept", 2),
        ({"releases_kept": 100}, "releases_kept", 100),
    ],
)
def test_good_values(keyring: str, extra: dict[str, Any], field: str, want: object) -> None:
    assert getattr(spec(with_mirror(keyring, **extra)), field) == want


def test_the_keyring_is_the_path_given(keyring: str) -> None:
    assert spec(with_mirror(keyring)).nvidia_apt_keyring == keyring


# -- bad types, bad values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # bad types: values as written, no coercion
        ({"nvidia_apt_url": 8080}, "nvidia_apt_url=8080: must be a valid string: a URL"),
        ({"nvidia_apt_keyring": ["/k.gpg"]}, "nvidia_apt_keyring=['/k.gpg']: must be a valid string"),
        ({"nvidia_driver_version": 580}, "nvidia_driver_version=580: must be a valid string: a driver version"),
        ({"nvidia_driver_version": 580.95}, "nvidia_driver_version=580.95: must be a valid string"),
        ({"nvidia_fabric_manager": 1}, "nvidia_fabric_manager=1: must be a valid boolean: true or false"),
        ({"nvidia_fabric_manager": "yes"}, "nvidia_fabric_manager='yes': must be a valid boolean"),
        ({"vllm_extras": "audio"}, "vllm_extras='audio': must be a valid list: a list of vLLM extra names"),
        ({"vllm_extras": [1]}, "vllm_extras=[1]: must be a valid string"),
        ({"releases_kept": "2"}, "releases_kept='2': must be a valid integer: a whole number from 2 to 100"),
        ({"releases_kept": True}, "releases_kept=True: must be a valid integer"),
        ({"releases_kept": 2.0}, "releases_kept=2.0: must be a valid integer"),
        # bad values
        ({"nvidia_apt_url": "ftp://mirror/cuda"}, "nvidia_apt_url='ftp://mirror/cuda': an http:// or https:// URL"),
        ({"nvidia_apt_url": "https://u:p@mirror/cuda"}, "nvidia_apt_url=<redacted>: looks like a secret"),
        ({"nvidia_apt_url": "https://mirror/a b"}, "an http:// or https:// URL"),
        ({"nvidia_apt_url": "file://host/cuda"}, "or file:///path"),
        ({"nvidia_apt_keyring": "keys/nvidia.gpg"}, "nvidia_apt_keyring='keys/nvidia.gpg': an absolute path"),
        ({"nvidia_apt_keyring": "/nonexistent/nvidia.gpg"}, "no such file on this machine"),
        ({"nvidia_apt_keyring": "/etc/k\n.gpg"}, "a path: 1 to 4096 printable characters"),
        ({"nvidia_driver_version": "580"}, "nvidia_driver_version='580': an NVIDIA driver version like 580.95.05"),
        ({"nvidia_driver_version": "580.95.05; reboot"}, "an NVIDIA driver version"),
        ({"nvidia_driver_version": "570.172.08"}, "vLLM 0.33.0 (CUDA 13) needs driver branch 580 or newer"),
        ({"vllm_extras": ["a; rm -rf /"]}, "vllm_extras=['a; rm -rf /']: an extra's name"),
        ({"vllm_extras": ["-audio"]}, "an extra's name"),
        ({"vllm_extras": ["x"] * 33}, "at most 32"),
        ({"releases_kept": 1}, "releases_kept=1: must be greater than or equal to 2"),
        ({"releases_kept": 101}, "releases_kept=101: must be less than or equal to 100"),
    ],
)
def test_bad_values_name_file_host_field_value_and_what_is_allowed(
    keyring: str, extra: dict[str, Any], message: str
) -> None:
    found = problems(with_mirror(keyring, **extra))
    assert len(found) == 1, found
    assert found[0].startswith("inv.py: host gpu-1: ") and message in found[0], found


def test_a_mirror_needs_its_keyring() -> None:
    (found,) = problems({"nvidia_apt_url": "https://mirror.internal/cuda/repos"})
    assert "nvidia_apt_keyring=None: required with nvidia_apt_url" in found


def test_a_vllm_release_without_a_default_driver_needs_one_pinned(keyring: str) -> None:
    (found,) = problems(with_mirror(keyring, vllm_version="0.34.0"))
    assert "nvidia_driver_version=None: fleet has no default driver for vLLM 0.34.0: pin one" in found
    assert spec(with_mirror(keyring, vllm_version="0.34.0", nvidia_driver_version="590.1.2")).nvidia_driver_version


def test_all_problems_at_once(keyring: str) -> None:
    found = problems({"nvidia_apt_url": 1, "releases_kept": 0, "vllm_extras": "audio", "nvidia_fabric_manager": 0})
    assert sorted(f.split(": ")[2].split("=")[0] for f in found) == [
        "nvidia_apt_url", "nvidia_fabric_manager", "releases_kept", "vllm_extras"
    ]  # fmt: skip


# -- typos ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("nvidia_apt_uri", "nvidia_apt_url"),
        ("nvidia_apt_keyrings", "nvidia_apt_keyring"),
        ("nvidia_driver_versoin", "nvidia_driver_version"),
        ("Nvidia_Fabric_Manager", "nvidia_fabric_manager"),
        ("vllm_extra", "vllm_extras"),
        ("release_kept", "releases_kept"),
        ("rolout", "rollout"),
        ("alert", "alerts"),
    ],
)
def test_typos_get_did_you_mean(typo: str, meant: str) -> None:
    (found,) = problems({typo: 1})
    assert f"{typo}=1: unknown field" in found and f"did you mean {meant!r}?" in found


def test_a_keyring_in_group_data_is_reported_against_that_file(tmp_path: Path) -> None:
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "all.py").write_text(
        f"model = {BASE['model']!r}\nworkload = {BASE['workload']!r}\n"
        "nvidia_apt_url = 'http://10.0.0.9/cuda/'\nnvidia_apt_keyring = '/nonexistent/k.gpg'\n"
    )
    (tmp_path / "fleet.py").write_text("gpus = ['a']\n")
    with pytest.raises(InventoryError) as err:
        load_inventory(tmp_path / "fleet.py")
    (problem,) = err.value.problems
    assert problem.inventory.endswith("group_data/all.py") and problem.field == "nvidia_apt_keyring"


# -- rollout and alerts: their own grammar, reported the same way ---------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rollout": "fast"}, "rollout='fast': a dict with keys batches"),
        ({"rollout": {"batchs": [1]}}, "rollout.batchs=[1]: unknown key; allowed: batches"),
        ({"rollout": {"batchs": [1]}}, "did you mean 'batches'?"),
        ({"rollout": {"soak_s": "30"}}, "rollout.soak_s='30'"),
        ({"rollout": {"timeouts": {"helth": 60}}}, "did you mean 'health'?"),
        ({"alerts": 5}, "alerts=5: a dict with keys"),
        ({"alerts": {"kv_cache_usag": 0.9}}, "alerts.kv_cache_usag=0.9: unknown key; allowed:"),
        ({"alerts": {"kv_cache_usag": 0.9}}, "did you mean 'kv_cache_usage'?"),
        ({"alerts": {"kv_cache_usage": "high"}}, "alerts.kv_cache_usage='high': a fraction in (0, 1]"),
    ],
)
def test_rollout_and_alerts_problems_are_reported_at_load(extra: dict[str, Any], message: str) -> None:
    found = problems(extra)
    assert any(f.startswith("inv.py: host gpu-1: ") and message in f for f in found), found


def test_good_rollout_and_alerts_pass() -> None:
    spec({"rollout": {"batches": [1, "50%"], "soak_s": 10}, "alerts": {"kv_cache_usage": 0.9}})


# -- values from pyinfra's command line ------------------------------------------------------------


CLI_VALUES = {
    "releases_kept=2": ("releases_kept", 2),
    'vllm_extras=["audio"]': ("vllm_extras", ("audio",)),
    "nvidia_fabric_manager=false": ("nvidia_fabric_manager", False),
    "nvidia_driver_version=580.65.06": ("nvidia_driver_version", "580.65.06"),
}
RAW_VALUES = [cli.partition("=")[2] for cli in CLI_VALUES] + ["audio"]


@functools.cache
def _pyinfra_parsed() -> dict[str, Any]:
    """pyinfra's own ``parse_cli_arg`` of each raw value, in a process of its own: importing
    ``pyinfra_cli`` monkey-patches the interpreter with gevent (threads become greenlets), which
    must not happen to the test process."""
    code = (
        "import json, sys\nfrom pyinfra_cli.util import parse_cli_arg\n"
        "print(json.dumps({raw: parse_cli_arg(raw) for raw in sys.argv[1:]}))"
    )
    done = subprocess.run([sys.executable, "-c", code, *RAW_VALUES], capture_output=True, text=True, check=True)
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def parse_cli_arg(raw: str) -> Any:
    return _pyinfra_parsed()[raw]


@pytest.mark.parametrize(("cli", "field", "want"), [(cli, *value) for cli, value in CLI_VALUES.items()])
def test_pyinfra_data_values_are_typed_by_pyinfra_then_validated_strictly(cli: str, field: str, want: object) -> None:
    """``pyinfra --data k=v`` converts v with ``parse_cli_arg`` (true/false, int, JSON, else str)."""
    key, _, raw = cli.partition("=")
    assert getattr(spec({key: parse_cli_arg(raw)}), field) == want


def test_a_pyinfra_data_value_of_the_wrong_shape_is_refused() -> None:
    (found,) = problems({"vllm_extras": parse_cli_arg("audio")})
    assert "vllm_extras='audio': must be a valid list" in found and "--data" in found
