"""The lab's hosts are real: they boot, take SSH with strict host keys, run systemd units,
carry the simulated GPUs, and leave nothing behind when taken down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import paramiko
import pytest

from fleet.facts.nvml import NvmlProbe, probe_command
from fleet.topology import host_gpus
from fleetlab import cgroups, ssh
from fleetlab import lab as lab_ops
from fleetlab.mirror import find_mirror
from fleetlab.mounts import mounts_under
from fleetlab.ports import _listeners
from fleetlab.prereqs import check_prereqs, describe_missing
from fleetlab.profiles import load_profile
from fleetlab.sshkeys import generate_ed25519, known_hosts_line
from fleetlab.state import HostRecord

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options

VENV = Path(sys.executable).parent


def _client(lab: LabFleet, host: HostRecord) -> paramiko.SSHClient:
    d = lab.dir
    return ssh.connect(host.address, lab.state.ssh_port, d.control_key, d.known_hosts)


def _run(lab: LabFleet, host: HostRecord, command: str, timeout: float = 120.0) -> tuple[int, str, str]:
    client = _client(lab, host)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def _nspawn_pids_under(path: Path) -> list[int]:
    """Live (non-zombie) systemd-nspawn processes whose command line mentions ``path``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if "systemd-nspawn" in cmdline and str(path) in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


# ---- no root needed -------------------------------------------------------------------------


def test_prereq_message_names_the_missing_tool() -> None:
    missing = check_prereqs(which=lambda t: None if t == "debootstrap" else f"/usr/bin/{t}", euid=lambda: 0)
    assert [m.apt_package for m in missing] == ["debootstrap"]
    message = describe_missing(missing)
    assert "debootstrap (not on PATH)" in message
    assert "apt-get install -y debootstrap" in message


def test_prereq_message_names_root_and_every_package() -> None:
    missing = check_prereqs(which=lambda t: None if t in ("gcc", "systemd-nspawn") else t, euid=lambda: 1000)
    message = describe_missing(missing)
    assert "root" in message
    assert "apt-get install -y gcc systemd-container" in message


def test_mirror_comes_from_apt_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        textwrap.dedent("""\
            Types: deb
            URIs: http://security-mirror.invalid/debian-security
            Suites: bookworm-security
            Components: main

            Types: deb deb-src
            # a comment
            URIs: http://archive-mirror.invalid/debian
            Suites: bookworm bookworm-updates
            Components: main contrib
            """)
    )
    assert find_mirror("bookworm", tmp_path) == "http://archive-mirror.invalid/debian"


def test_mirror_from_one_line_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "deb http://security-mirror.invalid/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://archive-mirror.invalid/debian bookworm main non-free\n"
    )
    assert find_mirror("bookworm", tmp_path) == "http://archive-mirror.invalid/debian"


def test_no_mirror_says_how_to_pass_one(tmp_path: Path) -> None:
    with pytest.raises(lab_ops.LabError, match="--mirror"):
        find_mirror("bookworm", tmp_path)


# ---- real hosts -------------------------------------------------------------------------------


@pytest.mark.lab
def test_hosts_come_up_with_systemd_and_ssh(lab_fleet: LabFleet) -> None:
    state, rows = lab_ops.status(lab_fleet.opts.name, lab_fleet.opts.state_root)
    assert state is not None
    assert [r.name for r in rows] == [h.name for h in lab_fleet.state.hosts]
    assert [r.profile for r in rows] == list(lab_fleet.opts.profiles)
    for r in rows:
        assert r.running and r.pid, r
        assert r.ssh == "ok", r
    for h in lab_fleet.state.hosts:
        _, out, _ = _run(lab_fleet, h, "systemctl is-system-running --wait", timeout=90)
        assert out.strip() == "running", (h.name, out, _run(lab_fleet, h, "systemctl --failed")[1])


@pytest.mark.lab
def test_login_as_fleet_with_strict_host_keys(lab_fleet: LabFleet) -> None:
    for h in lab_fleet.state.hosts:
        rc, out, _ = _run(lab_fleet, h, "id -un; hostname")
        assert rc == 0
        assert out.split() == ["fleet", h.name]


@pytest.mark.lab
def test_a_host_key_that_does_not_match_is_refused(lab_fleet: LabFleet, tmp_path: Path) -> None:
    host = lab_fleet.state.hosts[0]
    impostor = generate_ed25519(tmp_path / "impostor", "impostor")
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(known_hosts_line(host.address, lab_fleet.state.ssh_port, impostor) + "\n")
    with pytest.raises(paramiko.BadHostKeyException):
        ssh.connect(host.address, lab_fleet.state.ssh_port, lab_fleet.dir.control_key, wrong)
    unknown = tmp_path / "known_hosts_empty"
    unknown.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        ssh.connect(host.address, lab_fleet.state.ssh_port, lab_fleet.dir.control_key, unknown)


