"""The audit as a gate (pure): which findings refuse ``fleet deploy`` or a rollout onto a host.

A **critical** finding refuses the host, and so does a quarantined GPU (``gpu-quarantined``)
that an instance is planned on; the operator may override a finding by its rule name
(``--ignore-finding NAME``: the command names it in its refusal, and a rollout records the
override in its journal). Findings the deploy itself fixes never refuse a deploy: no NVML library
or driver loaded yet (the deploy installs it), a driver waiting for its reboot (NVML's
``LIB_RM_VERSION_MISMATCH``: the user-space library is newer than the loaded kernel module,
which the deploy's reboot step loads), and a CUDA driver too old where the plan installs
cuda-compat. A host that cannot be reached is not judged here: the command reports it itself.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from fleet.audit.findings import Finding, Severity

#: Critical findings ``fleet deploy`` fixes itself (never refuse a deploy; they do refuse a rollout,
#: which installs no driver).
DEPLOY_FIXES = frozenset({"nvml-library-missing", "driver-not-loaded", "driver-mismatch"})
#: Fixed by a deploy whose plan installs cuda-compat on the host.
COMPAT_FIXES = frozenset({"cuda-driver-too-old"})
#: Findings the gate leaves to the command (it reports an unreachable host as a failed host).
NOT_GATED = frozenset({"host-unreachable"})
#: A rule name as ``--ignore-finding`` takes it.
RULE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{1,62}")
DEPLOY, ROLLOUT = "deploy", "rollout"


@dataclass(frozen=True)
class GateVerdict:
    refusing: tuple[Finding, ...] = ()  #: findings that refuse their hosts
    overridden: tuple[Finding, ...] = ()  #: findings that would, let through by ``--ignore-finding``
    refused_hosts: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.refusing

    def message(self, command: str) -> str:
        """Why ``command`` refuses, one line per finding with its way out and the override."""
        lines = [f"{command}: refused by the audit before touching any host ({len(self.refusing)} finding(s)):"]
        for f in self.refusing:
            way = f"; {f.way_out}" if f.way_out else ""
            lines.append(f"  {f.where}: {f.rule} ({f.severity.label}): {f.message}{way}")
        names = sorted({f.rule for f in self.refusing})
        lines.append(
            "fix it, leave the host out with --limit, or override (at your risk; a rollout journals it): "
            + " ".join(f"--ignore-finding {n}" for n in names)
        )
        return "\n".join(lines)


def refuses(finding: Finding, command: str, planned_gpus: Collection[int] | None, compat: bool) -> bool:
    """Whether ``finding`` refuses ``command`` (``deploy`` or ``rollout``) on its host (pure).

    ``planned_gpus``: the GPUs the host's instances are planned on (None: not known, every GPU
    counts); ``compat``: the plan installs cuda-compat on the host."""
    if finding.rule in NOT_GATED:
        return False
    if command == DEPLOY and (finding.rule in DEPLOY_FIXES or (compat and finding.rule in COMPAT_FIXES)):
        return False
    if finding.rule == "gpu-quarantined":
        return planned_gpus is None or finding.gpu in planned_gpus
    return finding.severity >= Severity.CRITICAL


def gate(
    findings: Iterable[Finding],
    command: str,
    ignored: Collection[str] = (),
    planned_gpus: Mapping[str, Collection[int]] | None = None,
    compat: Collection[str] = (),
) -> GateVerdict:
    """The findings that refuse ``command``, and those ``ignored`` (rule names) lets through (pure).

    ``planned_gpus``: host -> the GPUs its instances are planned on (a host not in it: not known);
    ``compat``: the hosts whose plan installs cuda-compat."""
    refusing: list[Finding] = []
    overridden: list[Finding] = []
    for f in findings:
        if not refuses(f, command, (planned_gpus or {}).get(f.host), f.host in compat):
            continue
        (overridden if f.rule in ignored else refusing).append(f)
    hosts = tuple(dict.fromkeys(f.host for f in refusing))
    return GateVerdict(tuple(refusing), tuple(overridden), hosts)


def check_ignored(names: Iterable[str]) -> list[str]:
    """``--ignore-finding`` values, checked: a bad name is a ``ValueError`` naming it."""
    out = []
    for name in names:
        if not RULE_NAME.fullmatch(name):
            raise ValueError(
                f"--ignore-finding {name!r}: not a finding's rule name (like driver-mismatch or gpu-quarantined; "
                "`fleet audit` shows each finding's rule)"
            )
        out.append(name)
    return out
