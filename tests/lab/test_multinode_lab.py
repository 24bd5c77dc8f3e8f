"""An instance over two lab hosts (issue 21): Llama-3.1-70B with ``weights: fp8`` on two
``h100-sxm-1-passthrough`` hosts, which no single one could serve (70 GB of weights on one 80 GB
GPU leaves no KV cache), deployed by ``fleet deploy``; a completion through the leader; the
headless node serves no HTTP; the lab's air gap lets the nodes reach each other on the rendezvous
port only; the worker node's death ends the leader too (exit 0, as vLLM's API server does) and
systemd's ``Restart=always`` brings both back, joined again. Then the instance is rolled as one
unit (issue 21 point 3): a changed setting by ``fleet deploy``, another model that also needs both
hosts (Qwen2.5-72B in fp8) by ``fleet rollout --model``, a rollout whose worker node is killed
during the gates (halted, both nodes back where they were and serving), and ``fleet rollback``."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetlab import airgap, ssh
from fleetlab import lab as lab_ops
from fleetlab.models import stage_model

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
L70 = "meta-llama/Llama-3.1-70B-Instruct"
QWEN = "Qwen/Qwen2.5-72B-Instruct"  # 72.7 B parameters: fp8 weights fill one 80 GB H100 too
#: a quick rollout policy for the lab (every gate still runs)
FAST = ["--soak", "2", "--probe-interval", "0.5", "--health-timeout", "180", "--json"]
UNIT = "fleet-vllm-0.service"
MASTER_PORT = 29501


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("multinode-lab")
    octet = free_octet(os.getpid() + 41, avoid=frozenset({TEST_OCTET}))
    opts = test_lab_options(root, f"pm{os.getpid()}", octet, 2, ("h100-sxm-1-passthrough",))
    try:
        lab = LabFleet(opts, bring_up(opts))
        assert opts.inventory is not None
        with open(opts.inventory, "a") as inventory:
            inventory.write(
                "for _name, _data in lab:\n"
                f"    _data.update(model={L70!r}, weights='fp8', multi_node=True, master_port={MASTER_PORT},"
                "                  nvidia_driver_version='keep')\n"  # the profile's own driver (580.159.04)
            )
        for h in lab.state.hosts:
            client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
            try:
                stage_model(client, h.name, L70)
            finally:
                client.close()
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def on(lab: LabFleet, i: int, command: str, timeout: float = 120) -> tuple[int, str, str]:
    h = lab.state.hosts[i]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def journal_env(lab: LabFleet) -> dict[str, str]:
    """This lab's own rollout journal (beside its inventory), not the machine's default one."""
    assert lab.opts.inventory is not None
    return {**os.environ, "FLEET_JOURNAL": str(lab.opts.inventory.with_name("journal.sqlite"))}


def fleet(lab: LabFleet, *args: str, inventory: bool = True) -> tuple[int, str, str]:
    tail = [str(lab.opts.inventory)] if inventory else []
    proc = subprocess.run([str(FLEET), *args, *tail], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          check=False, env=journal_env(lab))  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def completion(url: str, timeout: float = 30, model: str = L70) -> tuple[int, dict[str, object]]:
    body = json.dumps({"model": model, "prompt": "Say hi", "max_tokens": 8}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}
    except OSError:  # not listening (yet)
        return 0, {}


def show(lab: LabFleet, i: int, prop: str) -> str:
    return on(lab, i, f"systemctl show -p {prop} --value {UNIT}")[1].strip()


def argv(lab: LabFleet, i: int) -> list[str]:
    pid = show(lab, i, "MainPID")
    return on(lab, i, f"tr '\\0' '\\n' < /proc/{pid}/cmdline")[1].split("\n")


TRY = r"""
import errno, json, socket, sys
out = {}
for target in sys.argv[1:]:
    a, p = target.rsplit(":", 1)
    try:
        socket.create_connection((a, int(p)), timeout=5).close(); out[target] = "ok"
    except OSError as e:
        out[target] = errno.errorcode.get(e.errno or 0, str(e))
