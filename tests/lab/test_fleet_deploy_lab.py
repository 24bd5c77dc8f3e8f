"""``fleet deploy`` (first cut) on a lab host with its driver: --dry touches nothing, a first
deploy installs the release and units, starts them and waits until each instance is healthy and
lists its model, and a second deploy changes nothing."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fleetlab import airgap
from fleetlab import lab as lab_ops

from .conftest import TEST_OCTET, LabFleet, bring_up, free_octet, require_lab, test_lab_options
from .deploying import REPO_ROOT, host_run

pytestmark = pytest.mark.lab

FLEET = Path(sys.executable).parent / "fleet"
CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "meta-llama" / "Llama-3.1-8B-Instruct" / "config.json"
HUB = "/var/lib/vllm/hf/hub/models--meta-llama--Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def served_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("deploy-lab")
    octet = free_octet(os.getpid() + 13, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pf{os.getpid()}", octet, 1, ("rtx4090-2",)))
    try:
        yield LabFleet(opts, bring_up(opts))
    finally:
        lab_ops.down(opts.name, opts.state_root)
    assert airgap.listed(opts.name) is None, "fleet lab down left the air gap's nft table behind"


def fleet_deploy(lab: LabFleet, *args: str) -> tuple[int, dict[str, object] | str]:
    proc = subprocess.run(
        [str(FLEET), "deploy", str(lab.opts.inventory), "--json", "--health-timeout", "120", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


def test_dry_run_reports_changes_and_touches_nothing(served_lab: LabFleet) -> None:
    rc, result = fleet_deploy(served_lab, "--dry")
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "would change"
    assert "vLLM system user" in host["operations"] and "vLLM units and env files" in host["operations"]
    assert host_run(served_lab, "test -e /opt/fleet")[0] != 0


def test_unknown_limit_is_refused_before_any_host_is_touched(served_lab: LabFleet) -> None:
    rc, result = fleet_deploy(served_lab, "--limit", "no-such-host")
    assert rc == 2 and isinstance(result, dict) and "--limit" in str(result["error"])


def test_first_deploy_serves_and_a_second_changes_nothing(served_lab: LabFleet) -> None:
    # The model's files are not fleet's to fetch yet (model distribution is its own step): put the
    # config where vLLM's Hugging Face cache lookup finds it, as the vllm user will own it.
    rc, _out, err = host_run(
        served_lab,
        f"sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group vllm "
        f"&& sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee {HUB}/refs/main "
        f"&& echo {base64.b64encode(CONFIG.read_bytes()).decode()} | base64 -d "
        f"| sudo -u vllm tee {HUB}/snapshots/main/config.json >/dev/null",
    )
    assert rc == 0, err
    rc, result = fleet_deploy(served_lab)
    if rc != 0:
        print(host_run(served_lab, "sudo journalctl -u fleet-vllm-0.service --no-pager | tail -20")[1])
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed" and host["reboot_required"] is None
    assert "start fleet-vllm-0.service" in host["operations"]
    assert [e["healthy"] for e in host["endpoints"]] == [True, True]
    assert all("meta-llama/Llama-3.1-8B-Instruct" in e["detail"] for e in host["endpoints"])
    rc, again = fleet_deploy(served_lab)
    assert rc == 0 and isinstance(again, dict), again
    (host,) = again["hosts"]  # type: ignore[misc]
    assert host["status"] == "unchanged" and host["operations"] == [], host
    assert [e["healthy"] for e in host["endpoints"]] == [True, True]


def test_a_changed_watcher_unit_is_rewritten_and_restarted_with_systemd_reloaded(served_lab: LabFleet) -> None:
    # The watcher's files, ``systemctl enable`` and its restart go in one command, with no
    # ``daemon-reload`` of their own: ``systemctl enable`` reloads systemd itself (systemctl(1),
    # ``--no-reload``). Were it not so, systemd would still run the hand-edited unit below and
    # say so (NeedDaemonReload=yes).
    unit = "/etc/systemd/system/fleet-gpu-watch.service"
    show = "systemctl show -p NeedDaemonReload -p ActiveState -p MainPID fleet-gpu-watch.service"
    rc, before, err = host_run(
        served_lab,
        f"echo '# changed by hand' | sudo tee -a {unit} >/dev/null && sudo systemctl daemon-reload && {show}",
    )
    assert rc == 0 and "NeedDaemonReload=no" in before, err
    rc, result = fleet_deploy(served_lab)
    assert rc == 0 and isinstance(result, dict), result
    (host,) = result["hosts"]  # type: ignore[misc]
    assert host["status"] == "changed" and len(host["operations"]) == 1, host
    assert "GPU watcher program and unit" in host["operations"][0]
    rc, after, err = host_run(served_lab, f"{show}; grep -c 'changed by hand' {unit} || true")
    assert rc == 0, err
    assert "NeedDaemonReload=no" in after and "ActiveState=active" in after and after.strip().endswith("0"), after
    pids = [re.findall(r"MainPID=(\d+)", text) for text in (before, after)]
    assert pids[0] and pids[1] and pids[0] != pids[1], (before, after)  # restarted
    rc, again = fleet_deploy(served_lab)
    assert rc == 0 and isinstance(again, dict) and again["hosts"][0]["status"] == "unchanged", again  # type: ignore[index]


# ---- the air gap ---------------------------------------------------------------------------------

#: Run on a lab host: try a TCP connection to each (address, port) with a short timeout and print
#: the outcome as JSON ("ok", or the errno's name); then fetch the index page.
TRY_CONNECT = r"""
import errno, json, socket, sys, urllib.request
out = {}
for target in sys.argv[2:]:
    address, _, port = target.rpartition(":")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((address.strip("[]"), int(port)))
        out[target] = "ok"
    except socket.timeout:
        out[target] = "timeout"
    except OSError as exc:
        out[target] = errno.errorcode.get(exc.errno, str(exc))
    finally:
        s.close()
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        out["index"] = r.status
except OSError as exc:
    out["index"] = str(exc)
