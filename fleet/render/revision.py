"""Configuration revisions: an instance's rendered unit and env file, named by their content.

A serving instance's files are never rewritten under it: a crash-restart by systemd would start
the new flags outside any health gate. Instead each rendered pair is stored on the host as an
immutable revision, ``/etc/fleet/revisions/<instance>/<id>/{unit,env,revision.json}`` (root-only),
and the rolling engine puts it in place (and back, on a rollback) between the instance's stop and
its start. Like a release, the same content always has the same id, so a re-run stores nothing,
and the live files' id is computed on the host from the files themselves (``LIVE_ID_SH``), not
from a record that could drift from them.

The id is the first 16 hex digits of SHA-256 over the unit file's bytes followed by the env
file's bytes (what ``cat unit env | sha256sum`` reads), computed here and on the host alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleet.facts.revisions import ENV as ENV
from fleet.facts.revisions import ID_LENGTH as ID_LENGTH
from fleet.facts.revisions import LIVE_ID_SH as LIVE_ID_SH
from fleet.facts.revisions import META as META
from fleet.facts.revisions import ROOT as ROOT
from fleet.facts.revisions import UNIT as UNIT
from fleet.render.units import RenderedFile


def revision_id(unit: bytes, env: bytes) -> str:
    return hashlib.sha256(unit + env).hexdigest()[:ID_LENGTH]


@dataclass(frozen=True)
class Revision:
    """One instance's rendered pair of files and the model it serves."""

    instance: str  #: the instance's unit name, e.g. ``vllm-0`` (unit ``fleet-vllm-0.service``)
    unit: RenderedFile
    env: RenderedFile
    served_model: str
    #: the LoRA adapters its ``--lora-modules`` serves, recorded so a rollback back onto this
    #: revision can gate on them (None: not recorded)
    adapters: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        return revision_id(self.unit.content.encode(), self.env.content.encode())

    def directory(self, root: str = ROOT) -> str:
        return f"{root}/{self.instance}/{self.id}"

    def meta(self) -> str:
        """``revision.json``: one line (the executor reads it with the id in one round trip)."""
        meta: dict[str, object] = {"id": self.id, "instance": self.instance, "served_model": self.served_model}
        if self.adapters is not None:
            meta["adapters"] = list(self.adapters)
        return json.dumps(meta) + "\n"


def revisions_of(
    files: Sequence[RenderedFile], served_model: str | Mapping[str, str], adapters: tuple[str, ...] | None = None
) -> list[Revision]:
    """Pair each instance's unit (``fleet-<instance>.service``) with its env file (``<instance>.env``).

    ``served_model``: what every instance serves, or instance -> its served name (a host with
    ``models``: each instance its own model's)."""
    envs = {f.path.rsplit("/", 1)[1].removesuffix(".env"): f for f in files if f.path.endswith(".env")}
    out = []
    for f in files:
        name = f.path.rsplit("/", 1)[1]
        if name.startswith("fleet-") and name.endswith(".service"):
            instance = name.removeprefix("fleet-").removesuffix(".service")
            served = served_model if isinstance(served_model, str) else served_model[instance]
            out.append(Revision(instance, f, envs[instance], served, adapters))
    return out
