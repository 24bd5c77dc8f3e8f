"""The PCIe ACS check: the register walk, the probe over a sysfs tree, the fact's parse, the rule.

The sysfs trees are the lab's (``fleetlab.pcitree``) written into a temporary directory, read by
the very probe script that runs on hosts; the probe facts are recorded outputs of lab hosts
(``tests/fixtures/probe``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from fleet.audit.acs import bridges_between, rule_pcie_acs
from fleet.facts.hostfacts import HostFacts, parse_probe
from fleet.facts.pcie_acs import AcsFacts, BridgeAcs, acs_command, flags, nvml_bus_id, parse_acs_output
from fleet.facts.pcie_acs_probe import acs_registers, probe
from fleetlab.hostfiles import pci_files
from fleetlab.pcitree import ACS_CAP, DOWNSTREAM, ENDPOINT, config_space
from fleetlab.profiles import PROFILE_DIR, load_profile

FIXTURES = Path(__file__).parents[1] / "fixtures" / "probe"


def recorded(name: str) -> HostFacts:
    return parse_probe(json.loads(json.loads((FIXTURES / f"{name}.json").read_text())["output"][-1]))


def with_acs(text: str, acs: str) -> str:
    return (
        text.replace("[pcie]\n", f'[pcie]\nacs = "{acs}"\n', 1)
        if "[pcie]" in text
        else text + f'\n[pcie]\nacs = "{acs}"\n'
    )


def sysfs(tmp_path: Path, profile: str, acs: str | None = None) -> Path:
    """The lab's PCI tree of ``profile`` written under ``tmp_path``; returns its ``devices`` dir."""
    source = PROFILE_DIR / f"{profile}.toml"
    if acs is not None:
        custom = tmp_path / f"{profile}-{acs}.toml"
        text = source.read_text().replace('acs = "redirect"\n', "")
        custom.write_text(with_acs(text, acs))
        source = custom
    tree = tmp_path / "sys"
    for f in pci_files(load_profile(str(source)), tree_dir=str(tree)):
        path = tmp_path / f.path.removeprefix("/usr/lib/fleet-lab/hardware/pci/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if f.link_to is not None:
            path.symlink_to(f.link_to)
        elif isinstance(f.content, bytes):
            path.write_bytes(f.content)
        else:
            path.write_text(f.content)
    return tmp_path / "devices"


def acs_facts(tmp_path: Path, profile: str, acs: str | None = None) -> AcsFacts:
    answer = probe(str(sysfs(tmp_path, profile, acs)))
    return parse_acs_output(["", json.dumps(answer)])


# ---- the register walk ----------------------------------------------------------------------------


def aer_then_acs(ctl: int) -> bytes:
    return config_space(0x1000, 0xC030, 0x060400, DOWNSTREAM, (1, 2, 2), ctl)


def looping() -> bytes:
    space = bytearray(4096)
    struct.pack_into("<I", space, 0x100, 0x0001 | (1 << 16) | (0x100 << 20))  # next points at itself
    return bytes(space)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (aer_then_acs(0x001D), {"cap": ACS_CAP, "ctl": 0x001D}),  # found after AER, through "next"
        (aer_then_acs(0), {"cap": ACS_CAP, "ctl": 0}),
        (config_space(0x10DE, 0x2331, 0x030200, ENDPOINT), {"cap": None, "ctl": None}),  # no extended caps
        (looping(), {"cap": None, "ctl": None}),
        (b"\xff" * 4096, {"cap": None, "ctl": None}),  # a function that answers all ones
        (bytes(64), {"error": "64 bytes of configuration space (the extended space needs root)"}),
    ],
)
def test_acs_registers(config: bytes, expected: dict[str, Any]) -> None:
    assert acs_registers(config) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0x001D, "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"),
        (0, "SrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-"),
    ],
)
def test_flags_spelled_as_lspci(value: int, text: str) -> None:
    assert flags(value) == text


@pytest.mark.parametrize(
    ("ctl", "redirects"),
    [(0, False), (0x01, False), (0x10, False), (0x04, True), (0x08, True), (0x20, True), (None, False)],
)
def test_redirect_bits(ctl: int | None, redirects: bool) -> None:
    assert BridgeAcs("0000:00:01.0", ACS_CAP if ctl is not None else None, ctl).redirects is redirects


# ---- the probe over the lab's sysfs tree ------------------------------------------------------------


def test_the_probe_reads_each_gpu_path_and_its_bridges(tmp_path: Path) -> None:
    facts = acs_facts(tmp_path, "h100-pcie-8-bridged-acs")
    assert facts.ok
    profile = load_profile("h100-pcie-8-bridged-acs")
    assert set(facts.gpus) == {g.bus_id.nvml for g in profile.slots}
    path = facts.gpus["00000000:1B:00.0"]
    assert path == ("0000:00:01.0", "0000:19:00.0", "0000:1a:00.0")  # root port, switch up, switch down
    assert [facts.bridges[b].redirects for b in path] == [True, False, True]
    assert facts.bridges["0000:19:00.0"].cap is None  # an upstream port has no ACS capability here


