"""Alert thresholds of every host of a loaded inventory (``alerts``; its grammar and defaults:
``fleet.inventory.alerts``, where the inventory's validation parses it with every other key)."""

from __future__ import annotations

from typing import Any

from fleet.errors import FieldProblem, InventoryError
from fleet.inventory.alerts import Thresholds as Thresholds
from fleet.inventory.alerts import duration_seconds as duration_seconds
from fleet.inventory.alerts import is_duration as is_duration
from fleet.inventory.alerts import parse_thresholds
from fleet.inventory.spec import LoadedInventory


def host_data(inventory: LoadedInventory, host: str) -> dict[str, Any]:
    """A host's merged inventory data (host beats group), as pyinfra resolves it."""
    data: dict[str, Any] = inventory.pyinfra.get_host(host).data.dict()  # type: ignore[no-untyped-call]
    return data


def load_thresholds(inventory: LoadedInventory) -> dict[str, Thresholds]:
    """Thresholds of every host; ``InventoryError`` listing every bad value otherwise."""
    out: dict[str, Thresholds] = {}
    problems: list[FieldProblem] = []
    for spec in inventory.hosts:
        thresholds, found = parse_thresholds(inventory.path, spec.name, host_data(inventory, spec.name).get("alerts"))
        out[spec.name] = thresholds
        problems += found
    if problems:
        raise InventoryError(problems)
    return out
