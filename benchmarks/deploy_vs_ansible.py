"""``fleet deploy`` against an equivalent Ansible playbook, on the same kind of lab hosts.

    sudo .venv/bin/python benchmarks/deploy_vs_ansible.py --hosts 4 [--hosts 16] \
        [--ansible /path/to/venv/bin/ansible-playbook]

For each host count: a fresh lab (``rtx4090-2`` hosts, driver loaded), the model's config put in
each host's Hugging Face cache, then ``fleet deploy`` (first run, then a no-change re-run); the lab
is taken down and a fresh one brought up, then the Ansible playbook doing the same work (first run,
then a re-run). Ansible is ansible-core in its own venv (``python3 -m venv ... && pip install
ansible-core``), strict host keys, ``become`` with sudo, default forks (5) raised to the host count.

The playbook's work is what fleet does on such a host: NVIDIA apt keyring and deb822 source (the
lab's signed repository), the driver packages only when no driver is loaded (as fleet), the
service user, a venv with vLLM and nvidia-ml-py from the lab's package index, the units and env
files (rendered by fleet's renderer, copied with mode/owner), daemon-reload, enable, start, and a
wait until each instance's ``/health`` answers 200. Fleet also probes, plans and preflights.

Prints a table of wall times and the ratios (targets: re-run <= 0.25x, first run <= 0.7x).

Measured on the 2-core development machine, other helpers' lab tests running beside it (load
average 6-8 during the 4-host run, 10-22 during the 16-host run; Ansible's times suffer the same
load), with facts read in one batch per host (``fleet.deploy.factcache``):

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        27.6s          58.2s   0.47          7.2s           34.2s   0.21
        4        48.1s          79.6s   0.61          8.1s           49.5s   0.16  (load 7-11)
       16       100.8s         190.0s   0.53         13.4s          125.3s   0.11
        4        20.3s          44.3s   0.46          3.4s           28.9s   0.12  (load 2-4.5, *)

(*) after the configuration revisions and the rolling engine in ``fleet deploy``; the rows above
were measured just before them.

Before the batch (load ~5): 4 hosts re-run 8.6 s vs 22.4 s (0.38x), first run 24.2 s vs 42.9 s;
16 hosts re-run 24.2 s vs 92.0 s (0.26x), first run 76.0 s vs 152.8 s. A no-change re-run then
sent ~57 commands per host (each fact one ``sudo`` round trip, read again by pyinfra's execute
pass); now it sends one. What is left of a 4-host re-run (~2.5 s inside ``deploy()`` at load ~6,
plus ~1.5 s of Python start-up and imports): connecting 0.4 s; the one fact command per host
1.6 s (pyinfra's ``Users`` fact, read by ``server.user``, runs ``lastlog`` and ``id`` for every
user: about half of each host's ~0.8 s); the unit-state check 0.3 s (its own SSH connections);
the health checks 0.1 s.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
KEY = "bench-" + base64.b32encode(os.urandom(10)).decode().lower()


def seed(lab: Any, i: int) -> None:
    from fleet.lab import ssh

    h = lab.state.hosts[i]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        rc, _o, err = ssh.run(
            client,
            "sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group vllm "
            f"&& sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee {HUB}/refs/main "
            f"&& echo {base64.b64encode(CONFIG.read_bytes()).decode()} | base64 -d "
            f"| sudo -u vllm tee {HUB}/snapshots/main/config.json >/dev/null",
        )
        if rc != 0:
            raise SystemExit(f"seeding {h.name}: {err}")
    finally:
        client.close()


class Lab:
    def __init__(self, hosts: int, root: Path, tag: str) -> None:
        from fleet.lab import lab as lab_ops
        from fleet.lab.state import LabDir

        sys.path.insert(0, str(REPO))
        from tests.lab.conftest import free_octet  # an address block nothing else listens on

        self.ops = lab_ops
        self.opts = lab_ops.UpOptions(
            name=f"bd{tag}{os.getpid() % 10000}", hosts=hosts, profiles=("rtx4090-2",),
            inventory=root / tag / "inventory.py", state_root=root / tag / "state",
            octet=free_octet(os.getpid() + ord(tag)),
        )  # fmt: skip
        lab_ops.up(self.opts)
        self.dir = LabDir(self.opts.name, self.opts.state_root)
        self.state = self.dir.load()
        assert self.state is not None
        for i in range(hosts):
            seed(self, i)

    def down(self) -> None:
        self.ops.down(self.opts.name, self.opts.state_root)


def timed(argv: list[str], env: dict[str, str], log: Path) -> float:
    t0 = time.monotonic()
    with log.open("a") as out:
        proc = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=3600)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}); see {log}")
    return seconds


def fleet_times(hosts: int, root: Path) -> tuple[float, float]:
    lab = Lab(hosts, root, "f")
    env = {**os.environ, "FLEET_LAB_API_KEY": KEY}
    log = root / "fleet.log"
    try:
        argv = [str(FLEET), "deploy", str(lab.opts.inventory), "--json"]
        return timed(argv, env, log), timed(argv, env, log)
    finally:
        lab.down()


def ansible_inventory(lab: Lab, files_dir: Path) -> dict[str, Any]:
    """Ansible's inventory for the lab and, per host, fleet's rendered units/env files on disk."""
    from fleet.inventory.spec import load_inventory
    from fleet.operations import host as host_deploy
    from fleet.render.units import HostPaths

    loaded = load_inventory(str(lab.opts.inventory))
    hosts: dict[str, Any] = {}
    for spec in loaded.hosts:
        data = loaded.pyinfra.get_host(spec.name).data.dict()
        rendered = host_deploy.rendered_files(spec.name, data, HostPaths(venv="/opt/ansible/vllm"))
        files = []
        for n, f in enumerate(rendered):
            local = files_dir / spec.name / f"{n}"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(f.content)
            files.append({"src": str(local), "dest": f.path, "mode": f"{f.mode:04o}"})
        plan = host_deploy.host_plan(spec.name, data)
        hosts[spec.name] = {
            "ansible_host": data["ssh_hostname"],
            "ansible_port": data["ssh_port"],
            "ansible_user": data["ssh_user"],
            "ansible_ssh_private_key_file": data["ssh_key"],
            "ansible_ssh_common_args": (
                f"-o UserKnownHostsFile={data['ssh_known_hosts_file']} -o StrictHostKeyChecking=yes"
            ),
            "ansible_python_interpreter": "/usr/bin/python3",
            "nvidia_apt_url": data["nvidia_apt_url"],
            "nvidia_apt_keyring": data["nvidia_apt_keyring"],
            "pip_index_url": data["pip_index_url"],
            "unit_files": files,
            "units": [f"fleet-{i.unit_name}.service" for i in plan.instances],
            "health": [f"http://{data['ssh_hostname']}:{i.port}/health" for i in plan.instances],
        }
    return {"all": {"hosts": hosts}}


PLAYBOOK = """
- hosts: all
  become: true
  gather_facts: false
  tasks:
    - name: NVIDIA apt keyring
      copy: {src: "{{ nvidia_apt_keyring }}", dest: /usr/share/keyrings/nvidia-lab.gpg, mode: "0644"}
    - name: NVIDIA apt source
      copy:
        dest: /etc/apt/sources.list.d/nvidia-lab.sources
        mode: "0644"
        content: |
          Types: deb
          URIs: {{ nvidia_apt_url }}
          Suites: /
          Signed-By: /usr/share/keyrings/nvidia-lab.gpg
    - name: is a driver loaded?
      stat: {path: /proc/driver/nvidia/version}
      register: driver
    - name: NVIDIA driver packages
      apt: {name: [nvidia-driver, libnvidia-ml1, nvidia-kernel-open-dkms], update_cache: true}
      when: not driver.stat.exists
    - name: vLLM system user
      user: {name: vllm, system: true, home: /var/lib/vllm, shell: /usr/sbin/nologin}
    - name: vLLM venv
      command: python3 -m venv /opt/ansible/vllm
      args: {creates: /opt/ansible/vllm/bin/python}
    # Ansible's pip module needs `packaging` in the host's system Python, which an air-gapped
    # Debian host does not have: pip itself, idempotent ("already satisfied") like the module.
    - name: vLLM and nvidia-ml-py from the package index
      command: >-
        /opt/ansible/vllm/bin/pip install --disable-pip-version-check --index-url {{ pip_index_url }}
        vllm==0.33.0 nvidia-ml-py
      register: pip
      changed_when: "'Successfully installed' in pip.stdout"
    - name: env file directory
      file: {path: /etc/fleet, state: directory, mode: "0755"}
    - name: units and env files
      copy: {src: "{{ item.src }}", dest: "{{ item.dest }}", mode: "{{ item.mode }}", owner: root, group: root}
      loop: "{{ unit_files }}"
      no_log: true
    - name: start units
      systemd: {name: "{{ item }}", enabled: true, state: started, daemon_reload: true}
      loop: "{{ units }}"
    - name: wait until each instance answers /health
      uri: {url: "{{ item }}", status_code: 200}
      register: health
      until: health.status == 200
      retries: 300
      delay: 1
      loop: "{{ health }}"