print(json.dumps(out))
"""


def _listener(family: int, address: str) -> socket.socket | None:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((address, 0))
        sock.listen(8)
        return sock
    except OSError:
        return None


def test_hosts_reach_only_the_lab_index_and_apt_repository(served_lab: LabFleet) -> None:
    """The lab's air gap (fleetlab.airgap): the deploy above installed from the index and serves;
    a control-machine port that answers here, another lab address and ::1 are refused from the host."""
    assert host_run(served_lab, "systemctl is-active fleet-vllm-0.service")[1].strip() == "active"
    state = served_lab.state
    index_url = next(iter(_inventory_data(served_lab).values()))["pip_index_url"]
    assert state.air_gap == [str(airgap.endpoint_of(index_url))]
    v4 = _listener(socket.AF_INET, "127.0.0.1")
    v6 = _listener(socket.AF_INET6, "::1")
    assert v4 is not None
    try:
        here = f"127.0.0.1:{v4.getsockname()[1]}"
        with socket.create_connection(("127.0.0.1", v4.getsockname()[1]), timeout=3):
            pass  # it answers from the control machine
        targets = [here, str(airgap.endpoint_of(index_url)), f"127.0.{state.octet}.250:22"]
        loop6 = f"[::1]:{v6.getsockname()[1]}" if v6 is not None else None
        if loop6 is not None:
            targets.append(loop6)
        rc, out, err = host_run(served_lab, "timeout 60 python3 -c " + _quote(TRY_CONNECT) + " " + index_url + " "
                                + " ".join(targets))  # fmt: skip
        assert rc == 0, err
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        v4.close()
        if v6 is not None:
            v6.close()
    assert got[str(airgap.endpoint_of(index_url))] == "ok" and got["index"] == 200, got
    assert got[here] == "EHOSTUNREACH", got  # rejected at once, not a timeout
    assert got[f"127.0.{state.octet}.250:22"] == "EHOSTUNREACH", got
    if loop6 is not None:
        assert got[loop6] == "EACCES", got  # ICMPv6 "administratively prohibited"
    table = airgap.listed(served_lab.opts.name)
    assert table is not None and f"fleet-lab/{state.hosts[0].name}" in table and "reject with icmpx" in table


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _inventory_data(lab: LabFleet) -> dict[str, dict[str, object]]:
    from fleet.inventory.spec import load_inventory

    loaded = load_inventory(str(lab.opts.inventory))
    return {s.name: loaded.pyinfra.get_host(s.name).data.dict() for s in loaded.hosts}


# ---- preflight refusal on a serving host -------------------------------------------------------

FAULTS = "/etc/fleet-lab/vllm-faults.json"
SERVING_FILES = (
    "/etc/systemd/system/fleet-vllm-0.service /etc/systemd/system/fleet-vllm-1.service "
    "/etc/fleet/vllm-0.env /etc/fleet/vllm-1.env"
)


def _serving(lab: LabFleet) -> dict[str, object]:
    """MainPID and argv of each unit, the release ``current`` names, and a hash of the units' and
    env files' contents (through any link to a configuration revision)."""
    out: dict[str, object] = {}
    for n in (0, 1):
        unit = f"fleet-vllm-{n}.service"
        _rc, pid, _err = host_run(lab, f"systemctl show -p MainPID --value {unit}")
        _rc, argv, _err = host_run(lab, f"tr '\\0' ' ' < /proc/{pid.strip()}/cmdline")
        out[unit] = (pid.strip(), argv)
    out["current"] = host_run(lab, "readlink /opt/fleet/vllm/current")[1].strip()
    rc, text, err = host_run(lab, f"sudo cat {SERVING_FILES}")
    assert rc == 0, err
    out["files"] = hashlib.sha256(text.encode()).hexdigest()
    return out


