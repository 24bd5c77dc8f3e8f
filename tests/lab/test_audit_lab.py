"""``fleet audit`` against lab hosts of every profile, healthy and faulty, through the real CLI.

One lab with one host per shipped profile (plus one whose NVML refuses to initialise with
LIB_RM_VERSION_MISMATCH). Nothing of fleet's is installed on the hosts (no release venv, no
nvidia-ml-py): the probe runs on each host's python3 with the pynvml it carries, as on machines
fleet has not deployed yet. The audit runs as a subprocess (``python -m fleet.cli audit``):
every fault is found with the right severity on the right host, GPU and link; healthy profiles
give no findings; a VM profile gives the VM finding only. The HTML report is rendered in a real
headless Chromium and the screenshot is checked for the drawn links by their colours.
"""

from __future__ import annotations

import json
import os
import pprint
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleet.audit.report import LINK_DOWN, LINK_OK
from fleet.facts.nvml import carried_pynvml
from fleet.facts.runner import SshTarget, run_command, targets_from_inventory
from fleet.inventory.load import load_pyinfra_inventory
from fleetlab import lab as lab_ops
from fleetlab.nvml import SOURCE as NVML_SOURCE
from fleetlab.profiles import PROFILE_DIR, list_profiles, load_profile
from tests.lab.conftest import TEST_OCTET, bring_up, free_octet, require_lab, test_lab_options

RM_MISMATCH = "h100-sxm-8-rm-mismatch"
#: Whether the lab's NVML library answers every query the probe makes (as a 580 driver does);
#: until it does, each host also gets the (correct) ``nvml-function-missing`` warning.
LIBRARY_COMPLETE = "nvmlDeviceGetBoardPartNumber" in NVML_SOURCE.read_text()

Key = tuple[str, str, int | None, int | None]
# profile -> findings (rule, severity, gpu, link); fleet rules compare the H100 SXM hosts
EXPECTED: dict[str, set[Key]] = {
    "h100-sxm-8": set(),
    "a100-sxm-8": set(),
    "l40s-4": set(),
    "a10-1": set(),
    "h100-pcie-8-bridged": set(),
    # ACS left on by the BIOS: peer-to-peer between GPUs of different bridged pairs is redirected
    "h100-pcie-8-bridged-acs": {("pcie-acs-redirect", "error", None, None)},
    # the profile is a workstation with persistence mode off (the driver's default)
    "rtx4090-2": {("persistence-off", "warning", 0, None), ("persistence-off", "warning", 1, None)},
    "h100-sxm-8-link-down": {("nvlink-down", "error", 3, 7), ("fleet-topology", "warning", None, None)},
    "h100-sxm-8-gpu-missing": {
        ("gpu-missing", "critical", None, None),
        ("fleet-gpu-count", "warning", None, None),
        ("fleet-topology", "warning", None, None),
    },
    "h100-sxm-8-pcie-degraded": {("pcie-width-degraded", "error", 2, None), ("pcie-gen-degraded", "error", 2, None)},
    "h100-sxm-8-driver-mismatch": {("driver-mismatch", "critical", None, None)},
    # a VM image with driver 570 (CUDA 12.8) under vLLM 0.33's CUDA 13.0: the way out names cuda-compat
    "h100-sxm-1-passthrough-driver-570": {
        ("nvlink-not-visible-vm", "info", 0, None),
        ("cuda-driver-too-old", "critical", None, None),
    },
    "a100-sxm-8-ecc-errors": {("ecc-uncorrected", "error", 4, None), ("row-remap-pending", "error", 4, None)},
    RM_MISMATCH: {("driver-mismatch", "critical", None, None)},
}


def expected_for(profile: str) -> set[Key]:
    if profile in EXPECTED:
        return EXPECTED[profile]
    if "passthrough" in profile:  # one GPU passed through to a VM: NVLink invisible, reported as such
        return {("nvlink-not-visible-vm", "info", 0, None)}
    raise AssertionError(f"lab profile {profile} has no expectation in this test: add one")


@dataclass
class AuditLab:
    root: Path
    inventory: Path
    profiles: dict[str, str]  #: host name -> profile name
    targets: dict[str, SshTarget]


def _rm_mismatch_profile(root: Path) -> Path:
    text = (PROFILE_DIR / "h100-sxm-8-driver-mismatch.toml").read_text()
    text = text.replace("[driver]\n", "[driver]\nfail_init_on_mismatch = true\n", 1)
    path = root / f"{RM_MISMATCH}.toml"
    path.write_text(text)
    return path