print(json.dumps(out))
"""


def test_an_instance_over_two_hosts_deploys_serves_and_dies_as_one(pair: LabFleet) -> None:
    leader, worker = pair.state.hosts
    url = f"http://{leader.address}:8000"
    rc, out, err = fleet(pair, "plan", "--json")
    assert rc == 0, out + err

    # preflight: the rendezvous port taken on the leader refuses it, and its worker node is not started
    hold = f"import socket, time; s = socket.socket(); s.bind(({leader.address!r}, {MASTER_PORT})); s.listen(1); "
    squat = "sudo systemd-run --unit=fleet-test-squat python3 -c " + shlex.quote(hold + "time.sleep(600)")
    assert on(pair, 0, squat)[0] == 0
    try:
        # --fail-percent 50: one refused host of two does not stop the deploy; its peer is held back
        rc, out, err = fleet(pair, "deploy", "--json", "--health-timeout", "180", "--fail-percent", "50")
        assert rc == 1, out + err
        refused = {h["host"]: h for h in json.loads(out)["hosts"]}
        assert refused[leader.name]["status"] == "refused", out
        taken = f"rendezvous port {leader.address}:{MASTER_PORT} is taken on {leader.name}"
        assert taken in refused[leader.name]["error"], out
        assert refused[worker.name]["status"] == "refused", out
        assert refused[worker.name]["error"].startswith("not started: instance"), out
        for i in (0, 1):
            assert show(pair, i, "ActiveState") != "active"
    finally:
        on(pair, 0, "sudo systemctl stop fleet-test-squat.service")

    rc, out, err = fleet(pair, "deploy", "--json", "--health-timeout", "180")
    assert rc == 0, out + err
    result = json.loads(out)
    hosts = {h["host"]: h for h in result["hosts"]}
    assert [e["unit"] for e in hosts[leader.name]["endpoints"]] == [UNIT], out
    assert all(e["healthy"] for e in hosts[leader.name]["endpoints"])
    assert hosts[worker.name]["endpoints"] == [] and hosts[worker.name]["status"] == "changed"

    # one unit per node, the same instance name; the leader serves, the other runs headless
    lead_argv, work_argv = argv(pair, 0), argv(pair, 1)
    assert "--headless" not in lead_argv and lead_argv[lead_argv.index("--node-rank") + 1] == "0"
    assert "--headless" in work_argv and work_argv[work_argv.index("--node-rank") + 1] == "1"
    for a in (lead_argv, work_argv):
        assert a[a.index("--master-addr") + 1] == leader.address and a[a.index("--nnodes") + 1] == "2"
        assert a[a.index("--master-port") + 1] == str(MASTER_PORT)

    status, body = completion(url)
    assert status == 200 and body["choices"], body  # type: ignore[index]
    # the headless node serves no HTTP: no process of its unit listens on anything (the hosts share
    # one network namespace, so ss lists every host's listeners; -p names only this host's processes)
    rc, pids, err = on(pair, 1, f"ps -e -o pid=,unit= | awk '$2 == \"{UNIT}\" {{print $1}}'")
    assert rc == 0 and show(pair, 1, "MainPID") in pids.split(), pids + err
    rc, listening, err = on(pair, 1, "sudo ss -Hltnp")
    assert rc == 0, err
    assert f"{leader.address}:8000" in listening  # the leader's API (another host: no process named)
    assert f"{worker.address}:8000" not in listening, listening
    mine = [line for line in listening.splitlines() for pid in pids.split() if f"pid={pid}," in line]
    assert mine == [], mine
    assert any("sshd" in line for line in listening.splitlines()), listening  # -p does name this host's

    # the air gap: the worker reaches the leader's rendezvous port (refused: nothing listens there
    # once every node joined, but the packet got through), and no other port of the leader
    targets = [f"{leader.address}:{MASTER_PORT}", f"{leader.address}:{MASTER_PORT + 1}", f"{leader.address}:8000"]
    rc, got_text, err = on(pair, 1, "python3 -c " + shlex.quote(TRY) + " " + " ".join(targets))
    assert rc == 0, err
    got = json.loads(got_text.strip().splitlines()[-1])
    assert got[targets[0]] == "ECONNREFUSED", got  # the host answered: allowed through
    assert got[targets[1]] == "EHOSTUNREACH" and got[targets[2]] == "EHOSTUNREACH", got  # rejected at once
    table = airgap.listed(pair.opts.name)
    assert table is not None, "the lab's nft table is gone"
    opened = re.findall(rf"ip daddr {re.escape(leader.address)} tcp dport (\{{[^}}]*\}}|\d+) accept", table)
    assert any(str(MASTER_PORT) in ports.strip("{ }").split(", ") for ports in opened), table

    # fleet status reads a multi-node fleet without crashing
    rc, out, err = fleet(pair, "status", "--json")
    assert rc in (0, 1) and "Traceback" not in err, err

    # a second deploy changes nothing
    rc, out, err = fleet(pair, "deploy", "--json", "--health-timeout", "180")
    assert rc == 0, out + err
    assert {h["status"] for h in json.loads(out)["hosts"]} == {"unchanged"}, out

    # the worker node's process dies: the leader's instance ends too, and systemd brings both back
    lead_pid, lead_restarts = show(pair, 0, "MainPID"), int(show(pair, 0, "NRestarts"))
    work_pid, work_restarts = show(pair, 1, "MainPID"), int(show(pair, 1, "NRestarts"))
    assert on(pair, 1, f"sudo kill -KILL {work_pid}")[0] == 0
    killed = time.monotonic()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and show(pair, 0, "MainPID") == lead_pid:
        time.sleep(0.5)
    assert show(pair, 0, "MainPID") != lead_pid, "the leader kept running without its worker node"
    rc, journal, _err = on(pair, 0, f"sudo journalctl -u {UNIT} --no-pager -o cat -n 200")
    assert "node rank 1 left the torch.distributed world" in journal, journal[-3000:]
    systemd = on(pair, 0, f"sudo journalctl -u {UNIT} --no-pager -n 200")[1]
    # exit 0, not asked for by systemd (systemd 252 logs a clean exit so; a failure "Main process exited")
    assert f"{UNIT}: Deactivated successfully." in systemd and "Main process exited" not in systemd, systemd[-3000:]
    assert f"Stopping {UNIT}" not in systemd, systemd[-3000:]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if completion(url, timeout=5)[0] == 200:
            break
        time.sleep(1)
    assert completion(url)[0] == 200, "the instance did not come back after its worker node's death"
    print(f"\nserving again {time.monotonic() - killed:.1f} s after the worker node's process was killed")
    assert int(show(pair, 0, "NRestarts")) == lead_restarts + 1 and int(show(pair, 1, "NRestarts")) == work_restarts + 1
    assert show(pair, 1, "MainPID") != work_pid and show(pair, 1, "ActiveState") == "active"

    # a changed setting on the serving instance: `fleet deploy` rolls it as one unit (both nodes
    # stopped, switched to the new configuration revision, started together, gated on the leader)
    pids = (show(pair, 0, "MainPID"), show(pair, 1, "MainPID"))
    assert pair.opts.inventory is not None
    with open(pair.opts.inventory, "a") as inventory:
        inventory.write("for _name, _data in lab:\n    _data['shutdown_timeout'] = 7\n")
    rc, out, err = fleet(pair, "deploy", "--json", "--health-timeout", "180")
    assert rc == 0, out + err
    hosts = {h["host"]: h for h in json.loads(out)["hosts"]}
    for name in (leader.name, worker.name):
        assert hosts[name]["status"] == "changed" and hosts[name]["restarted"], out
        assert any(op.startswith("rolled out vllm-0 (rollout ") for op in hosts[name]["operations"]), out
    assert [e["unit"] for e in hosts[leader.name]["endpoints"]] == [UNIT] and hosts[worker.name]["endpoints"] == []
    for i in (0, 1):
        a = argv(pair, i)
        assert a[a.index("--shutdown-timeout") + 1] == "7", a
        assert show(pair, i, "MainPID") != pids[i] and show(pair, i, "ActiveState") == "active"
    assert completion(url)[0] == 200


def node_state(lab: LabFleet) -> list[tuple[str, str, str]]:
    """Each node's unit state, the model its process serves and its live configuration revision."""
    out = []
    for i in (0, 1):
        a = argv(lab, i)
        rc, rev, err = on(lab, i, "sudo cat /etc/systemd/system/fleet-vllm-0.service /etc/fleet/vllm-0.env | sha256sum")
        assert rc == 0, err
        out.append((show(lab, i, "ActiveState"), a[a.index("serve") + 1], rev.split()[0]))
    return out


