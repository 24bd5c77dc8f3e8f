"""Reading the secret a reference points at, on the control machine (never on a host).

The one reader every command uses (deploy renders the key into a root-only env file; the rollout
and status probes send it as a bearer header). A reference that cannot be read is an error naming
the reference, never the value, and never a silently open API. A ``file:`` secret must not be
readable by others.
"""

from __future__ import annotations

import os
from pathlib import Path

from fleet.errors import FleetError
from fleet.secrets import SecretRef


class SecretError(FleetError):
    """A secret reference cannot be read (the message names the reference, never a value)."""


def read_secret(ref: SecretRef, field: str = "api_key_ref") -> str:
    """The secret a reference points at, on the control machine (``field``: the setting that names
    the reference, for the message)."""
    if ref.scheme == "env":
        value = os.environ.get(ref.target)
        if not value:
            raise SecretError(f"{field} {ref}: the environment variable {ref.target} is not set on this machine")
        return value
    path = Path(ref.target)
    try:
        mode = path.stat().st_mode
        value = path.read_text().strip()
    except OSError as exc:
        raise SecretError(f"{field} {ref}: cannot read {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise SecretError(f"{field} {ref}: {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    if not value:
        raise SecretError(f"{field} {ref}: {path} is empty")
    return value