def test_a_flag_the_hosts_vllm_refuses_is_stopped_by_preflight(served_lab: LabFleet) -> None:
    """The host's vLLM build lacks --no-enable-prefix-caching (the stand-in's unknown_flags fault);
    the inventory turns prefix caching off, which fleet's own surface accepts: the deploy refuses
    the host by name, with the flag and the way out, exit 1, and the old units keep serving."""
    name = served_lab.state.hosts[0].name
    before = _serving(served_lab)
    assert before["fleet-vllm-0.service"][0] not in ("", "0"), before  # type: ignore[index]
    rc, _out, err = host_run(
        served_lab, f"echo '{json.dumps({'unknown_flags': ['--no-enable-prefix-caching']})}' | sudo tee {FAULTS}"
    )
    assert rc == 0, err
    text = served_lab.opts.inventory.read_text()
    served_lab.opts.inventory.write_text(text.replace("'port': 8000,", "'port': 8000, 'prefix_caching': False,"))
    try:
        rc, result = fleet_deploy(served_lab)
        assert rc == 1 and isinstance(result, dict), result
        (host,) = result["hosts"]  # type: ignore[misc]
        assert host["host"] == name and host["status"] == "refused", host
        error = str(host["error"])
        assert f"host {name}, fleet-vllm-0.service: preflight flags" in error, error
        assert "unrecognized arguments: --no-enable-prefix-caching" in error, error
        assert "inventory turns prefix caching off" in error and "vllm_version" in error, error
        assert not host["restarted"]
        after = _serving(served_lab)
        for unit in ("fleet-vllm-0.service", "fleet-vllm-1.service"):
            assert after[unit] == before[unit], (unit, before[unit], after[unit])  # same process, same argv
        assert after["current"] == before["current"]
        assert after["files"] == before["files"]  # the units and env files as they were
    finally:
        host_run(served_lab, f"sudo rm -f {FAULTS}")
        served_lab.opts.inventory.write_text(text)


# ---- a full filesystem for releases (issue 25.4) ------------------------------------------------

RELEASES = "/opt/fleet/vllm/releases"
#: a copy of the host's release, put on the small filesystem that covers the releases directory
COPY = "/run/fleet-test-release-copy"


def _releases_on_the_host(lab: LabFleet) -> list[str]:
    rc, out, err = host_run(lab, f"ls -A {RELEASES}")
    assert rc == 0, err
    return sorted(out.split())


