"""Staging a model's config.json on lab hosts: the cache layout huggingface_hub reads, the vllm user
as the deploy creates it, and a clear error for a model fleet does not bundle."""

from __future__ import annotations

import base64
import shlex
import subprocess
from pathlib import Path

import pytest

from fleet.model.config import BUNDLED_MODELS
from fleetlab.errors import LabError
from fleetlab.models import REVISION, staging_command

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def test_the_command_writes_the_hf_cache_layout_as_the_vllm_user() -> None:
    command = staging_command(MODEL)
    repo = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
    assert f"{repo}/refs/main" in command and f"{repo}/snapshots/{REVISION}/config.json" in command
    assert "useradd --system --gid vllm --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin" in command
    payload = base64.b64encode((BUNDLED_MODELS / MODEL / "config.json").read_bytes()).decode()
    assert f"echo {payload} | base64 -d" in command
    # it is one valid shell command line (bash parses it without running it)
    assert subprocess.run(["bash", "-n", "-c", command], check=False).returncode == 0
    assert shlex.split(command)  # and quotes balance


@pytest.mark.parametrize("model", ["someone/not-bundled", "no-slash", "../../etc"])
def test_a_model_fleet_does_not_bundle_is_a_clear_error(model: str) -> None:
    with pytest.raises(LabError, match="the lab can stage only fleet's bundled model configs"):
        staging_command(model)


def test_bundled_models_exist() -> None:
    assert (Path(BUNDLED_MODELS) / MODEL / "config.json").is_file()


def test_the_cache_seed_writes_each_file_under_the_units_cache_as_the_vllm_user() -> None:
    from fleetlab.models import VLLM_CACHE, cache_seed_command

    entry = b'{"hash": "abc", "modelinfo": {"is_text_generation_model": true}}\n'
    command = cache_seed_command({"modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json": entry})
    assert VLLM_CACHE == "/var/lib/vllm/cache"  # the units' VLLM_CACHE_ROOT (templates/vllm.service.j2)
    # the user first, exactly as staging (and the deploy) makes it, so its home and cache are its own
    assert command.startswith(staging_command(MODEL).split(" && sudo -n -u vllm mkdir")[0])
    target = "/var/lib/vllm/cache/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert "sudo -n -u vllm mkdir -p /var/lib/vllm/cache/modelinfos" in command
    assert f"echo {base64.b64encode(entry).decode()} | base64 -d | sudo -n -u vllm tee {target} >/dev/null" in command
    assert subprocess.run(["bash", "-n", "-c", command], check=False).returncode == 0


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../hf/x.json", "modelinfos/../../x", "./x.json", "a//b.json"])
def test_a_cache_seed_outside_the_cache_is_refused(name: str) -> None:
    from fleetlab.models import cache_seed_command

    with pytest.raises(LabError, match="is not a plain relative path under /var/lib/vllm/cache"):
        cache_seed_command({name: b"{}"})
