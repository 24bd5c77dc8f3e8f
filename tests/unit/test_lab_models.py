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