"""


def ansible_times(hosts: int, root: Path, playbook_bin: str) -> tuple[float, float]:
    lab = Lab(hosts, root, "a")
    try:
        work = Path(tempfile.mkdtemp(prefix="ansible-", dir=root))
        os.environ["FLEET_LAB_API_KEY"] = KEY
        (work / "inventory.json").write_text(json.dumps(ansible_inventory(lab, work / "files")))
        (work / "playbook.yml").write_text(PLAYBOOK)
        env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_FORKS": str(max(5, hosts))}
        argv = [playbook_bin, "-i", str(work / "inventory.json"), str(work / "playbook.yml")]
        log = root / "ansible.log"
        return timed(argv, env, log), timed(argv, env, log)
    finally:
        lab.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, action="append", help="host counts (repeatable; default 4)")
    parser.add_argument("--ansible", default="/tmp/ansible-venv/bin/ansible-playbook", help="ansible-playbook")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fleet-deploy-bench-"))
    rows = []
    for n in args.hosts or [4]:
        f_first, f_again = fleet_times(n, root)
        a_first, a_again = ansible_times(n, root, args.ansible)
        rows.append((n, f_first, a_first, f_again, a_again))
    head = ("hosts", "fleet first", "ansible first", "ratio", "fleet re-run", "ansible re-run", "ratio")
    print("{:>5} {:>12} {:>14} {:>6} {:>13} {:>15} {:>6}".format(*head))
    for n, ff, af, fa, aa in rows:
        print(f"{n:>5} {ff:>11.1f}s {af:>13.1f}s {ff / af:>6.2f} {fa:>12.1f}s {aa:>14.1f}s {fa / aa:>6.2f}")
    print(f"logs: {root}")


if __name__ == "__main__":
    from fleet.lab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/deploy_vs_ansible.py"):
        main()
