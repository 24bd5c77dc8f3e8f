"""The PCIe ACS check: redirection on the bridges between GPUs that talk peer to peer (pure).

PCIe Access Control Services on a switch's downstream ports or on root ports can force
peer-to-peer requests up to the root complex (P2P Request/Completion Redirect, Egress Control):
GPU-to-GPU copies then crawl or hang. NCCL's troubleshooting guide ("PCI Access Control
Services (ACS)", docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html) says to
disable it, in the BIOS or with ``setpci -v -s BDF ECAP_ACS+0x6.w=0000`` per bridge; Linux offers
``pci=disable_acs_redir=`` at boot (``Documentation/admin-guide/kernel-parameters.txt``).
vLLM's custom all-reduce tests P2P itself and falls back to NCCL when the test fails
(``vllm/distributed/device_communicators/custom_all_reduce.py``, ``CustomAllreduce.__init__``,
``_can_p2p``); NCCL itself does not test, so TP across such GPUs hangs or is slow.

Which pairs count: two GPUs of a board that can do PCIe peer to peer (``GpuSku.pcie_p2p``: not
GeForce), on one host that is not a VM (inside a VM the bridges are the hypervisor's). The
bridges that matter for a pair are those on the two GPUs' paths below the point where the paths
meet (:func:`bridges_between`). A pair with no NVLink between them must go over PCIe (an
``error``: tensor parallelism across them hangs); a pair joined by NVLink uses PCIe only when
NCCL falls back (a ``warning``).
"""

from __future__ import annotations

from fleet.audit.findings import Finding, Severity
from fleet.audit.rules import host_sku
from fleet.facts.hostfacts import HostFacts
from fleet.facts.pcie_acs import AcsFacts, flags

P2P_OK = 0  #: nvml.h NVML_P2P_STATUS_OK
WAY_OUT = (
    "disable ACS in the BIOS (its PCIe 'ACS' setting, or IOMMU/VT-d off where nothing needs it), or until the "
    "next reboot as root: setpci -s BDF ECAP_ACS+6.w=0000 for each bridge named (NCCL's troubleshooting guide), "
    "or boot with pci=disable_acs_redir=BDF;...; meanwhile NCCL_P2P_DISABLE=1 sends NCCL's traffic through host "
    "memory (slower, no hang), and vLLM's custom all-reduce tests P2P itself and falls back to NCCL"
)


def bridges_between(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The bridges on two GPUs' paths below the point where the paths meet (pure)."""
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    return a[common:] + b[common:]


def rule_pcie_acs(host: str, facts: HostFacts, acs: AcsFacts | None) -> list[Finding]:
    if acs is None or not facts.ok or len(facts.gpus) < 2 or facts.passthrough:
        return []
    sku = host_sku(facts)
    if sku is not None and not sku.pcie_p2p:
        return []
    if not acs.ok:
        return [
            Finding(
                "pcie-acs-unknown",
                Severity.INFO,
                host,
                f"the ACS setting of the PCIe bridges between GPUs could not be read ({acs.status}: {acs.error})",
                way_out="let the SSH user run sudo -n (the extended PCI configuration space is root-only), "
                "or check by hand: sudo lspci -vvv | grep ACSCtl",
            )
        ]
    over_pcie: list[str] = []
    fallback_only: list[str] = []
    redirecting: dict[str, None] = {}  # ordered set
    gpus = [g for g in facts.gpus if g.bus_id in acs.gpus]
    for i, ga in enumerate(gpus):
        for gb in gpus[i + 1 :]:
            assert ga.bus_id is not None and gb.bus_id is not None
            found = [
                b
                for b in bridges_between(acs.gpus[ga.bus_id], acs.gpus[gb.bus_id])
                if b in acs.bridges and acs.bridges[b].redirects
            ]
            if not found:
                continue
            redirecting.update(dict.fromkeys(found))
            nvlink = _at(facts.p2p_nvlink, ga.index, gb.index) == P2P_OK
            (fallback_only if nvlink else over_pcie).append(f"{ga.index}-{gb.index}")
    if not redirecting:
        return []
    by_setting: dict[int, list[str]] = {}
    for b in redirecting:
        by_setting.setdefault(acs.bridges[b].ctl or 0, []).append(b)
    named = "; ".join(f"ACSCtl {flags(ctl)} on {', '.join(bdfs)}" for ctl, bdfs in by_setting.items())
    if over_pcie:
        severity = Severity.ERROR
        pairs = f"GPU pairs {_few(over_pcie)} talk over PCIe only"
    else:
        severity = Severity.WARNING
        pairs = f"GPU pairs {_few(fallback_only)} use PCIe when NCCL falls back from NVLink"
    return [
        Finding(
            "pcie-acs-redirect",
            severity,
            host,
            f"ACS redirects peer-to-peer traffic to the root complex on {len(redirecting)} PCIe bridges between "
            f"GPUs ({pairs}): {named}",
            way_out=WAY_OUT,
        )
    ]


def _at(matrix: tuple[tuple[int | None, ...], ...], i: int, j: int) -> int | None:
    try:
        return matrix[i][j]
    except IndexError:
        return None


def _few(items: list[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")
