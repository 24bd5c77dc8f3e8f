"""``fleet deploy`` against an equivalent Ansible playbook, on the same kind of lab hosts.

    sudo .venv/bin/python benchmarks/deploy_vs_ansible.py --hosts 4 [--hosts 16] \
        [--ansible /path/to/venv/bin/ansible-playbook] [--profile | --profile-only]

For each host count: a fresh lab (``rtx4090-2`` hosts, driver loaded), the model's config put in
each host's Hugging Face cache, then ``fleet deploy`` (first run, then a no-change re-run); the lab
is taken down and a fresh one brought up, then the Ansible playbook doing the same work (first run,
then a re-run). Ansible is ansible-core in its own venv (``python3 -m venv ... && pip install
ansible-core``; 2.19 here), run the way its performance guides tune it (:func:`ansible_settings`):
pipelining on, one SSH connection per host kept open (ControlPersist, no compression), every host
at once (forks), no fact gathering, strict host keys, ``become`` with sudo.

The playbook's work is what fleet does on such a host: NVIDIA apt keyring and deb822 source (the
lab's signed repository), the driver packages only when no driver is loaded (as fleet), the
service user, a venv with vLLM and nvidia-ml-py from the lab's package index, the units and env
files (rendered by fleet's renderer, copied with mode/owner), daemon-reload, enable, start, and a
wait until each instance's ``/health`` answers 200. Fleet also probes, plans and preflights.

Prints a table of wall times, the ratios (targets: re-run <= 0.25x, first run <= 0.7x) and the
load average during the runs. ``--profile`` then deploys a fresh lab once more, instrumented
(:func:`profile_child`), and prints where fleet's first deploy spends its time.

Measured 2026-11-26 on the 2-core development machine (the lab's hosts share its two cores with
the control side), other helpers' lab tests running beside it; Ansible with pipelining. The first
four rows on main at 0f3c6b7, the last after the NVML probe began carrying pynvml (2da0a79):

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        40.8s          67.0s   0.61          8.1s           38.8s   0.21  (load 3-11)
        4        32.6s          55.4s   0.59          4.0s           78.5s   0.05  (load 6-19)
        4        41.7s          58.5s   0.71          5.6s           40.2s   0.14  (load 10-19)
        4        27.6s          55.6s   0.50          3.1s           40.1s   0.08  (load 5-11)
        4        42.2s          54.7s   0.77          4.4s           29.3s   0.15  (load 7-14)

After issue 26's restructure (one-plan at a53d1e8: deploy reads the drain markers, unit states,
preflight and convergence facts through its own connections, 2 SSH sessions per host on a first
run, 1 on a re-run; benchmarks/ssh_rounds.py), two runs back to back:

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        50.7s          73.2s   0.69          8.5s           58.3s   0.15  (load 8-17)
        4        33.7s          82.3s   0.41          6.3s           49.4s   0.13  (load 6-12)

Issue 26's re-run work (q-perf26: no whole-heap collection at exit, the service user read alone,
one SSH login per host for restarts; from here on fleet runs with its bytecode, see
:func:`installed_env`), 2026-11-26 19:00 at loads of 10-32 from five other sessions' lab tests
(two of them this branch's own), the same benchmark on main's code (5e600f8) between two runs of
the branch's:

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        65.0s         121.9s   0.53         10.5s           80.0s   0.13  (branch, load 10-25)
        4        97.6s          89.2s   1.09         10.9s           82.0s   0.13  (main, load 14-32)
        4        99.5s         118.2s   0.84         19.6s           92.8s   0.21  (branch, load 14-21)

The target, a re-run at <= 0.10x, was not reached in these runs (0.13 and 0.21); at that load the
run-to-run spread (the branch's own re-run: 10.5 s and 19.6 s) is larger than the change. What
does not depend on the load, the CPU seconds a no-change re-run of 4 hosts costs
(``benchmarks/rerun_cpu.py``: the fleet process's ``RUSAGE_CHILDREN``; the hosts' cgroups'
``cpu.stat`` ``usage_usec`` less their idle rate), medians of four runs each, main and branch
alternating on one lab (load 16-22):

    code    fleet process CPU   hosts' CPU   together
    main         2.45 s           2.69 s      5.14 s
    branch       2.05 s           1.92 s      3.97 s   (-23 %)

2026-11-27, at the start of a session with the machine nearly idle (main at 5efb1eb), then after
the fact batch ran its facts side by side, the fact cache stopped asking pyinfra's
``pop_global_arguments`` on every read and the templates were compiled once per process (c472434):

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        20.3s          28.3s   0.72          2.4s           19.6s   0.12  (5efb1eb, load 0.9-3.7)
        4        25.0s          34.6s   0.72          2.2s           18.9s   0.12  (c472434, load 0.9-17.4)

On a quiet machine Ansible's re-run is ~19 s (29-92 s under load), so the <= 0.10x target needs a
fleet re-run under ~1.9 s; it is 2.2 s. The fleet process's CPU per no-change re-run of 4 hosts
(``/usr/bin/time``, the two checkouts alternating on one lab at load ~5): 5efb1eb 1.23-1.89 s
(median 1.41), c472434 0.99-1.21 s (median 1.12).

After the next cuts (d14d8dd: paramiko's ``invoke`` loaded only when used, pyinfra's global
arguments resolved once per process, the drain markers, NVML probe and watcher record in one
round trip per host, the probe's compiled code kept on the hosts, the first health poll after
0.1 s), 2026-11-27 05:35, quiet but for one helper reading code:

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        28.1s          36.3s   0.77          2.2s           18.7s   0.12  (d14d8dd, load 2.4-5.4)

The CPU those cuts saved (fleet process plus hosts per no-change re-run of 4, ``rerun_cpu.py``,
medians of two loaded runs: 2.51 -> 2.25 s and 3.06 -> 2.68 s) did not show in the re-run's wall
time here: 2.2 s again, where <= 0.10x needs ~1.9 s.

2026-11-27 08:44, the machine quiet (no helper running), main at 5888a43 after three more cuts: the
release venv in one pip run (made ``--without-pip``, pip run from the wheel ``ensurepip`` bundles
installs pip, setuptools and the requirements together: one pip start instead of two), the fact
batch cheaper on the hosts (one fork per fact, one ``systemctl show`` for every unit: 1.50 -> 1.07 s
of the hosts' CPU per re-run of 4, ``rerun_cpu.py``), and a first deploy's operations sending one
command each with their facts read ahead (59 -> 18 commands per host in the operations), two runs
back to back:

    hosts  fleet first  ansible first  ratio  fleet re-run  ansible re-run  ratio
        4        15.1s          26.8s   0.56          1.5s           15.8s   0.09  (5888a43, load 3.4-4.1)
        4        16.3s          26.5s   0.62          1.4s           14.9s   0.10  (5888a43, load 3.1-4.9)

Both targets met in both runs (the second re-run 0.097 before rounding). Ansible's own times were
lower than in the earlier quiet rows (26.5-26.8 s against 36.3 s first, 14.9-15.8 against 18.7 s
re-run): the machine was quieter than then, so only rows taken side by side compare.

The lab's hosts and fleet share the same two cores, so on a quiet machine the re-run's wall time
follows that sum; the breakdown of where a re-run's seconds go is in docs/deploy.md ("A
no-change re-run: where its seconds go").

The load moved both tools' times by ±30 % from run to run (the Ansible re-run of the second row
met the worst of it); no quiet window was had. Earlier rows (without pipelining, which costs
Ansible a temporary-file copy per task) are in this file's history. Issue 19 measured 17.5-18.3 s
against 19.9-24.1 s (0.76-0.88x) with pipelining, at a load it does not state; take that as the
number for a quieter machine until a quiet run says otherwise: under load Ansible's per-task
overhead (its task log below: 1-3 s for a one-command task) grows more than fleet's round trips.

Where fleet's first deploy of 4 hosts spends its time (``--profile`` at 2da0a79: 32.4 s inside
``deploy()``; per host 5 SSH connections, 58 remote commands, no SFTP upload: files are written
through commands; the control side used 1.4 s of CPU in all, so it is the hosts and the round
trips that take the time):

    phase                                                seconds   SSH conn/host  commands/host
    Python start-up and imports (`fleet deploy --help`)  0.2
    load, validate, plan from the inventory              0.1
    connect (pyinfra)                                    0.3             1              0
    NVML probe (carries pynvml on stdin)                 0.9             0              1
    facts, one batch per host (prepare)                  1.8             0              1
    operations                                           22.5            0             46
      release: `python3 -m venv` (ensurepip)             14.2-16.3                      1
      release: pip install from the lab index            1.1-2.3                        1
      release: the rest (marker, link, prune)            0.5                            7
      units + configuration revisions                    2.9                           25
      service user (pyinfra's Users fact: lastlog, id)   0.8                            4
      NVIDIA apt source, driver check, reboot check      0.6                            7
    unit states (which units to start)                   0.3             1              1
    preflight and start                                  3.3             3              9
    health: until every instance answers (HTTP)          3.2             0              0

* Half the run is ``python3 -m venv``: its ensurepip step installs pip from the wheel bundled
  with Python, about 3.6 s of CPU (measured here: 4.8 s alone, 0.09 s with ``--without-pip``,
  12.7 s for four at once on two cores). The lab's four hosts share the control machine's two
  cores, so four of them take 14-16 s; on real hosts (a CPU each) it is the single number. The
  Ansible playbook pays exactly the same (its "vLLM venv" task: 16.2-19.5 s), which pulls the
  ratio towards 1: without it fleet's first run is 16-19 s against Ansible's 35-42 s.
* Before the probe carried pynvml (0f3c6b7, two runs: 35.2 s and 32.1 s inside ``deploy()``, 6
  connections and 85 commands per host) the first probe failed on a new host, the units were
  written from the inventory's gpu entry, and a second pass (3.7-3.8 s: 2 connections and 28
  commands per host) reconnected, probed again and checked every unit, env file and revision
  again. That pass is gone; the probe costs 0.7 s more. What the one-fleet-plan issue's facts
  gathered once can still take: the prepare batch (1.8 s), the separate unit-state connection
  (0.3 s) and preflight's own three connections per host (part of its 3.3 s).
* Each remote command costs a ``sudo sh -c`` round trip (0.02-0.1 s, more under load): 58 of them
  per host, run in lock-step by pyinfra (an operation ends when every host has finished it).
* What Ansible spends more on (its per-task log, first runs): copying the four unit and env files
  8.4-9.0 s (fleet's units + revisions: 2.6-2.9 s), starting the units with a daemon-reload per
  item 5.6-6.3 s (fleet: 0.7-0.9 s), the keyring and apt source 7.0-10.2 s with the first
  connection (fleet: 0.5-0.6 s).

A no-change re-run sends one fact command per host; what is left of it (measured before the
batch above, load ~6): connecting 0.4 s; the one fact command per host 1.6 s (pyinfra's
``Users`` fact, read by ``server.user``, runs ``lastlog`` and ``id`` for every user: about half
of each host's ~0.8 s); the unit-state check 0.3 s (its own SSH connections); the health checks
0.1 s; plus ~1.5 s of Python start-up and imports.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"
KEY = "bench-" + base64.b32encode(os.urandom(10)).decode().lower()


def seed(lab: Any, i: int) -> None:
    from fleetlab import ssh

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
        from fleetlab import lab as lab_ops
        from fleetlab.state import LabDir

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


#: The machine's 1-minute load average, sampled every second while a timed command runs.
LOADS: list[float] = []


def _sample_load(stop: threading.Event) -> None:
    while not stop.wait(1.0):
        LOADS.append(os.getloadavg()[0])


def timed(argv: list[str], env: dict[str, str], log: Path) -> float:
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(stop,), daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        with log.open("a") as out:
            proc = subprocess.run(
                argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=3600
            )
    finally:
        stop.set()
        sampler.join()
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}); see {log}")
    return seconds


def installed_env(root: Path) -> dict[str, str]:
    """The environment fleet runs in as it would once installed: with its modules' bytecode.

    ``pip install`` writes a wheel's ``.pyc`` files; an editable checkout (``pip install -e``) has
    none, and where ``PYTHONDONTWRITEBYTECODE`` is set (this development machine sets it) every
    run compiles fleet's ~150 modules again (0.5 s of CPU per command here). The benchmark lets
    Python write them under ``root`` (``PYTHONPYCACHEPREFIX``), never into the checkout; the
    first deploy writes them. Ansible's own modules come from a pip install, with their bytecode.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(root / "pycache"), "FLEET_LAB_API_KEY": KEY}