def _write_audit_inventory(lab_inventory: Path, out: Path, profiles: dict[str, str]) -> None:
    """The lab's inventory plus what an operator declares: each host's GPU model and count."""
    inv = load_pyinfra_inventory(lab_inventory)
    hosts = []
    for host in inv:
        data = host.data.dict()
        profile = load_profile(str(_profile_path(profiles[host.name], out.parent)))
        data["gpu"] = {"sku": profile.sku.key, "count": len(profile.slots)}
        hosts.append((host.name, data))
    out.write_text("lab = " + pprint.pformat(hosts, width=100, sort_dicts=False) + "\n")


def _profile_path(profile: str, root: Path) -> Path:
    return root / f"{profile}.toml" if profile == RM_MISMATCH else PROFILE_DIR / f"{profile}.toml"


@pytest.fixture(scope="module")
def audit_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuditLab]:
    require_lab()
    root = tmp_path_factory.mktemp("auditlab")
    names = [*list_profiles(), RM_MISMATCH]
    specs = [str(_rm_mismatch_profile(root)) if n == RM_MISMATCH else n for n in names]
    octet = free_octet(os.getpid() + 11, avoid=frozenset({TEST_OCTET}))
    opts = test_lab_options(root, f"pa{os.getpid()}", octet, len(specs), tuple(specs))
    try:
        result = bring_up(opts)
        profiles = {h.name: names[i] for i, h in enumerate(result.state.hosts)}
        inv = load_pyinfra_inventory(opts.inventory)
        targets = {t.name: t for t in targets_from_inventory(inv)}
        audit_inventory = root / "audit_inventory.py"
        _write_audit_inventory(opts.inventory, audit_inventory, profiles)
        yield AuditLab(root, audit_inventory, profiles, targets)
    finally:
        lab_ops.down(opts.name, opts.state_root)


