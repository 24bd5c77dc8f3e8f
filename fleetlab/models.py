"""Pre-stage a model's files on lab hosts, the way an air-gapped fleet pre-stages weights.

fleet's units run vLLM with ``HF_HUB_OFFLINE=1`` and ``HF_HOME=/var/lib/vllm/hf`` (see
``templates/vllm.service.j2``), so a model must already be in that Hugging Face cache when a unit
starts; fetching weights is not the deploy's job, and the deploy's preflight refuses a host whose
model does not resolve. On a real fleet an operator copies the weights there; the lab's vLLM
stand-in needs only ``config.json``, which fleet bundles for its reference models. Staging creates
the ``vllm`` system user exactly as the deploy's ``vllm.service_user`` does (so the deploy finds it
and changes nothing) and writes the cache layout ``huggingface_hub`` reads:
``hub/models--<org>--<name>/{refs/main, snapshots/<rev>/config.json}``. For the real engine it
can also seed the units' vLLM cache (``VLLM_CACHE_ROOT``) the same way, as the service user.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Mapping
from pathlib import PurePosixPath

import paramiko

from fleet.model.config import BUNDLED_MODELS
from fleetlab import ssh
from fleetlab.errors import LabError

SERVICE_USER = "vllm"
SERVICE_HOME = "/var/lib/vllm"
HUB = f"{SERVICE_HOME}/hf/hub"
REVISION = "fleet-lab"


#: The units' ``VLLM_CACHE_ROOT`` (``templates/vllm.service.j2``: the service user's home + ``/cache``).
VLLM_CACHE = f"{SERVICE_HOME}/cache"


def _service_user_steps() -> list[str]:
    """Shell steps that create the ``vllm`` system user (and group) as the deploy's
    ``vllm.service_user`` does, unless it exists; the deploy then finds it and changes nothing."""
    user = SERVICE_USER
    return [
        f"(getent group {user} >/dev/null || sudo -n groupadd --system {user})",
        f"(id -u {user} >/dev/null 2>&1 || sudo -n useradd --system --gid {user} --home-dir {SERVICE_HOME} "
        f"--create-home --shell /usr/sbin/nologin {user})",
    ]


def cache_seed_command(files: Mapping[str, bytes]) -> str:
    """The shell command (the login user, with sudo) that puts ``files`` (path relative to the
    units' ``VLLM_CACHE_ROOT`` -> contents) into that cache as the service user, creating the user
    first as the deploy does (its home is made by ``useradd``, so the cache is the user's: a file
    put there as root would leave ``cache/`` root's, where the unit cannot write its compile cache).

    What the lab seeds is vLLM's model-registry cache (``modelinfos/<module>-<class>.json``,
    ``_LazyRegisteredModel.inspect_model_cls`` in ``vllm/model_executor/models/registry.py``):
    vLLM reads an entry only while its ``hash`` matches its own model module's source, so an entry
    made by another vLLM is inspected again, never trusted.
    """
    user, q = SERVICE_USER, shlex.quote
    steps = _service_user_steps()
    for name, data in sorted(files.items()):
        rel = PurePosixPath(name)
        if not name or rel.is_absolute() or ".." in rel.parts or str(rel) != name:
            raise LabError(f"vLLM cache seed: {name!r} is not a plain relative path under {VLLM_CACHE}")
        target = f"{VLLM_CACHE}/{rel}"
        payload = base64.b64encode(data).decode()
        steps += [
            f"sudo -n -u {user} mkdir -p {q(str(PurePosixPath(target).parent))}",
            f"echo {payload} | base64 -d | sudo -n -u {user} tee {q(target)} >/dev/null",
        ]
    return " && ".join(steps)


def staging_command(model: str) -> str:
    """The shell command (run as the login user, with sudo) that stages ``model``'s config.json."""
    config = BUNDLED_MODELS / model / "config.json"
    if "/" not in model or not config.is_file():
        known = sorted(str(p.parent.relative_to(BUNDLED_MODELS)) for p in BUNDLED_MODELS.glob("*/*/config.json"))
        raise LabError(f"the lab can stage only fleet's bundled model configs ({', '.join(known)}), not {model!r}")
    repo = f"{HUB}/models--{model.replace('/', '--')}"
    payload = base64.b64encode(config.read_bytes()).decode()
    user, q = SERVICE_USER, shlex.quote
    steps = [
        *_service_user_steps(),
        f"sudo -n -u {user} mkdir -p {q(repo + '/refs')} {q(repo + '/snapshots/' + REVISION)}",
        f"echo {REVISION} | sudo -n -u {user} tee {q(repo + '/refs/main')} >/dev/null",
        f"echo {payload} | base64 -d | sudo -n -u {user} tee {q(repo + '/snapshots/' + REVISION + '/config.json')}"
        " >/dev/null",
    ]
    return " && ".join(steps)


def stage_model(client: paramiko.SSHClient, host: str, model: str) -> None:
    """Stage ``model`` on one host (idempotent); ``LabError`` names the host and what failed."""
    rc, _out, err = ssh.run(client, staging_command(model), timeout=60)
    if rc != 0:
        raise LabError(f"{host}: staging {model} failed: {err.strip()[-500:]}")