def fleet_times(hosts: int, root: Path) -> tuple[float, float]:
    lab = Lab(hosts, root, "f")
    env = installed_env(root)
    log = root / "fleet.log"
    try:
        argv = [str(FLEET), "deploy", str(lab.opts.inventory), "--json"]
        return timed(argv, env, log), timed(argv, env, log)
    finally:
        lab.down()


def ansible_inventory(lab: Lab, files_dir: Path) -> dict[str, Any]:
    """Ansible's inventory for the lab and, per host, fleet's rendered units/env files on disk."""
    from fleet.inventory.spec import load_inventory
    from fleet.render import part
    from fleet.render.units import HostPaths

    loaded = load_inventory(str(lab.opts.inventory))
    hosts: dict[str, Any] = {}
    for spec in loaded.hosts:
        data = loaded.pyinfra.get_host(spec.name).data.dict()
        plan = part.host_plan(spec)
        rendered = part.rendered_files(spec, plan, HostPaths(venv="/opt/ansible/vllm"))
        files = []
        for n, f in enumerate(rendered):
            local = files_dir / spec.name / f"{n}"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(f.content)
            files.append({"src": str(local), "dest": f.path, "mode": f"{f.mode:04o}"})
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


def ansible_settings(hosts: int, work: Path) -> dict[str, str]:
    """Ansible the way its performance guides tune it (ansible-core's documented settings):

    * ``ANSIBLE_PIPELINING``: each module goes to the host on the SSH session's stdin instead of
      being copied to a temporary file first (one round trip per task instead of three or more);
      it needs sudo without ``requiretty``, which Debian's sudoers is;
    * ``ANSIBLE_SSH_ARGS``: ControlMaster/ControlPersist (one SSH connection per host, reused by
      every task), without the default ``-C``: compression costs CPU and saves nothing here;
    * ``ANSIBLE_SSH_CONTROL_PATH_DIR``: the control sockets in the run's own directory;
    * ``ANSIBLE_FORKS``: every host at once (the default is 5);
    * ``ANSIBLE_GATHERING=explicit`` (and ``gather_facts: false`` in the play): no facts are
      gathered, the playbook needs none;
    * strict host keys, like fleet;
    * ``ANSIBLE_LOG_PATH``: a timestamped log (where each task's time goes; one line per task
      and host, as many operators keep one).

    Left at their defaults: the ``linear`` strategy (a task on every host before the next, which
    is what fleet's pyinfra does too) and no Mitogen (a third-party accelerator, not part of
    ansible-core).
    """
    control = work / "cp"
    control.mkdir(exist_ok=True)
    return {
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=60s",
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
        "ANSIBLE_FORKS": str(max(5, hosts)),
        "ANSIBLE_GATHERING": "explicit",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_LOG_PATH": str(work / "ansible-tasks.log"),  # a timestamped line per task and host
    }