def test_a_full_filesystem_for_releases_is_named_with_the_numbers_and_leaves_no_half_built_release(
    served_lab: LabFleet,
) -> None:
    """A new release (the index URL spelled without its slash: a new release by content) on a host
    whose releases live on a small filesystem (a tmpfs over the directory). With room for less than
    the host's own release, the deploy refuses before writing anything and says ENOSPC, how much it
    needs (measured from that release) and how much is free where. With the estimate fooled (a tiny
    complete "release" is all there is to measure) the build itself runs out of space (where pip
    runs: the issue's "ensurepip ... exit status 1" where venv's ensurepip installs it): the message
    says ENOSPC, and no half-built release is left. The serving instances are not touched either way."""
    text = served_lab.opts.inventory.read_text()
    url = str(next(iter(_inventory_data(served_lab).values()))["pip_index_url"])
    (current,) = _releases_on_the_host(served_lab)
    before = _serving(served_lab)
    served_lab.opts.inventory.write_text(
        text.replace(f"'pip_index_url': '{url}'", f"'pip_index_url': '{url.rstrip('/')}'")
    )
    mounted = False
    try:
        rc, _out, err = host_run(
            served_lab,
            f"sudo mkdir -p {COPY} && sudo cp -a {RELEASES}/{current} {COPY}/ && "
            f"sudo mount -t tmpfs -o size=40m,mode=755 fleet-test-releases {RELEASES} && "
            f"sudo cp -a {COPY}/{current} {RELEASES}/",
        )
        mounted = True
        assert rc == 0, err
        rc, result = fleet_deploy(served_lab)
        assert rc == 1 and isinstance(result, dict), result
        (host,) = result["hosts"]  # type: ignore[misc]
        assert host["status"] == "failed" and "vLLM release" in str(host["error"]), host
        error = str(host["error"])
        got = re.search(
            r"No space left on device \(ENOSPC\): needs (\d+) MiB \(the largest release here, (\S+), is (\d+) MiB, "
            r"\+10%\), (\d+) MiB free on fleet-test-releases mounted at /opt/fleet/vllm/releases; nothing was written",
            error,
        )
        assert got is not None, error
        need, measured, largest, free = int(got[1]), got[2], int(got[3]), int(got[4])
        assert measured == current and 20 <= largest <= 40 and need >= largest and free < need, error
        assert _releases_on_the_host(served_lab) == [current]  # nothing was written
        assert _serving(served_lab) == before

        # the estimate fooled: the only "release" to measure is tiny, so the check passes
        rc, _out, err = host_run(
            served_lab,
            f"sudo rm -rf {RELEASES}/{current} && sudo mkdir {RELEASES}/tiny && "
            f"echo '{{}}' | sudo tee {RELEASES}/tiny/.fleet-release.json >/dev/null && "
            f"sudo mount -o remount,size=12m {RELEASES}",
        )
        assert rc == 0, err
        rc, result = fleet_deploy(served_lab)
        assert rc == 1 and isinstance(result, dict), result
        (host,) = result["hosts"]  # type: ignore[misc]
        error = str(host["error"])
        assert host["status"] == "failed", host
        # the venv is made without pip; pip (run from ensurepip's wheel) installs pip, setuptools
        # and the requirements in one run, which is where the space runs out
        assert "No space left on device (ENOSPC) during pip install: needed more than the " in error, error
        assert "MiB were free on fleet-test-releases mounted at /opt/fleet/vllm/releases when it failed" in error, error
        assert error.rstrip().endswith("the half-built release was removed"), error
        assert _releases_on_the_host(served_lab) == ["tiny"]  # no half-built release left
        assert _serving(served_lab) == before
    finally:
        served_lab.opts.inventory.write_text(text)
        if mounted:
            host_run(served_lab, f"sudo umount {RELEASES}; sudo rm -rf {COPY}")
    assert _releases_on_the_host(served_lab) == [current]
    assert _serving(served_lab) == before


# ---- three bare hosts with different GPU profiles -----------------------------------------------

PROFILES = ("rtx4090-2", "l40s-4", "a10-1")
KEY = "lab-secret-" + base64.b32encode(os.urandom(15)).decode().lower()
#: a regular expression that matches the key but not itself (the greps run on the hosts)
KEY_RE = "[l]" + KEY[1:]


@pytest.fixture(scope="module")
def fleet3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabFleet]:
    require_lab()
    root = tmp_path_factory.mktemp("deploy-fleet3")
    octet = free_octet(os.getpid() + 29, avoid=frozenset({TEST_OCTET}))
    opts = replace(test_lab_options(root, f"pg{os.getpid()}", octet, 3, PROFILES), bare=True)
    try:
        lab = LabFleet(opts, bring_up(opts))
        assert opts.inventory is not None
        with open(opts.inventory, "a") as inventory:  # this fleet serves behind an API key
            inventory.write('for _name, _data in lab:\n    _data["api_key_ref"] = "env:FLEET_LAB_API_KEY"\n')
            # the rollouts deploy runs here soak 2 s: the default 30 s soak is policy, not what these
            # tests check (it made the model change below take ~290 s of CI)
            inventory.write('for _name, _data in lab:\n    _data["rollout"] = {"soak_s": 2, "probe_interval_s": 0.5}\n')
        for i in range(3):
            rc, _out, err = on(lab, i, seed_model_cache())
            assert rc == 0, err
        yield lab
    finally:
        lab_ops.down(opts.name, opts.state_root)


def seed_model_cache() -> str:
    """The model's config where the units' Hugging Face cache lookup finds it (owned by vllm)."""
    return (
        f"sudo useradd --system --home-dir /var/lib/vllm --create-home --shell /usr/sbin/nologin --user-group vllm "
        f"&& sudo -u vllm mkdir -p {HUB}/snapshots/main {HUB}/refs && echo main | sudo -u vllm tee {HUB}/refs/main "
        f"&& echo {base64.b64encode(CONFIG.read_bytes()).decode()} | base64 -d "
        f"| sudo -u vllm tee {HUB}/snapshots/main/config.json >/dev/null"
    )