def test_switch_groups_share_a_switch(tmp_path: Path) -> None:
    facts = acs_facts(tmp_path, "a100-sxm-8", "redirect")
    a, b = (
        facts.gpus[recorded("a100-sxm-8").gpus[0].bus_id or ""],
        facts.gpus[recorded("a100-sxm-8").gpus[1].bus_id or ""],
    )
    assert a[:2] == b[:2] and a[2] != b[2]  # one root port and switch, two downstream ports
    assert bridges_between(a, b) == (a[2], b[2])


def test_a_missing_sysfs_answers_in_the_protocol(tmp_path: Path) -> None:
    assert parse_acs_output([json.dumps(probe(str(tmp_path / "nothing")))]).status == "no-sysfs"


# ---- the fact's parse ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "status"),
    [
        ("not json", "bad-output"),
        ('{"status": "weird"}', "bad-output"),
        ('{"schema": 1, "status": "no-root", "error": "sudo -n refused"}', "no-root"),
        ('{"schema": 1, "status": "ok", "gpus": {"0000:18:00.0": ["0000:00:01.0"]}, "bridges": {}}', "bad-output"),
        (
            '{"schema": 1, "status": "ok", "gpus": {}, "bridges": {"0000:00:01.0": {"cap": 1, "ctl": 70000}}}',
            "bad-output",
        ),
        ('{"schema": 1, "status": "ok", "gpus": {"0000:18:00.0": []}, "bridges": {}}', "ok"),
    ],
)
def test_parse_acs_output(line: str, status: str) -> None:
    assert parse_acs_output(["", line]).status == status


def test_bus_ids_are_spelled_as_nvml_does() -> None:
    assert nvml_bus_id("0000:1b:00.0") == "00000000:1B:00.0"


def test_the_command_runs_as_root_or_says_why_not() -> None:
    command = acs_command()
    assert "sudo -n true" in command and '"no-root"' in command and "python3 -I -" in command


# ---- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "profile", "acs", "expected"),
    [
        ("h100-pcie-8-bridged", "h100-pcie-8-bridged-acs", None, ("pcie-acs-redirect", "error")),  # pairs over PCIe
        ("h100-pcie-8-bridged", "h100-pcie-8-bridged", None, None),  # ACS off
        ("h100-sxm-8", "h100-sxm-8", "redirect", ("pcie-acs-redirect", "warning")),  # NVSwitch: fallback only
        ("a100-sxm-8", "a100-sxm-8", "redirect", ("pcie-acs-redirect", "warning")),
        ("l40s-4", "l40s-4", "redirect", ("pcie-acs-redirect", "error")),  # PCIe only
        ("l40s-4", "l40s-4", "off", None),
        ("rtx4090-2", "rtx4090-2", "redirect", None),  # GeForce: no PCIe peer-to-peer at all
        ("a10-1", "a10-1", "redirect", None),  # one GPU
        ("h100-sxm-1-passthrough", "h100-sxm-1-passthrough", "redirect", None),
    ],
)
def test_rule(tmp_path: Path, fixture: str, profile: str, acs: str | None, expected: tuple[str, str] | None) -> None:
    findings = rule_pcie_acs("h", recorded(fixture), acs_facts(tmp_path, profile, acs))
    assert [(f.rule, f.severity.label) for f in findings] == ([expected] if expected else [])
    if expected:
        (finding,) = findings
        assert "ReqRedir+ CmpltRedir+" in finding.message and "setpci -s BDF ECAP_ACS+6.w=0000" in finding.way_out


def test_the_finding_names_the_bridges_and_pairs(tmp_path: Path) -> None:
    (finding,) = rule_pcie_acs(
        "gpu-07", recorded("h100-pcie-8-bridged"), acs_facts(tmp_path, "h100-pcie-8-bridged-acs")
    )
    assert (
        "ACSCtl SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans- on 0000:00:01.0, "
        in (finding.message)
    )
    assert finding.message.count("0000:") == 16  # every root port and downstream port, each once
    assert (
        "GPU pairs 0-1, 0-2, 0-3, 0-4, 0-6, 0-7 and 18 more talk over PCIe only" in finding.message
    )  # not 0-5: NVLink


@pytest.mark.parametrize("status", ["no-root", "no-python", "bad-output"])
def test_an_unreadable_acs_is_said_not_guessed(status: str) -> None:
    (finding,) = rule_pcie_acs("h", recorded("l40s-4"), AcsFacts(status, "why", {}, {}))
    assert (finding.rule, finding.severity.label) == ("pcie-acs-unknown", "info")
    assert "sudo lspci -vvv | grep ACSCtl" in finding.way_out


@pytest.mark.parametrize(
    ("a", "b", "between"),
    [
        (("r", "u", "d1"), ("r", "u", "d2"), ("d1", "d2")),
        (("r1", "u1", "d1"), ("r2", "u2", "d2"), ("r1", "u1", "d1", "r2", "u2", "d2")),
        ((), (), ()),
    ],
)
def test_bridges_between(a: tuple[str, ...], b: tuple[str, ...], between: tuple[str, ...]) -> None:
    assert bridges_between(a, b) == between