@pytest.mark.lab
def test_password_login_is_refused(lab_fleet: LabFleet) -> None:
    host = lab_fleet.state.hosts[0]
    client = paramiko.SSHClient()
    client.load_host_keys(str(lab_fleet.dir.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.AuthenticationException):
        client.connect(host.address, 22, username="fleet", password="fleet", allow_agent=False, look_for_keys=False)
    client.close()


@pytest.mark.lab
def test_passwordless_sudo(lab_fleet: LabFleet) -> None:
    for h in lab_fleet.state.hosts:
        rc, out, err = _run(lab_fleet, h, "sudo -n true && sudo -n id -un")
        assert (rc, out.strip()) == (0, "root"), err


@pytest.mark.lab
def test_systemd_in_a_host_starts_and_stops_a_unit(lab_fleet: LabFleet) -> None:
    host = lab_fleet.state.hosts[1]
    unit = "[Unit]\nDescription=lab test\n[Service]\nExecStart=/bin/sleep infinity\n"
    script = (
        f"printf '{unit}' | sudo -n tee /etc/systemd/system/labtest.service >/dev/null"
        " && sudo -n systemctl daemon-reload && sudo -n systemctl start labtest"
        " && systemctl is-active labtest"
    )
    rc, out, err = _run(lab_fleet, host, script)
    assert (rc, out.strip()) == (0, "active"), err
    rc, out, _ = _run(lab_fleet, host, "sudo -n systemctl stop labtest; systemctl is-active labtest")
    assert out.strip() == "inactive"
    _run(lab_fleet, host, "sudo -n rm /etc/systemd/system/labtest.service && sudo -n systemctl daemon-reload")


@pytest.mark.lab
def test_hosts_listen_on_their_own_loopback_address_only(lab_fleet: LabFleet) -> None:
    addresses = {h.address for h in lab_fleet.state.hosts}
    mine = {a for a, p in _listeners() if p == 22 and a.startswith(f"127.0.{lab_fleet.state.octet}.")}
    assert mine == addresses
    assert not [a for a, p in _listeners() if p == 22 and a in ("0.0.0.0", "::")]
    for h in lab_fleet.state.hosts:
        _, out, _ = _run(lab_fleet, h, "getent hosts $(hostname)")
        assert out.split()[0] == h.address


@pytest.mark.lab
def test_up_twice_keeps_running_hosts(lab_fleet: LabFleet) -> None:
    pids = {r.name: r.pid for r in lab_ops.status(lab_fleet.opts.name, lab_fleet.opts.state_root)[1]}
    again = bring_up(lab_fleet.opts)
    assert again.started == []
    assert again.kept == [h.name for h in lab_fleet.state.hosts]
    after = {r.name: r.pid for r in lab_ops.status(lab_fleet.opts.name, lab_fleet.opts.state_root)[1]}
    assert after == pids


@pytest.mark.lab
def test_inventory_loads_with_pyinfra_and_connects_strictly(lab_fleet: LabFleet) -> None:
    inventory = lab_fleet.opts.inventory
    # pyinfra_cli patches the interpreter with gevent on import: load it in its own process.
    probe = textwrap.dedent(f"""\
        import json
        from pyinfra.api import State
        from pyinfra.context import ctx_state
        ctx_state.set(State())  # the CLI loader runs inside a state context, as under `pyinfra`
        from pyinfra_cli.inventory import make_inventory
        inv = make_inventory({str(inventory)!r})
        print(json.dumps({{h.name: [sorted(h.groups), h.data.dict()] for h in inv}}, default=str))
        """)
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert loaded.returncode == 0, loaded.stderr
    hosts = json.loads(loaded.stdout.strip().splitlines()[-1])
    d = lab_fleet.dir
    assert list(hosts) == [h.name for h in lab_fleet.state.hosts]
    for h in lab_fleet.state.hosts:
        groups, data = hosts[h.name]
        assert "lab" in groups
        assert data["ssh_hostname"] == data["bind_address"] == h.address
        assert data["ssh_port"] == 22 and data["ssh_user"] == "fleet"
        assert data["ssh_key"] == str(d.control_key)
        assert data["ssh_known_hosts_file"] == str(d.known_hosts)
        assert data["ssh_strict_host_key_checking"] == "yes"
        assert "lab_profile" not in data  # GPUs are probed; gpu is what --offline plans from
        profile = load_profile(h.profile)
        assert data["gpu"] == {"sku": profile.sku.key, "count": len(profile.slots), "nvlink": profile.fabric.value}
        assert data["model"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert data["vllm_version"] == "0.33.0" and data["port"] == 8000
        assert data["workload"]["target_concurrency"] == 32
        assert "api_key_ref" not in data  # loopback only; tests that need a key add one
    run = subprocess.run(
        [str(VENV / "pyinfra"), "-y", str(inventory), "exec", "--", "sudo -n true"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.lab
def test_simulated_gpu_files_in_hosts(lab_fleet: LabFleet) -> None:
    for h in lab_fleet.state.hosts:
        profile = load_profile(h.profile)
        _, out, _ = _run(lab_fleet, h, "cat /proc/driver/nvidia/version")
        assert out == profile.proc_driver_version_text()
        _, out, _ = _run(lab_fleet, h, "cat /etc/fleet-lab/nvml-profile")
        assert out == profile.render()
        _, out, _ = _run(lab_fleet, h, "stat -c %a /run/fleet-lab/nvml; /sbin/ldconfig -p | grep -c libnvidia-ml.so.1")
        assert out.split() == ["1777", "1"]


@pytest.fixture(scope="session")
def nvml_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nvidia-ml-py's wheel, fetched on the control machine with its own pip configuration."""
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "nvidia-ml-py==13.615.71", "--no-deps", "-d", str(out)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("nvidia_ml_py-*.whl")
    return wheel


@pytest.mark.lab
@pytest.mark.parametrize("index", [0, 2])
def test_pynvml_in_a_host_sees_the_profile(lab_fleet: LabFleet, nvml_wheel: Path, index: int) -> None:
    host = lab_fleet.state.hosts[index]
    profile = load_profile(host.profile)
    client = _client(lab_fleet, host)
    try:
        with client.open_sftp() as sftp:
            sftp.put(str(nvml_wheel), f"/home/fleet/{nvml_wheel.name}")
        rc, _out, err = ssh.run(
            client,
            f"test -x nvml-venv/bin/python || python3 -m venv nvml-venv && "
            f"nvml-venv/bin/pip install --quiet --no-index {nvml_wheel.name}",
            timeout=300,
        )
        assert rc == 0, err
        # fleet's own probe (the NvmlProbe fact), run the way fleet runs it
        rc, out, err = ssh.run(client, probe_command("/home/fleet/nvml-venv/bin/python"), timeout=120)
    finally:
        client.close()
    assert rc == 0, err
    seen = NvmlProbe().process(out.splitlines())
    gpus = profile.enumerated
    assert seen.status == "ok" and seen.driver_version == profile.driver_version
    assert [g.name for g in seen.gpus] == [profile.sku.nvml_name] * len(gpus)
    assert [g.memory.total if g.memory else None for g in seen.gpus] == [profile.sku.memory_total] * len(gpus)
    expected_links = [[link.active for link in profile.links(g.slot)] for g in gpus]
    assert [[link.active for link in g.nvlinks] for g in seen.gpus] == expected_links
    expected_topo = [[profile.pcie_levels[a.slot][b.slot] if a is not b else None for b in gpus] for a in gpus]
    assert [list(row) for row in seen.common_ancestor] == expected_topo
    assert set(host_gpus(seen).islands) == set(profile.host_gpus().islands)


@pytest.mark.lab
def test_killed_host_restarts_and_down_leaves_nothing(tmp_path: Path) -> None:
    require_lab()
    octet = free_octet(os.getpid() + 1, avoid=frozenset({TEST_OCTET}))
    opts = test_lab_options(tmp_path, f"pd{os.getpid()}", octet, 1, ("rtx4090-2",))
    try:
        bring_up(opts)
        (pid,) = _nspawn_pids_under(opts.state_root)
        assert opts.inventory.is_file()
        # A host whose nspawn was killed outright is started again by `up`, and answers.
        os.kill(pid, signal.SIGKILL)
        again = bring_up(opts)
        assert again.started == [f"{opts.name}-h1"]
        assert len(_nspawn_pids_under(opts.state_root)) == 1
        (row,) = lab_ops.status(opts.name, opts.state_root)[1]
        assert row.ssh == "ok"
    finally:
        lab_ops.down(opts.name, opts.state_root)
    assert _nspawn_pids_under(opts.state_root) == []
    assert mounts_under(tmp_path) == []
    assert not (opts.state_root / opts.name).exists()
    assert not [p for p in cgroups.host_cgroups(f"{opts.name}-h1") if p.exists()]
    assert not opts.inventory.exists()
    assert not [a for a, p in _listeners() if a.startswith(f"127.0.{octet}.")]