def on(lab: LabFleet, i: int, command: str, timeout: float = 120) -> tuple[int, str, str]:
    from fleetlab import ssh

    h = lab.state.hosts[i]
    client = ssh.connect(h.address, lab.state.ssh_port, lab.dir.control_key, lab.dir.known_hosts)
    try:
        return ssh.run(client, command, timeout=timeout)
    finally:
        client.close()


def journal3(lab: LabFleet) -> Path:
    """This fleet's rollout journal (``fleet deploy`` journals the rollouts it runs)."""
    return lab.opts.state_root.parent / "journal.sqlite"


def deploy3(lab: LabFleet, *args: str, log: list[str] | None = None) -> tuple[int, dict[str, object] | str]:
    proc = subprocess.run(
        [str(FLEET), "deploy", str(lab.opts.inventory), "--json", "--health-timeout", "180", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200, check=False,
        env={**os.environ, "FLEET_LAB_API_KEY": KEY, "FLEET_JOURNAL": str(journal3(lab))},
    )  # fmt: skip
    if log is not None:
        log.append(proc.stderr)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, proc.stdout + proc.stderr


PIDS = (
    "for u in $(systemctl list-units --plain --no-legend 'fleet-vllm-*' | cut -d' ' -f1); "
    'do echo "$u $(systemctl show -p MainPID --value $u)"; done'
)


def unit_pids(lab: LabFleet) -> dict[tuple[int, str], str]:
    out = {}
    for i in range(3):
        _rc, text, _err = on(lab, i, PIDS)
        for line in text.split("\n"):
            if line.strip():
                unit, pid = line.split()
                out[(i, unit)] = pid
    return out


def planned_argv(lab: LabFleet) -> dict[str, list[list[str]]]:
    from fleet.inventory.spec import load_inventory
    from fleet.render.part import host_plan

    loaded = load_inventory(str(lab.opts.inventory))
    return {s.name: [i.argv for i in host_plan(s).instances] for s in loaded.hosts}


def planned_ports(lab: LabFleet) -> dict[str, list[int]]:
    from fleet.inventory.spec import load_inventory
    from fleet.render.part import host_plan

    loaded = load_inventory(str(lab.opts.inventory))
    return {s.name: [i.port for i in host_plan(s).instances] for s in loaded.hosts}


def test_three_bare_hosts_to_serving_with_their_computed_flags(fleet3: LabFleet) -> None:
    """The README's first run: bare hosts, their driver installed, rebooted one at a time, the
    units planned from the probe once NVML answers, started and checked. Instances that never
    served anyone are started, not rolled: no unit starts at boot from the inventory's gpu entry
    (issue 19.1: the reboot started them, and the engine then rolled every one, canary, 25 %
    batches and 30 s soaks, for minutes)."""
    rc, result = deploy3(fleet3, "--reboot")
    assert rc == 0 and isinstance(result, dict), result
    hosts = result["hosts"]
    assert isinstance(hosts, list) and len(hosts) == 3
    for h in hosts:
        assert h["status"] == "changed" and h["reboot_required"] is None, h
        assert any(op.startswith("reboot") for op in h["operations"]), h["operations"]
        assert h["endpoints"] and all(e["healthy"] for e in h["endpoints"]), h
        ops = h["operations"]
        assert not h["restarted"] and not any(op.startswith("rolled out") for op in ops), json.dumps(ops)
        started = " ".join(op for op in ops if op.startswith("start fleet-vllm-"))
        assert all(e["unit"] in started for e in h["endpoints"]), json.dumps(h)  # started by the deploy
    from fleet.rollout.journal import Journal

    with Journal(journal3(fleet3)) as journal:
        assert journal.history() == []  # no rollout
    for i in range(3):  # they start at boot from now on: they were started, past preflight
        units = "for u in /etc/systemd/system/fleet-vllm-*.service; do systemctl is-enabled ${u##*/}; done"
        rc, out, _err = on(fleet3, i, units + " | sort -u")
        assert out.split() == ["enabled"], (i, out)
    plans = planned_argv(fleet3)
    for i, host in enumerate(fleet3.state.hosts):
        want = plans[host.name]
        assert len(want) == len(next(h for h in hosts if h["host"] == host.name)["endpoints"])
        for n, argv in enumerate(want):
            _rc, cmdline, _err = on(
                fleet3, i, f"tr '\\0' '\\n' < /proc/$(systemctl show -p MainPID --value fleet-vllm-{n}.service)/cmdline"
            )
            running = cmdline.strip("\n").split("\n")
            assert running[running.index("serve") + 1 :] == argv, (host.name, running, argv)


def test_the_air_gap_holds_after_the_reboots(fleet3: LabFleet) -> None:
    """--reboot power-cycled every host (new cgroups): the air gap was loaded again for them."""
    v4 = _listener(socket.AF_INET, "127.0.0.1")
    assert v4 is not None
    here = f"127.0.0.1:{v4.getsockname()[1]}"
    index_url = str(next(iter(_inventory_data(fleet3).values()))["pip_index_url"])
    try:
        for i in range(3):
            rc, out, err = on(fleet3, i, f"timeout 60 python3 -c {_quote(TRY_CONNECT)} {index_url} {here}")
            assert rc == 0, err
            got = json.loads(out.strip().splitlines()[-1])
            assert got == {here: "EHOSTUNREACH", "index": 200}, (i, got)
    finally:
        v4.close()


def test_a_second_run_changes_nothing_and_restarts_nothing(fleet3: LabFleet) -> None:
    before = unit_pids(fleet3)
    assert len(before) >= 3
    log: list[str] = []
    rc, result = deploy3(fleet3, log=log)
    assert rc == 0 and isinstance(result, dict), result
    # Every fact the operations read came in one batch per host (fleet.deploy.prefetch), and
    # nothing changed, so nothing was read again.
    assert "facts on 3 host(s):" in log[0] and "0 read on their own" in log[0], log[0]
    for h in result["hosts"]:  # type: ignore[union-attr]
        assert h["status"] == "unchanged" and h["operations"] == [] and not h["restarted"], h
        assert all(e["healthy"] for e in h["endpoints"])
    assert unit_pids(fleet3) == before


def test_the_units_facts_read_what_systemd_and_proc_say(fleet3: LabFleet) -> None:
    """``InstanceRevisions`` and ``UnitStates`` ask systemd once for all of a host's units: each
    unit's state is what ``systemctl is-active`` says of it alone, its interpreter what the
    per-unit command (``releases.main_exe_sh``) reads, a unit that does not exist is inactive; a
    file newer than the unit's start makes it stale, the unit's own files do not."""
    from fleet.escape import ssh_command
    from fleet.facts.releases import main_exe_sh
    from fleet.facts.revisions import parse_revisions, revisions_command
    from fleet.facts.unit_states import UnitState, unit_states, unit_states_command
    from fleet.operations.host import PATHS

    units = [*sorted(u for i, u in unit_pids(fleet3) if i == 0), "fleet-vllm-absent.service"]
    names = [u.removeprefix("fleet-").removesuffix(".service") for u in units]
    files = {u: (f"{PATHS.unit_dir}/{u}", f"{PATHS.env_dir}/{n}.env") for u, n in zip(units, names, strict=True)}
    rc, out, err = on(fleet3, 0, ssh_command(["sudo", "sh", "-c", revisions_command(
        [(n, u, *files[u]) for u, n in zip(units, names, strict=True)])]))  # fmt: skip
    assert rc == 0, err
    found = parse_revisions(out.splitlines())
    for unit, name in zip(units, names, strict=True):
        _rc, state, _err = on(fleet3, 0, f"systemctl is-active {unit}")
        _rc, exe, _err = on(fleet3, 0, f"sudo sh -c {ssh_command([main_exe_sh(unit)])}")
        assert (found[name]["state"], found[name]["exe"]) == (state.strip(), exe.strip() or None), (unit, out)
    assert found["vllm-absent"]["state"] == "inactive" and found["vllm-absent"]["exe"] is None
    assert sum(f["state"] == "active" and f["exe"] is not None for f in found.values()) >= 1

    rc, newer, err = on(fleet3, 0, 'f=$(mktemp) && touch -d "@$(($(date +%s) + 3600))" "$f" && echo "$f"')
    assert rc == 0, err
    try:
        checked = [(u, files[u]) for u in units] + [(units[0], (files[units[0]][0], newer.strip()))]
        rc, out, err = on(fleet3, 0, ssh_command(["sudo", "sh", "-c", unit_states_command(checked)]))
        assert rc == 0, err
        states = unit_states(out.splitlines())
    finally:
        on(fleet3, 0, ssh_command(["rm", "-f", newer.strip()]))
    assert states == [UnitState(u, u != units[-1], False) for u in units] + [UnitState(units[0], True, True)], out


def test_a_changed_service_user_is_seen_and_put_back_without_a_restart(fleet3: LabFleet) -> None:
    """The service user is read alone (``fleet.facts.users.UserEntry``, not pyinfra's ``Users``
    of every user): a shell changed by hand is still seen by a re-run and put back."""
    before = unit_pids(fleet3)
    rc, out, err = on(fleet3, 1, "sudo usermod -s /bin/bash vllm && getent passwd vllm")
    assert rc == 0 and out.strip().endswith(":/bin/bash"), (out, err)
    rc, result = deploy3(fleet3)
    assert rc == 0 and isinstance(result, dict), result
    status = {h["host"]: (h["status"], h["operations"]) for h in result["hosts"]}  # type: ignore[union-attr]
    name = fleet3.state.hosts[1].name
    assert status.pop(name) == ("changed", ["vLLM system user"]), result
    assert all(s == ("unchanged", []) for s in status.values()), status
    rc, out, _err = on(fleet3, 1, "getent passwd vllm")
    fields = out.strip().split(":")
    assert fields[0] == "vllm" and fields[5:] == ["/var/lib/vllm", "/usr/sbin/nologin"], out
    assert unit_pids(fleet3) == before


def test_the_api_key_is_in_no_argv_journal_or_world_readable_file(fleet3: LabFleet) -> None:
    for i in range(3):
        rc, out, _err = on(
            fleet3, i,
            f"ps -eo args | grep -c '{KEY_RE}' ; sudo journalctl --no-pager | grep -c '{KEY_RE}' ; "
            f"sudo find / -xdev -type f -perm -o=r -size -2M -exec grep -l '{KEY_RE}' {{}} + 2>/dev/null | wc -l",
        )  # fmt: skip
        assert [int(x) for x in out.split()] == [0, 0, 0], (i, out)
        rc, out, _err = on(
            fleet3, i, f"sudo grep -l '{KEY_RE}' /etc/fleet/vllm-0.env; sudo stat -c '%a %U' /etc/fleet/vllm-0.env"
        )
        assert rc == 0 and "600 root" in out, out


def test_a_preflight_refusal_stops_before_any_restart(fleet3: LabFleet) -> None:
    # A foreign process holds GPU 0 of the second host (the lab's NVML counts <pid>.mem files).
    rc, _out, err = on(
        fleet3, 1,
        "sudo systemd-run --unit=foreign-gpu --quiet sleep 600 && sleep 0.5 && "
        "echo '0 1073741824' | sudo tee /run/fleet-lab/nvml/$(systemctl show -p MainPID --value foreign-gpu).mem",
    )  # fmt: skip
    assert rc == 0, err
    text = fleet3.opts.inventory.read_text()
    fleet3.opts.inventory.write_text(text.replace("'port': 8000,", "'port': 8000, 'served_model_name': 'llama-b',"))
    before = unit_pids(fleet3)
    try:
        rc, result = deploy3(fleet3)
        assert rc == 1 and isinstance(result, dict), result
        refused = [h for h in result["hosts"] if h["status"] == "refused"]  # type: ignore[union-attr]
        assert [h["host"] for h in refused] == [fleet3.state.hosts[1].name], result
        assert "fleet-vllm-0.service: preflight gpus: GPU 0 is held by pid" in refused[0]["error"]
        assert "foreign-gpu.service" in refused[0]["error"]
        assert "--fail-percent 0" in str(result["error"])
        assert not any(h["restarted"] for h in result["hosts"])  # type: ignore[union-attr]
        assert unit_pids(fleet3) == before
    finally:
        on(fleet3, 1, "sudo systemctl stop foreign-gpu")


def test_a_changed_model_redeploys_host_by_host(fleet3: LabFleet) -> None:
    import threading
    import time
    import urllib.request

    assert "'served_model_name': 'llama-b'" in fleet3.opts.inventory.read_text()  # from the test above
    before = unit_pids(fleet3)
    plans = planned_argv(fleet3)
    addresses = {h.name: h.address for h in fleet3.state.hosts}
    ports = {
        name: [int(a[a.index("--port") + 1]) if "--port" in a else 8000 for a in argvs] for name, argvs in plans.items()
    }
    most_down, stop = [0], threading.Event()

    def up(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return int(r.status) == 200
        except OSError:
            return False

    def watch() -> None:
        while not stop.is_set():
            down = {n for n, ps in ports.items() if not all(up(f"http://{addresses[n]}:{p}") for p in ps)}
            most_down[0] = max(most_down[0], len(down))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        rc, result = deploy3(fleet3)
    finally:
        stop.set()
        watcher.join(10)
    assert rc == 0 and isinstance(result, dict), result
    for h in result["hosts"]:  # type: ignore[union-attr]
        # healthy: the rollout's gates passed, the models gate included (the instance lists llama-b)
        assert h["restarted"] and all(e["healthy"] and e["model"] == "llama-b" for e in h["endpoints"]), h
    assert most_down[0] == 1, most_down  # one host at a time went down, never two
    after = unit_pids(fleet3)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)


MISTRAL = "mistralai/Mistral-7B-Instruct-v0.3"
MISTRAL_CONFIG = REPO_ROOT / "fleet" / "data" / "models" / "mistralai" / "Mistral-7B-Instruct-v0.3" / "config.json"


def complete(address: str, port: int, model: str) -> tuple[int, str]:
    """A completion asked of one instance by model name: (HTTP status, the model it answered as)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model, "prompt": "Say hi", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://{address}:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    request.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status), str(json.loads(r.read())["model"])
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_two_models_on_one_host_deployed_and_rolled_per_model(fleet3: LabFleet) -> None:
    """Issue 23 part 5 on the l40s-4 host: its four GPUs split between Llama 3.1 8B (GPUs 0-1) and
    Mistral 7B (GPUs 2-3); a completion against each served name; a change to the Mistral entry
    restarts only its instances; a second deploy changes nothing."""
    if not unit_pids(fleet3):  # run alone (-k): the fleet is not serving yet
        rc, result = deploy3(fleet3, "--reboot")
        assert rc == 0, result
    host = fleet3.state.hosts[1]
    assert host.profile == "l40s-4", host
    mistral_hub = "/var/lib/vllm/hf/hub/models--mistralai--Mistral-7B-Instruct-v0.3"
    rc, _out, err = on(
        fleet3, 1,
        f"sudo -u vllm mkdir -p {mistral_hub}/snapshots/main {mistral_hub}/refs "
        f"&& echo main | sudo -u vllm tee {mistral_hub}/refs/main >/dev/null "
        f"&& echo {base64.b64encode(MISTRAL_CONFIG.read_bytes()).decode()} | base64 -d "
        f"| sudo -u vllm tee {mistral_hub}/snapshots/main/config.json >/dev/null",
    )  # fmt: skip
    assert rc == 0, err
    served_8b = "llama-b" if "'served_model_name': 'llama-b'" in fleet3.opts.inventory.read_text() else None
    entry_8b = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpus": 2,
        **({"served_model_name": served_8b} if served_8b else {}),
    }
    models = [entry_8b, {"model": MISTRAL, "gpus": 2}]
    original = fleet3.opts.inventory.read_text()

    def serve(models: list[dict[str, object]]) -> None:
        fleet3.opts.inventory.write_text(
            original + f"for _name, _data in lab:\n    if _name == {host.name!r}:\n"
            f"        _data.pop('model'); _data.pop('served_model_name', None); _data['models'] = {models!r}\n"
        )

    try:
        before = unit_pids(fleet3)
        serve(models)
        rc, result = deploy3(fleet3)
        assert rc == 0 and isinstance(result, dict), result
        after = unit_pids(fleet3)
        names = [f"fleet-vllm-{n}.service" for n in range(4)]
        assert sorted(u for (i, u) in after if i == 1) == names
        changed = {k for k in after if after[k] != before.get(k)}
        # the 8B entry on GPUs 0-1 renders the units it ran as a one-model host: not restarted
        assert changed == {(1, "fleet-vllm-2.service"), (1, "fleet-vllm-3.service")}, (before, after)
        mine = next(h for h in result["hosts"] if h["host"] == host.name)  # type: ignore[union-attr]
        served = {e["unit"]: e["model"] for e in mine["endpoints"]}
        first = served_8b or "meta-llama/Llama-3.1-8B-Instruct"
        assert served == {names[0]: first, names[1]: first, names[2]: MISTRAL, names[3]: MISTRAL}, mine
        for n, model in enumerate([first, first, MISTRAL, MISTRAL]):
            assert complete(host.address, 8000 + n, model) == (200, model)
        assert complete(host.address, 8000, MISTRAL)[0] == 404  # each instance serves its own model only

        # one entry changed: only its instances get new processes
        serve([entry_8b, {"model": MISTRAL, "gpus": 2, "served_model_name": "mistral-b"}])
        rc, result = deploy3(fleet3)
        assert rc == 0 and isinstance(result, dict), result
        again = unit_pids(fleet3)
        assert {k for k in again if again[k] != after[k]} == {(1, names[2]), (1, names[3])}, (after, again)
        assert complete(host.address, 8002, "mistral-b") == (200, "mistral-b")

        # and a second deploy changes nothing
        rc, result = deploy3(fleet3)
        assert rc == 0 and isinstance(result, dict), result
        assert all(h["status"] == "unchanged" and not h["restarted"] for h in result["hosts"]), result  # type: ignore[union-attr]
        assert unit_pids(fleet3) == again
    finally:
        fleet3.opts.inventory.write_text(original)