def test_the_instance_rolls_to_another_model_as_one_unit_and_a_node_failure_sends_both_back(pair: LabFleet) -> None:
    """After the deploy test: both nodes serve Llama-3.1-70B."""
    leader, worker = pair.state.hosts
    url = f"http://{leader.address}:8000"
    assert [m for _s, m, _r in node_state(pair)] == [L70, L70], "the deploy test did not leave the instance serving"
    for h in pair.state.hosts:
        client = ssh.connect(h.address, pair.state.ssh_port, pair.dir.control_key, pair.dir.known_hosts)
        try:
            stage_model(client, h.name, QWEN)
        finally:
            client.close()

    # another model that also needs both hosts: one canary, the whole instance
    started = time.monotonic()
    rc, out, err = fleet(pair, "rollout", "--model", QWEN, *FAST)
    assert rc == 0, out + err
    print(f"\nrolled the two-node instance to {QWEN} in {time.monotonic() - started:.1f} s")
    data = json.loads(out)
    qwen_rollout = next(op.rsplit(" ", 1)[1].rstrip(")") for op in data["hosts"][0]["operations"] if "rollout" in op)
    on_qwen = node_state(pair)
    assert [(s, m) for s, m, _r in on_qwen] == [("active", QWEN), ("active", QWEN)], on_qwen
    work_argv = argv(pair, 1)
    assert "--headless" in work_argv and work_argv[work_argv.index("--nnodes") + 1] == "2", work_argv
    status, body = completion(url, model=QWEN)
    assert status == 200 and body["choices"], body  # type: ignore[index]

    # a node fails mid-rollout: back to Llama (what the inventory says), the worker's new process
    # killed while the leader loads (its load slowed to 30 s), after fleet saw it start
    assert on(pair, 0, "echo '{\"load_seconds\": 30}' | sudo tee /etc/fleet-lab/vllm-faults.json >/dev/null")[0] == 0
    work_pid = show(pair, 1, "MainPID")
    proc = subprocess.Popen([str(FLEET), "rollout", *FAST, str(pair.opts.inventory)], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=journal_env(pair))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            pid = show(pair, 1, "MainPID")
            if pid not in ("", "0", work_pid) and L70 in argv(pair, 1):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the worker node was never started on the new model: " + proc.communicate()[0])
        time.sleep(5)  # fleet sees the worker's new unit up (its gate's baseline) while the leader loads
        assert on(pair, 1, f"sudo kill -KILL {pid}")[0] == 0
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        on(pair, 0, "sudo rm -f /etc/fleet-lab/vllm-faults.json")
    assert proc.returncode == 1, out + err
    data = json.loads(out)
    print(f"the rollout whose worker node was killed: {data['error'].splitlines()[0]}")
    assert "halted" in data["error"], data["error"]
    named = f"instance vllm-0 spanning {leader.name} (leader), {worker.name}: node "
    assert named in data["error"], data["error"]
    # every node back on what it ran (the Qwen configuration revision) and serving
    back = node_state(pair)
    assert back == on_qwen, (back, on_qwen)
    assert completion(url, model=QWEN)[0] == 200
    # the journal says what happened, per node
    found = re.search(r"rollout (\S+) halted", data["error"])
    assert found is not None, data["error"]
    failed_id = found.group(1)
    rc, shown, err = fleet(pair, "history", failed_id, "--json", inventory=False)
    assert rc == 0, shown + err
    journal = json.loads(shown)
    assert journal["status"] == "halted" and named in journal["reason"], journal["reason"]
    phases = {i["instance"]: i["phase"] for i in journal["instances"]}
    assert phases == {f"{leader.name}/vllm-0": "rolled_back", f"{worker.name}/vllm-0": "rolled_back"}, phases
    stepped = {(s["instance"], s["action"]) for s in journal["steps"]}
    for node in (f"{leader.name}/vllm-0", f"{worker.name}/vllm-0"):
        assert {(node, "stop"), (node, "flip"), (node, "start")} <= stepped, stepped

    # `fleet rollback` of the Qwen rollout: both nodes back on Llama's configuration, serving
    rc, out, err = fleet(pair, "rollback", qwen_rollout, *FAST, inventory=False)
    assert rc == 0, out + err
    assert json.loads(out)["status"] == "done", out
    assert [(s, m) for s, m, _r in node_state(pair)] == [("active", L70), ("active", L70)]
    assert completion(url)[0] == 200
