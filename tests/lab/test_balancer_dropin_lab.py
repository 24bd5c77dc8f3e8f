"""The systemd drop-in ``fleet deploy`` installs on a balancer host, run by a real systemd.

The lab's hosts cannot install Debian's haproxy (their apt reaches only the lab's repository), so
the unit it extends is a stand-in with the shape of Debian's ``haproxy.service`` (``CONFIG`` in its
environment, a main process that takes ``SIGUSR2`` as its reload), and ``haproxy`` and ``socat`` are
recorders at their Debian paths. What is real is the part fleet wrote: the drop-in, loaded by
systemd 252, whose ``ExecReload=`` lines run on ``systemctl reload``: the configuration check
first, then ``show servers state`` written to the server-state file through ``socat``, then
``SIGUSR2`` to the main process, in that order; and a check that fails stops the reload before
the state is touched or the process signalled. And the admin socket reached over SSH the way
rollouts reach a balancer host (``sudo -n timeout ... socat``), with its failures sorted.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from fleet.inventory.spec import BalancerSpec
from fleet.lb.config import SYSTEM_STATE_FILE, SYSTEMD_DROPIN, systemd_dropin
from fleetlab import ssh

from .conftest import LabFleet

pytestmark = pytest.mark.lab

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "haproxy" / "snapshot-2.6.txt"
SOCKET = "/run/haproxy/admin.sock"
CONFIG = "/etc/haproxy/fleet.cfg"  #: not Debian's default: the drop-in points the unit at it
REC = "/var/tmp/fleet-dropin-test"
UNIT = f"""[Unit]
Description=stand-in with the shape of Debian's haproxy.service (fleet test)
[Service]
Environment="CONFIG=/etc/haproxy/haproxy.cfg" "PIDFILE=/run/haproxy.pid"
ExecStart=/bin/sh -c 'trap "echo usr2 >> {REC}/signals" USR2; while :; do sleep 0.2; done'
"""
#: records its argv; ``FAIL`` in the record directory makes the configuration check fail
HAPROXY = f"""#!/bin/sh
printf '%s\\n' "$*" >> {REC}/haproxy
[ -e {REC}/FAIL ] && {{ echo "[ALERT] config : parsing error" >&2; exit 1; }}
exit 0
"""
#: records its argv and stdin, answers what HAProxy 2.6 answered to `show servers state`
SOCAT = f"""#!/bin/sh
printf '%s\\n' "$*" >> {REC}/socat
cat >> {REC}/socat-stdin
cat {REC}/answer
"""


class Host:
    def __init__(self, lab: LabFleet) -> None:
        self.record = lab.state.hosts[0]
        d = lab.dir
        self.client: paramiko.SSHClient = ssh.connect(self.record.address, lab.state.ssh_port, d.control_key,
                                                      d.known_hosts)  # fmt: skip

    def run(self, command: str, check: bool = True) -> tuple[int, str]:
        rc, out, err = ssh.run(self.client, command, timeout=60)
        if check:
            assert rc == 0, f"{command}: rc {rc}\n{out}\n{err}"
        return rc, out + err

    def put(self, path: str, content: str, mode: str) -> None:
        tmp = f"/home/fleet/.dropin-upload-{abs(hash(path))}"
        with self.client.open_sftp() as sftp, sftp.open(tmp, "wb") as f:
            f.write(content.encode())
        self.run(f"sudo -n install -D -m {mode} {shlex.quote(tmp)} {shlex.quote(path)} && rm -f {shlex.quote(tmp)}")


@pytest.fixture
def balancer_host(lab_fleet: LabFleet) -> Iterator[Host]:
    host = Host(lab_fleet)
    placed = ["/etc/systemd/system/haproxy.service", SYSTEMD_DROPIN, "/usr/sbin/haproxy", "/usr/bin/socat"]
    rc, _ = host.run("test -e /usr/sbin/haproxy || test -e /usr/bin/socat", check=False)
    if rc == 0:
        pytest.skip("this lab host has a haproxy or socat of its own; the test would replace it")
    try:
        host.run(f"sudo -n mkdir -p {REC} /var/lib/haproxy && sudo -n chmod 777 {REC}")
        host.put(f"{REC}/answer", FIXTURE.read_text().split("\n\n", 1)[0].lstrip("\n") + "\n\n", "0644")
        host.put("/etc/systemd/system/haproxy.service", UNIT, "0644")
        host.put("/usr/sbin/haproxy", HAPROXY, "0755")
        host.put("/usr/bin/socat", SOCAT, "0755")
        host.put(SYSTEMD_DROPIN, systemd_dropin(SOCKET, SYSTEM_STATE_FILE, CONFIG), "0644")
        host.run("sudo -n systemctl daemon-reload && sudo -n systemctl start haproxy.service")
        yield host
    finally:
        host.run("sudo -n systemctl stop haproxy.service", check=False)
        host.run(f"sudo -n rm -rf {' '.join(placed)} {REC} {SYSTEM_STATE_FILE} /etc/systemd/system/haproxy.service.d "
                 "&& sudo -n systemctl daemon-reload && sudo -n systemctl reset-failed", check=False)  # fmt: skip
        host.client.close()


def test_systemctl_reload_checks_saves_the_state_then_signals(balancer_host: Host) -> None:
    host = balancer_host
    _, shown = host.run("systemctl show -p ExecReload haproxy.service")
    assert shown.count("argv[]=") == 3, shown  # Debian's own ExecReload= is replaced, not added to
    host.run("sudo -n systemctl reload haproxy.service")
    _, checked = host.run(f"cat {REC}/haproxy")
    assert checked.splitlines() == [f"-Ws -f {CONFIG} -c -q"]
    _, socat = host.run(f"cat {REC}/socat {REC}/socat-stdin")
    assert socat.splitlines() == [f"-t 5 STDIO UNIX-CONNECT:{SOCKET}", "show servers state"]
    _, state = host.run(f"sudo -n cat {SYSTEM_STATE_FILE}")
    assert state.startswith("1\n# be_id be_name srv_id srv_name") and "lab-h1:vllm-0" in state
    _, signals = host.run(f"cat {REC}/signals")
    assert signals.split() == ["usr2"]
    assert host.run("systemctl is-active haproxy.service")[1].strip() == "active"


def test_a_configuration_haproxy_refuses_stops_the_reload_before_anything(balancer_host: Host) -> None:
    host = balancer_host
    host.run(f"touch {REC}/FAIL")
    rc, out = host.run("sudo -n systemctl reload haproxy.service", check=False)
    assert rc != 0, out
    assert host.run(f"test -e {REC}/socat", check=False)[0] != 0  # the state was not dumped
    assert host.run(f"test -e {REC}/signals", check=False)[0] != 0  # nor the process signalled
    assert host.run("systemctl is-active haproxy.service")[1].strip() == "active"  # the old one still serves
    _, journal = host.run("sudo -n journalctl -u haproxy.service --no-pager -n 50")
    assert "[ALERT] config : parsing error" in journal, journal  # HAProxy's own words, where people look


def test_fleet_reaches_a_balancer_hosts_admin_socket_over_ssh(lab_fleet: LabFleet, balancer_host: Host) -> None:
    """``fleet.lb.transport.SshSocket`` as rollouts use it on a ``role: balancer`` host: SSH with
    strict host keys, ``sudo -n timeout ... socat`` with the command line on stdin; its failures
    sorted into "down" (exit 1) and "cannot be used" (exit 2)."""
    from fleet.facts.runner import SshTarget
    from fleet.inventory.spec import load_inventory
    from fleet.lb.runtime import AdminState, parse_snapshot
    from fleet.lb.traffic import Balancer
    from fleet.lb.transport import BalancerDown, BalancerMisconfigured, SshSocket

    host = balancer_host
    loaded = load_inventory(str(lab_fleet.opts.inventory))
    name = host.record.name
    target = SshTarget.from_data(name, loaded.pyinfra.get_host(name).data.dict())
    spec = BalancerSpec("haproxy", name, "0.0.0.0:8080", SOCKET, CONFIG, "b", 5.0)
    # the recorder answers what HAProxy 2.6 answered to both reads of a snapshot
    host.put(f"{REC}/answer", FIXTURE.read_text().lstrip("\n"), "0644")
    balancer = Balancer(spec, SshSocket(target, SOCKET, 5.0))
    try:
        views = balancer.snapshot(fresh=True)
        assert views == parse_snapshot(FIXTURE.read_text().lstrip("\n"))  # every byte came through
        assert len(views) == 3 and views[("meta-llama_Llama", "lab-h2:vllm-0")].admin is AdminState.DRAIN
        assert host.run(f"cat {REC}/socat-stdin")[1].splitlines()[-1] == "show servers state;show stat"
        assert host.run(f"tail -n 1 {REC}/socat")[1].strip() == f"-t 5 STDIO UNIX-CONNECT:{SOCKET}"
        host.put("/usr/bin/socat", "#!/bin/sh\necho '2026/01/01 E connect(5, AF=1 \"/run/haproxy/admin.sock\", 25): "
                                   "No such file or directory' >&2\nexit 1\n", "0755")  # fmt: skip
        with pytest.raises(BalancerDown, match=f"is haproxy running on host {name}"):
            balancer.snapshot(fresh=True)
        host.run("sudo -n rm -f /usr/bin/socat")
        with pytest.raises(BalancerMisconfigured, match="socat is not installed"):
            balancer.snapshot(fresh=True)
    finally:
        balancer.close()
