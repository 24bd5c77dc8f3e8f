"""What a host's Hugging Face cache holds: one root listing, read by ``fleet prune`` and ``fleet status``.

A host's units read models from the Hugging Face cache ``<HF_HOME>/hub/models--ORG--NAME/``
(``huggingface_hub``'s ``repo_folder_name``: the id's ``/`` become ``--``; the way back is
``scan_cache_dir``'s, ``huggingface_hub/utils/_cache_manager.py`` ``_scan_cached_repo``: split the
folder name once at ``--``, then the remaining ``--`` become ``/``). The units' ``HF_HOME`` is
``<state_dir>/hf`` (``templates/vllm.service.j2``).

The listing (:data:`LIST_SCRIPT`, one root command, the host's ``python3``, Python 3.6) walks only
the cache's metadata (``lstat`` of each file, reading no file's contents) and returns per
repository its folder, bytes (each inode once; symbolic links not followed), whether a copy is
being staged into it (its ``.fleet-incoming`` directory exists) and the revision its snapshot
``refs/main`` names (``huggingface_hub``'s cache layout: ``refs/<branch>`` holds the commit
hash the snapshot folder is named after). Given a revisions root and a unit directory it also
returns every model-id-like word of the fleet unit files and stored revisions there (a word with
one ``/``, split at blanks, ``=``, ``,`` and quotes), which ``fleet prune`` keeps; ``fleet
status`` passes neither and skips that part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.output import answer_line
from fleet.facts.revisions import ROOT as REVISIONS_ROOT

UNIT_DIR = "/etc/systemd/system"
#: The units' state directory (the service user's home); ``HF_HOME`` is ``<it>/hf``.
STATE_DIR = "/var/lib/vllm"
_END = "FLEET_HUB_LISTING_EOF"

LIST_SCRIPT = r"""
import json, os, re, sys
hub, revisions, units = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"repos": [], "named": []}
try:
    names = sorted(os.listdir(hub))
except OSError:
    names = []
for name in names:
    top = os.path.join(hub, name)
    if not name.startswith("models--") or os.path.islink(top) or not os.path.isdir(top):
        continue
    size, seen = 0, set()
    for d, dirs, files in os.walk(top):
        for f in files:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if st.st_ino not in seen and not os.path.islink(os.path.join(d, f)):
                seen.add(st.st_ino)
                size += st.st_size
    snapshot = None
    try:
        with open(os.path.join(top, "refs", "main")) as f:
            snapshot = f.read(256).strip() or None
    except (IOError, OSError):
        pass
    out["repos"].append([name, size, os.path.isdir(os.path.join(top, ".fleet-incoming")), snapshot])
texts = []
if revisions:
    for d, dirs, files in os.walk(revisions):
        texts += [os.path.join(d, f) for f in files if f in ("unit", "env")]
if units:
    try:
        texts += [os.path.join(units, f) for f in os.listdir(units)
                  if f.startswith("fleet-") and f.endswith(".service")]
    except OSError:
        pass
named = set()
for path in texts:
    try:
        with open(path, errors="replace") as f:
            text = f.read(1 << 20)
    except (IOError, OSError):
        continue
    for word in re.split(r"[\s=,\"'\\{}:]+", text):
        if word.count("/") == 1 and not word.startswith("/") and not word.endswith("/"):
            named.add(word)
out["named"] = sorted(named)
print(json.dumps(out))
"""


def hub_dir(state_dir: str = STATE_DIR) -> str:
    """The units' Hugging Face cache: ``HF_HOME`` is ``<state_dir>/hf`` (``templates/vllm.service.j2``)."""
    return f"{state_dir}/hf/hub"


def folder_of(model: str) -> str:
    """The cache folder of a model id: ``huggingface_hub``'s ``repo_folder_name``."""
    return "--".join(["models", *model.split("/")])


def model_of(folder: str) -> str:
    """The model id of a cache folder (``models--ORG--NAME`` → ``ORG/NAME``): ``huggingface_hub``'s
    ``_scan_cached_repo``; the inverse of :func:`folder_of`. A name without ``--`` as it is."""
    _kind, sep, rest = folder.partition("--")
    return rest.replace("--", "/") if sep else folder


@dataclass(frozen=True)
class HubRepo:
    folder: str  #: ``models--ORG--NAME``
    bytes: int
    staging: bool  #: a copy is being written into it (``.fleet-incoming`` exists)
    snapshot: str | None = None  #: what its ``refs/main`` names (None: no such file)

    @property
    def model(self) -> str:
        return model_of(self.folder)


@dataclass(frozen=True)
class HubListing:
    """What one host's cache holds and the model ids its kept unit and env files name."""

    repos: tuple[HubRepo, ...]
    named: frozenset[str]


def parse_listing(text: str) -> HubListing:
    try:
        raw = json.loads(text)
        repos = tuple(
            HubRepo(str(r[0]), int(r[1]), bool(r[2]), None if len(r) < 4 or r[3] is None else str(r[3]))
            for r in raw["repos"]
        )
        return HubListing(repos, frozenset(str(w) for w in raw["named"]))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise FleetError(f"hub listing: unreadable answer {text[-200:]!r} ({exc})") from exc


def listing_command(
    hub: str, revisions: str = REVISIONS_ROOT, units: str = UNIT_DIR, errors_to_stdout: bool = False
) -> str:
    """The listing as root (``sudo -n``: never a prompt); ``revisions`` and ``units`` empty: the
    model ids they name are not read; ``errors_to_stdout``: its error output (``sudo``'s refusal)
    goes where its answer goes. Ends with a newline (a here-document)."""
    argv = ["sudo", "-n", "--", "python3", "-", hub, revisions, units]
    merge = " 2>&1" if errors_to_stdout else ""
    return f"cd / && {ssh_command(argv)}{merge} <<'{_END}'\n{LIST_SCRIPT}\n{_END}\n"


class HubModels(FactBase[HubListing]):
    """
    The model repositories in a host's Hugging Face cache (folder, bytes, being staged, the
    snapshot ``refs/main`` names) and the model ids its fleet unit files and stored configuration
    revisions name.

    + hub: ``<HF_HOME>/hub``
    """

    def command(self, hub: str) -> str:
        return listing_command(hub)

    def process(self, output: list[str]) -> HubListing:
        return parse_listing(answer_line(output))
