"""A lab's state directory: which hosts it has, their addresses, keys and known_hosts.

Layout of ``<state root>/<lab name>/`` (default state root ``/var/lib/fleet-lab``)::

    lab.json              the lab: name, address octet, ssh port, hosts, the inventory it wrote
    id_ed25519(.pub)      the control key pair (the lab's login key for user ``fleet``)
    known_hosts           every host's ed25519 host key, for strict host-key checking
    hosts/<host>/         one host: overlay layers, host key, console log, nspawn pid (machine.py)

``lab.json`` holds what ``up`` decided; what is running is asked of the kernel each time.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleet.localfs import atomic_write
from fleetlab.errors import LabError

DEFAULT_STATE_ROOT = Path(os.environ.get("FLEET_LAB_STATE", "/var/lib/fleet-lab"))
DEFAULT_LAB_NAME = "lab"
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
#: Hosts get ``127.0.<octet>.<FIRST_HOST_OCTET + index>`` (index from 1).
FIRST_HOST_OCTET = 10
MAX_HOSTS = 240
OCTET_RANGE = range(10, 251)


def validate_lab_name(name: str) -> str:
    """Lab names become host names and directory names: lower-case letters, digits, dashes."""
    if not NAME_RE.match(name):
        raise LabError(
            f"lab name {name!r} is not valid: use 1-24 lower-case letters, digits and dashes, starting with a letter"
        )
    return name


def host_address(octet: int, index: int) -> str:
    """The loopback address of host ``index`` (1-based) of the lab with address octet ``octet``."""
    if not 1 <= index <= MAX_HOSTS:
        raise LabError(f"a lab has 1 to {MAX_HOSTS} hosts, not {index}")
    return f"127.0.{octet}.{FIRST_HOST_OCTET + index}"


def host_name(lab: str, index: int) -> str:
    """The name of host ``index``: its inventory name, hostname and nspawn machine name."""
    return f"{lab}-h{index}"


@dataclass
class HostRecord:
    """One host as ``up`` decided it."""

    name: str
    index: int
    address: str
    profile: str
    #: A bare host has its GPUs but no driver: no NVML library until the driver package is installed.
    bare: bool = False


@dataclass
class LabState:
    """What ``lab.json`` records."""

    name: str
    octet: int
    ssh_port: int = 22
    hosts: list[HostRecord] = field(default_factory=list)
    inventory: str | None = None
    base: str | None = None
    #: The air gap (``airgap.py``): the ``address:port`` endpoints hosts may reach; None: no air gap.
    air_gap: list[str] | None = None
    #: The lab's load balancer (``fleet lab up --lb``, ``balancer.py``): its URL; None: none.
    lb: str | None = None
    #: The real engine (``fleet lab up --engine real``, ``real_engine.py``): ``version``, ``lock``,
    #: ``model``, ``model_source`` the inventory is written with; None: the stand-in.
    real_engine: dict[str, str] | None = None

    def host(self, name: str) -> HostRecord | None:
        """The host called ``name``, if the lab has it."""
        return next((h for h in self.hosts if h.name == name), None)


class LabDir:
    """Paths inside one lab's state directory, and reading/writing ``lab.json``."""

    def __init__(self, name: str, state_root: Path = DEFAULT_STATE_ROOT) -> None:
        self.name = validate_lab_name(name)
        self.state_root = state_root
        self.root = state_root / name

    @property
    def state_file(self) -> Path:
        return self.root / "lab.json"

    @property
    def control_key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    def host_dir(self, host: str) -> Path:
        return self.root / "hosts" / host

    def exists(self) -> bool:
        return self.state_file.is_file()

    def load(self) -> LabState | None:
        """The recorded state, or None if this lab was never brought up (or was taken down)."""
        if not self.state_file.is_file():
            return None
        try:
            raw = json.loads(self.state_file.read_text())
            hosts = [HostRecord(**h) for h in raw.pop("hosts", [])]
            return LabState(hosts=hosts, **raw)
        except (ValueError, TypeError) as exc:
            raise LabError(
                f"{self.state_file} is damaged ({exc}); run `fleet lab down --name {self.name}` to remove the lab"
            ) from exc

    def save(self, state: LabState) -> None:
        """Write ``lab.json`` atomically (a reader never sees half of it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_file, json.dumps(asdict(state), indent=2) + "\n")


def octets_in_use(state_root: Path, except_lab: str | None = None) -> set[int]:
    """Address octets of the other labs recorded under ``state_root``."""
    used: set[int] = set()
    for f in state_root.glob("*/lab.json"):
        if f.parent.name == except_lab:
            continue
        try:
            used.add(int(json.loads(f.read_text())["octet"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return used


def choose_octet(state_root: Path, lab: str) -> int:
    """The lowest address octet no other lab under ``state_root`` uses."""
    used = octets_in_use(state_root, except_lab=lab)
    for octet in OCTET_RANGE:
        if octet not in used:
            return octet
    raise LabError(f"every address octet {OCTET_RANGE.start}-{OCTET_RANGE.stop - 1} is used by a lab; take one down")
