"""Load an inventory in pyinfra's Python format into pyinfra's own ``Inventory``.

An inventory file is plain pyinfra: every module-level list, or ``(hosts, data)`` tuple, whose
name does not start with ``_`` is a group; items are ``"name"`` or ``("name", {data})``; hosts
also join a group named after the file; ``group_data/<group>.py`` next to the file adds group
data. Loading into pyinfra's ``Inventory`` keeps data precedence (host > group > all) pyinfra's,
without importing ``pyinfra_cli`` (which monkey-patches the interpreter with gevent on import).
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

from pyinfra.api.inventory import Inventory

from fleet.errors import FieldProblem, InventoryError

# -- loading pyinfra's format -------------------------------------------------------------------


def _is_group(name: str, value: Any) -> bool:
    if name.startswith("_"):
        return False
    hosts = value[0] if isinstance(value, tuple) and len(value) == 2 else value
    return isinstance(hosts, list) and all(isinstance(item, str | tuple) for item in hosts)


def _host_name(item: str | tuple[str, dict[str, Any]]) -> str:
    return item[0] if isinstance(item, tuple) else item


def _group_data_files(inventory_path: Path) -> dict[str, dict[str, Any]]:
    folder = inventory_path.parent / "group_data"
    data: dict[str, dict[str, Any]] = {}
    if folder.is_dir():
        for file in sorted(folder.glob("*.py")):
            attrs = runpy.run_path(str(file))
            data[file.stem] = {
                k: v for k, v in attrs.items() if not k.startswith("_") and not callable(v) and not _is_module(v)
            }
    return data


def _is_module(value: Any) -> bool:
    return type(value).__name__ == "module"


def load_pyinfra_inventory(path: str | Path) -> Inventory:
    """Load a pyinfra Python inventory file into ``pyinfra.api.Inventory`` (CLI semantics)."""
    path = Path(path)
    if not path.is_file():
        raise InventoryError([FieldProblem(str(path), "-", "inventory", str(path), "no such file")])
    try:
        attrs = runpy.run_path(str(path))
    except Exception as exc:
        raise InventoryError(
            [FieldProblem(str(path), "-", "inventory", type(exc).__name__, f"the file does not run: {exc}")]
        ) from exc
    groups: dict[str, tuple[list[Any], dict[str, Any]]] = {}
    for name, value in attrs.items():
        if _is_group(name, value):
            hosts, data = value if isinstance(value, tuple) else (value, {})
            groups[name] = (list(hosts), dict(data))
    all_hosts, all_data = groups.pop("all", ([], {}))
    all_names = [_host_name(h) for h in all_hosts]
    for hosts, _ in groups.values():
        for item in hosts:
            if _host_name(item) not in all_names:
                all_names.append(_host_name(item))
                all_hosts.append(item)
    file_group = path.stem
    if file_group not in groups:
        groups[file_group] = ([_host_name(h) for h in all_hosts], {})
    for group, data in _group_data_files(path).items():
        if group == "all":
            all_data = {**all_data, **data}
        elif group in groups:
            groups[group][1].update(data)
        else:
            groups[group] = ([], data)
    return Inventory((all_hosts, all_data), **groups)  # type: ignore[no-untyped-call]