def fleet_audit(lab: AuditLab, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet.cli", "audit", str(lab.inventory), *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.lab
def test_plan_uses_probed_facts_and_offline_the_inventory(audit_lab: AuditLab) -> None:
    """The GPU-missing host: the inventory says 8 GPUs, the probe finds 7; the plan follows the probe."""
    host = next(h for h, p in audit_lab.profiles.items() if p == "h100-sxm-8-gpu-missing")

    def plan(*extra: str) -> dict[str, Any]:
        run = subprocess.run(
            [sys.executable, "-m", "fleet.cli", "plan", str(audit_lab.inventory), "--limit", host, "--json", *extra],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        out: dict[str, Any] = json.loads(run.stdout)
        return out

    probed, offline = plan(), plan("--offline")
    (p,), (o,) = probed["hosts"], offline["hosts"]
    assert p["gpus_source"] == "probe" and probed["not_probed"] == {}
    assert o["gpus_source"].startswith("catalogue:h100-sxm-80gb")
    used = {g for i in p["instances"] for g in i["gpus"]} | set(p["idle_gpus"])
    assert used == set(range(7))
    assert 7 in {g for i in o["instances"] for g in i["gpus"]} | set(o["idle_gpus"])


def keys(findings: list[dict[str, Any]]) -> set[Key]:
    return {(f["rule"], f["severity"], f["gpu"], f["link"]) for f in findings}


@pytest.mark.lab
def test_every_profile_audited(audit_lab: AuditLab) -> None:
    html = audit_lab.root / "report.html"
    run = fleet_audit(audit_lab, "--json", "--html", str(html))
    assert run.returncode == 1, run.stderr  # faults at error and above
    report = json.loads(run.stdout)
    by_host = {h["host"]: h for h in report["hosts"]}
    assert set(by_host) == set(audit_lab.profiles)
    for host, profile in audit_lab.profiles.items():
        h = by_host[host]
        assert h["reachable"], (host, h["error"])
        # the host's python3 (no nvidia-ml-py there), through the pynvml the probe carries
        assert h["python"] == "/usr/bin/python3" and h["pynvml"] == carried_pynvml().origin, (host, h["status"])
        got = keys(h["findings"])
        missing_functions = {k for k in got if k[0] == "nvml-function-missing"}
        if not LIBRARY_COMPLETE and h["status"] == "ok":
            assert missing_functions == {("nvml-function-missing", "warning", None, None)}, (profile, got)
        got -= missing_functions
        want = expected_for(profile)
        if profile == "h100-sxm-8-pcie-degraded" and ("pcie-gen-degraded", "error", 2, None) not in got:
            # an idle GPU may lower its link generation: then only the width (which idle does not change) counts
            want = want - {("pcie-gen-degraded", "error", 2, None)}
        assert got == want, f"{host} ({profile})"
        if profile == "h100-sxm-8":
            assert h["topology"] == "8xNV18" and h["matrix"][0][1] == "NV18"
    assert report["summary"]["unreachable"] == 0
    assert html.read_text().count("<svg") == sum(1 for h in report["hosts"] if h.get("gpus"))


@pytest.mark.lab
def test_healthy_host_exit_code_and_tables(audit_lab: AuditLab) -> None:
    host = next(h for h, p in audit_lab.profiles.items() if p == "h100-sxm-8")
    run = fleet_audit(audit_lab, "--limit", host, *(("--fail-on", "error") if LIBRARY_COMPLETE else ()))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "fleet summary" in run.stdout and "8xNV18" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr


@pytest.mark.lab
def test_memory_held_by_a_foreign_process(audit_lab: AuditLab) -> None:
    """A real process on the host holding 3 GiB on GPU0 (through the lab library's live state)."""
    host = next(h for h, p in audit_lab.profiles.items() if p == "a10-1")
    target = audit_lab.targets[host]
    start = 'nohup sleep 300 >/dev/null 2>&1 & pid=$!; echo "0 3221225472" > /run/fleet-lab/nvml/$pid.mem; echo $pid'
    rc, out, err = run_command(target, start)
    assert rc == 0, err
    pid = int(out.split()[-1])
    try:
        run = fleet_audit(audit_lab, "--limit", host, "--json", "--fail-on", "warning")
        assert run.returncode == 1, run.stderr
        (h,) = json.loads(run.stdout)["hosts"]
        foreign = [f for f in h["findings"] if f["rule"] == "foreign-process"]
        assert [(f["severity"], f["gpu"]) for f in foreign] == [("warning", 0)]
        assert f"pid {pid} (sleep" in foreign[0]["message"] and "3.0 GiB" in foreign[0]["message"]
        assert h["gpus"][0]["memory_free"] <= h["gpus"][0]["memory_total"] - 3 * 2**30
    finally:
        run_command(target, f"kill {pid}; rm -f /run/fleet-lab/nvml/{pid}.mem")


@pytest.mark.lab
def test_unknown_host_key_is_refused(audit_lab: AuditLab) -> None:
    bad = audit_lab.root / "empty_known_hosts"
    bad.write_text("")
    text = audit_lab.inventory.read_text()
    inventory = audit_lab.root / "bad_keys.py"
    original = next(iter(audit_lab.targets.values())).known_hosts
    assert original
    inventory.write_text(text.replace(original, str(bad)))
    host = next(iter(audit_lab.profiles))
    run = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "audit", str(inventory), "--limit", host, "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 1
    (h,) = json.loads(run.stdout)["hosts"]
    assert not h["reachable"] and "not in" in h["error"]
    assert keys(h["findings"]) == {("host-unreachable", "critical", None, None)}


# ---- the HTML in a real browser ----------------------------------------------------------------------


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("FLEET_LAB_REQUIRED") == "1":
        pytest.fail("chromium is not installed (scripts/install.sh installs it)")
    pytest.skip("chromium is not installed")


def screenshot(html: Path, png: Path) -> None:
    subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,900",
         f"--screenshot={png}", html.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip


def png_pixels(path: Path) -> list[tuple[int, int, int]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into RGB pixels."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _c, _f, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    prev = bytearray(stride)
    pixels = []
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b = prev[x]
            c = prev[x - channels] if x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        pixels += [(line[i], line[i + 1], line[i + 2]) for i in range(0, stride, channels)]
        prev = line
    return pixels


def count_colour(pixels: list[tuple[int, int, int]], hex_colour: str, tolerance: int = 12) -> int:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return sum(
        1 for p in pixels if abs(p[0] - r) <= tolerance and abs(p[1] - g) <= tolerance and abs(p[2] - b) <= tolerance
    )


@pytest.mark.lab
@pytest.mark.parametrize(
    ("profile", "green", "red"),
    [("h100-sxm-8-link-down", True, True), ("h100-sxm-8", True, False), ("l40s-4", False, False)],
)
def test_html_topology_in_a_real_browser(audit_lab: AuditLab, profile: str, green: bool, red: bool) -> None:
    host = next(h for h, p in audit_lab.profiles.items() if p == profile)
    html = audit_lab.root / f"{profile}.html"
    png = audit_lab.root / f"{profile}.png"
    run = fleet_audit(audit_lab, "--limit", host, "--html", str(html))
    assert html.is_file(), run.stderr
    screenshot(html, png)
    pixels = png_pixels(png)
    # healthy NVLinks are drawn green, inactive ones red (and the failing GPU outlined red)
    assert (count_colour(pixels, LINK_OK) > 500) is green
    assert (count_colour(pixels, LINK_DOWN) > 100) is red
