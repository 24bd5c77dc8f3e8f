"""What the audit reports: findings with a severity, on a host, a GPU, a link."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any


class Severity(IntEnum):
    """Ordered: ``--fail-on error`` fails on error and critical."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}; one of: {', '.join(s.label for s in cls)}") from None


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about a host."""

    rule: str  #: stable identifier, e.g. ``nvlink-down``
    severity: Severity
    host: str
    message: str
    gpu: int | None = None  #: NVML index
    link: int | None = None  #: NVLink number
    way_out: str = ""
    #: the multi-node instance it is about (``leader/vllm-N``); None: a host's own finding
    instance: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["severity"] = self.severity.label
        if self.instance is None:
            del out["instance"]  # a host's finding reads as it always did
        return out

    @property
    def where(self) -> str:
        parts = [self.host]
        if self.gpu is not None:
            parts.append(f"GPU{self.gpu}")
        if self.link is not None:
            parts.append(f"link {self.link}")
        if self.instance is not None:
            parts.append(f"instance {self.instance}")
        return " ".join(parts)


def worst(findings: list[Finding]) -> Severity | None:
    return max((f.severity for f in findings), default=None)