def ansible_times(hosts: int, root: Path, playbook_bin: str) -> tuple[float, float]:
    lab = Lab(hosts, root, "a")
    try:
        work = Path(tempfile.mkdtemp(prefix="ansible-", dir=root))
        os.environ["FLEET_LAB_API_KEY"] = KEY
        (work / "inventory.json").write_text(json.dumps(ansible_inventory(lab, work / "files")))
        (work / "playbook.yml").write_text(PLAYBOOK)
        env = {**os.environ, **ansible_settings(hosts, work)}
        argv = [playbook_bin, "-i", str(work / "inventory.json"), str(work / "playbook.yml")]
        log = root / "ansible.log"
        return timed(argv, env, log), timed(argv, env, log)
    finally:
        lab.down()


# -- where fleet's first deploy spends its time ------------------------------------------------------


def profile_child(inventory: str, out: str) -> None:
    """``fleet deploy`` in this process, as the CLI runs it (gevent patched first), instrumented:

    * the deploy's own progress messages mark its phases;
    * pyinfra's state callbacks (``BaseStateCallback``: operation_start/_end, operation_host_start)
      time each operation across the hosts (lock-step: an operation ends when every host is done);
    * paramiko is wrapped, so every SSH connection (``SSHClient.connect``), remote command
      (``Channel.exec_command`` up to its ``recv_exit_status``) and SFTP upload (``putfo``) is
      counted per host, with its wall time and the phase and operation it belongs to, whichever
      code opened it (pyinfra's connector or fleet's own fact runner, preflight and health checks);
    * the CPU this process used (``resource.getrusage``).
    """
    from gevent import monkey

    monkey.patch_all()
    import resource

    import paramiko
    from pyinfra.api.state import BaseStateCallback, State

    from fleet.cli.rollout import roll
    from fleet.deploy.runner import deploy

    t0 = time.monotonic()
    phase = ["start"]
    phases: list[tuple[str, float]] = []
    ops: list[dict[str, Any]] = []
    wire: list[dict[str, Any]] = []
    op_started: dict[str, float] = {}
    current_op: dict[str, str] = {}

    def now() -> float:
        return time.monotonic() - t0

    def progress(message: str) -> None:
        phase[0] = message
        phases.append((message, now()))

    def op_name(state: State, op_hash: str) -> str:
        return ", ".join(sorted(state.get_op_meta(op_hash).names)) or op_hash

    class Timing(BaseStateCallback):
        @staticmethod
        def operation_start(state: State, op_hash: str) -> None:
            op_started[op_hash] = now()

        @staticmethod
        def operation_host_start(state: State, host: Any, op_hash: str) -> None:
            current_op[str(host.data.get("ssh_hostname") or host.name)] = op_name(state, op_hash)

        @staticmethod
        def operation_host_success(state: State, host: Any, op_hash: str, retry_count: int = 0) -> None:
            current_op.pop(str(host.data.get("ssh_hostname") or host.name), None)

        @staticmethod
        def operation_host_error(state: State, host: Any, op_hash: str, retry_count: int = 0, retries: int = 0) -> None:
            current_op.pop(str(host.data.get("ssh_hostname") or host.name), None)

        @staticmethod
        def operation_end(state: State, op_hash: str) -> None:
            ops.append(
                {"op": op_name(state, op_hash), "start": op_started[op_hash], "seconds": now() - op_started[op_hash]}
            )

    real_init = State.__init__

    def init(self: State, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.add_callback_handler(Timing())  # type: ignore[no-untyped-call]

    setattr(State, "__init__", init)  # noqa: B010

    def record(kind: str, host: str, started: float, what: str = "") -> None:
        wire.append({"kind": kind, "host": host, "phase": phase[0], "op": current_op.get(host, ""),
                     "seconds": now() - started, "what": what})  # fmt: skip

    real_connect = paramiko.SSHClient.connect

    def connect(self: paramiko.SSHClient, hostname: str, *args: Any, **kwargs: Any) -> None:
        started = now()
        try:
            real_connect(self, hostname, *args, **kwargs)
        finally:
            record("connect", hostname, started)

    real_exec = paramiko.Channel.exec_command
    real_status = paramiko.Channel.recv_exit_status
    pending: dict[int, tuple[str, float, str]] = {}

    def exec_command(self: paramiko.Channel, command: str | bytes) -> None:
        text = command.decode(errors="replace") if isinstance(command, bytes) else command
        pending[id(self)] = (self.get_transport().getpeername()[0], now(), " ".join(text.split())[:100])
        real_exec(self, command)

    def recv_exit_status(self: paramiko.Channel) -> int:
        status = real_status(self)
        if id(self) in pending:
            host, started, what = pending.pop(id(self))
            record("command", host, started, what)
        return status

    real_putfo = paramiko.SFTPClient.putfo

    def putfo(self: paramiko.SFTPClient, fl: Any, remotepath: str, *args: Any, **kwargs: Any) -> Any:
        started = now()
        try:
            return real_putfo(self, fl, remotepath, *args, **kwargs)
        finally:
            channel = self.get_channel()
            peer = channel.get_transport().getpeername()[0] if channel is not None else "?"
            record("upload", peer, started, remotepath)

    for cls, name, wrapper in (
        (paramiko.SSHClient, "connect", connect),
        (paramiko.Channel, "exec_command", exec_command),
        (paramiko.Channel, "recv_exit_status", recv_exit_status),
        (paramiko.SFTPClient, "putfo", putfo),
    ):
        setattr(cls, name, wrapper)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    result = deploy(inventory, progress=progress, roll=lambda fleet, targets_of: roll(fleet, "rollout", targets_of, {}))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    progress("done")
    Path(out).write_text(json.dumps({
        "ok": result.ok, "seconds": result.seconds, "phases": phases, "ops": ops, "wire": wire,
        "cpu_seconds": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "hosts": [h.data() for h in result.hosts],
    }))  # fmt: skip


def profile_fleet(hosts: int, root: Path) -> None:
    """Run :func:`profile_child` on a fresh lab and print where the first deploy's time goes."""
    lab = Lab(hosts, root, "p")
    out = root / "profile.json"
    env = {**os.environ, "FLEET_LAB_API_KEY": KEY}
    try:
        t0 = time.monotonic()
        argv = [sys.executable, __file__, "--profile-child", str(lab.opts.inventory), str(out)]
        with (root / "profile.log").open("a") as log:
            subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
        wall = time.monotonic() - t0
    finally:
        lab.down()
    startup = min(timed([str(FLEET), "deploy", "--help"], env, root / "profile.log") for _ in range(3))
    data = json.loads(out.read_text())
    print(f"\nfleet's first deploy of {hosts} hosts, instrumented: {data['seconds']:.1f} s inside deploy(), "
          f"{wall:.1f} s for the process; `fleet deploy --help` (Python, imports) {startup:.2f} s; "
          f"control-side CPU {data['cpu_seconds']:.1f} s; ok={data['ok']}")  # fmt: skip
    wire = data["wire"]
    marks = [*data["phases"]]
    print(f"{'phase':<72} {'seconds':>7} {'conn/host':>9} {'cmds/host':>9} {'puts/host':>9}")
    for (name, start), (_next, end) in itertools.pairwise(marks):
        mine = [w for w in wire if w["phase"] == name]
        per = {k: sum(w["kind"] == k for w in mine) / hosts for k in ("connect", "command", "upload")}
        counts = f"{per['connect']:>9.1f} {per['command']:>9.1f} {per['upload']:>9.1f}"
        print(f"{name[:72]:<72} {end - start:>7.2f} {counts}")
    head = "operation (pyinfra, lock-step over the hosts)"
    print(f"\n{head:<72} {'seconds':>7} {'cmds/host':>9} {'slowest command':>40}")
    for op in sorted(data["ops"], key=lambda o: -o["seconds"])[:15]:
        mine = [w for w in wire if w["op"] == op["op"] and w["kind"] == "command"]
        slow = max(mine, key=lambda w: w["seconds"], default=None)
        what = f"{slow['seconds']:.2f}s {slow['what'][:32]}" if slow else ""
        print(f"{op['op'][:72]:<72} {op['seconds']:>7.2f} {len(mine) / hosts:>9.1f} {what:>40}")
    per_host: dict[str, dict[str, float]] = {}
    for w in wire:
        h = per_host.setdefault(w["host"], {"connect": 0, "command": 0, "upload": 0, "seconds": 0.0})
        h[w["kind"]] += 1
        h["seconds"] += w["seconds"]
    print(f"\n{'host':<16} {'SSH connections':>15} {'commands':>9} {'uploads':>8} {'seconds on the wire':>20}")
    for host, h in sorted(per_host.items()):
        print(f"{host:<16} {h['connect']:>15.0f} {h['command']:>9.0f} {h['upload']:>8.0f} {h['seconds']:>20.1f}")
    print(f"raw data: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, action="append", help="host counts (repeatable; default 4)")
    parser.add_argument("--ansible", default="/tmp/ansible-venv/bin/ansible-playbook", help="ansible-playbook")
    parser.add_argument("--profile", action="store_true", help="then profile fleet's first deploy (a fresh lab)")
    parser.add_argument("--profile-only", action="store_true", help="only the profile, no timed runs")
    parser.add_argument("--profile-child", nargs=2, metavar=("INVENTORY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile_child:
        profile_child(*args.profile_child)
        return
    root = Path(tempfile.mkdtemp(prefix="fleet-deploy-bench-"))
    if args.profile_only:
        profile_fleet((args.hosts or [4])[0], root)
        return
    rows = []
    for n in args.hosts or [4]:
        f_first, f_again = fleet_times(n, root)
        a_first, a_again = ansible_times(n, root, args.ansible)
        rows.append((n, f_first, a_first, f_again, a_again))
    head = ("hosts", "fleet first", "ansible first", "ratio", "fleet re-run", "ansible re-run", "ratio")
    print("{:>5} {:>12} {:>14} {:>6} {:>13} {:>15} {:>6}".format(*head))
    for n, ff, af, fa, aa in rows:
        print(f"{n:>5} {ff:>11.1f}s {af:>13.1f}s {ff / af:>6.2f} {fa:>12.1f}s {aa:>14.1f}s {fa / aa:>6.2f}")
    if LOADS:
        print(f"load average (1 min) during the timed runs: {min(LOADS):.1f}-{max(LOADS):.1f}")
    print(f"logs: {root}")
    if args.profile:
        profile_fleet(rows[0][0], root)


if __name__ == "__main__":
    from fleetlab.netguard import guarded  # tests and benchmarks reach only loopback

    with guarded("benchmarks/deploy_vs_ansible.py"):
        main()
