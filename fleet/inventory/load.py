"""Load an inventory in pyinfra's Python format into pyinfra's own ``Inventory``.

An inventory file is plain pyinfra: every module-level list, or ``(hosts, data)`` tuple, whose
name does not start with ``_`` is a group; items are ``"name"`` or ``("name", {data})``; hosts
also join a group named after the file; ``group_data/<group>.py`` next to the file adds group
data. Loading into pyinfra's ``Inventory`` keeps data precedence (host > group > all) pyinfra's,
without importing ``pyinfra_cli`` (which monkey-patches the interpreter with gevent on import).

Inventory files are Python, so they can do anything: whatever one raises (a syntax error, an
exception, ``sys.exit(0)``) is invalid input, reported with the file and the line, never a
traceback and never a silent exit. What they print is swallowed (it would corrupt ``--json``
and may hold secrets). The structure is checked before pyinfra sees it: host names (they
become directories under ``--render``), host data that is a dict with string keys, and a host
defined twice with values that disagree. Every value keeps the file it was written in, so an
error names the ``group_data`` file when the value came from there.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pyinfra.api.inventory import Inventory

from fleet.errors import FieldProblem, InventoryError
from fleet.inventory.schema import host_name_problem
from fleet.secrets import looks_like_secret, shown

#: where a value given with a command-line option "was written" (for error messages)
COMMAND_LINE = "(command line)"

HOST_ITEM = 'a host is "name" or ("name", {data})'


@dataclass(frozen=True)
class HostEntry:
    """One host as the inventory files define it: merged data and where each key was written."""

    name: str
    groups: tuple[str, ...]
    data: dict[str, Any]
    sources: dict[str, str]


@dataclass
class InventoryFiles:
    """An inventory file and its ``group_data``: pyinfra's ``Inventory``, hosts, and structural problems."""

    path: str
    pyinfra: Inventory
    hosts: list[HostEntry]
    problems: list[FieldProblem] = field(default_factory=list)


# -- running Python files -------------------------------------------------------------------------


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _line(exc: BaseException, path: str) -> int | None:
    """The last line of ``path`` the exception passed through."""
    if isinstance(exc, SyntaxError) and exc.filename and _same_file(exc.filename, path):
        return exc.lineno
    line, tb = None, exc.__traceback__
    while tb is not None:
        if _same_file(tb.tb_frame.f_code.co_filename, path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    text = " ".join(text.split())
    return text[:300] + ("..." if len(text) > 300 else "")


def run_python_file(path: Path) -> tuple[dict[str, Any] | None, FieldProblem | None]:
    """Run an inventory or group_data file; its globals, or the problem it raised (with its line).

    ``SystemExit`` is caught too: an inventory that exits is invalid input, not the end of fleet.
    ``KeyboardInterrupt`` is left alone (the operator pressed Ctrl-C).
    """
    file = str(path)
    swallowed = io.StringIO()
    try:
        with contextlib.redirect_stdout(swallowed), contextlib.redirect_stderr(swallowed):
            return runpy.run_path(file), None
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        allowed = f"the file calls sys.exit({_message(exc)}): an inventory defines groups and data, it does not exit"
        return None, FieldProblem(file, "-", "", None, allowed, line=_line(exc, file))
    except BaseException as exc:
        what = f"the file does not run: {type(exc).__name__}"
        detail = _message(exc)
        if isinstance(exc, SyntaxError):
            detail = exc.msg
        return None, FieldProblem(file, "-", "", None, f"{what}: {detail}" if detail else what, line=_line(exc, file))


def _module_data(attrs: dict[str, Any]) -> dict[str, Any]:
    """Data names of a group_data file: not private, not modules, functions or classes."""
    return {
        k: v
        for k, v in attrs.items()
        if isinstance(k, str) and not k.startswith("_") and not isinstance(v, ModuleType) and not callable(v)
    }


# -- structure --------------------------------------------------------------------------------------


def _group_value(value: Any) -> tuple[list[Any], Any] | None:
    """``(hosts, data)`` when a module-level value is a group in pyinfra's sense, else None."""
    data: Any
    if isinstance(value, list):
        hosts, data = value, {}
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], list):
        hosts, data = value
    else:
        return None
    if hosts and not any(isinstance(item, str | tuple) for item in hosts):
        return None  # a list of numbers or such: not a group (pyinfra ignores it too)
    return list(hosts), data


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


class _Reader:
    def __init__(self, path: Path):
        self.path = path
        self.file = str(path)
        self.problems: list[FieldProblem] = []

    def problem(self, host: str, fld: str, value: object, allowed: str, file: str | None = None) -> None:
        self.problems.append(FieldProblem(file or self.file, host, fld, value, allowed))

    def clean_data(self, host: str, data: Any, where: str, file: str | None = None) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.problem(host, where, data, "host or group data is a dict of field: value", file)
            return {}
        clean: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(key, str):
                clean[key] = value
            else:
                self.problem(host, f"{where} key {shown(key)}", value, "field names are strings", file)
        return clean

    def hosts_of(self, group: str, items: list[Any]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for item in items:
            data: Any
            if isinstance(item, str):
                name, data = item, {}
            elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
                name, data = item
            elif isinstance(item, tuple) and len(item) == 2:
                self.problem(shown(item[0]), f"group {group}: host data", item[1], "a dict of field: value")
                continue
            else:
                self.problem("-", f"group {group}", item, HOST_ITEM)
                continue
            why = host_name_problem(name)
            if why is None and looks_like_secret(name):
                why = "a host name that looks like a secret (an API key or token)"
            if why is not None:
                self.problem("-", f"group {group}: host name", name, why)
                continue
            out.append((name, self.clean_data(name, data, "host data")))
        return out


def read_inventory(path: str | Path, overrides: Mapping[str, Any] | None = None) -> InventoryFiles:
    """Read an inventory file and its group_data; structural problems are collected, not raised.
    ``overrides`` (pyinfra's ``override_data``) win over every host's data; errors name them
    as given on the command line.

    Raises ``InventoryError`` only when the inventory file itself cannot be read or run.
    """
    path = Path(path)
    if not path.is_file():
        raise InventoryError([FieldProblem(str(path), "-", "", None, "no such file")])
    attrs, failure = run_python_file(path)
    if failure is not None or attrs is None:
        raise InventoryError([failure] if failure else [])
    r = _Reader(path)
    # group -> (hosts, data, key -> file)
    groups: dict[str, tuple[list[tuple[str, dict[str, Any]]], dict[str, Any], dict[str, str]]] = {}
    for name, value in attrs.items():
        if not isinstance(name, str) or name.startswith("_"):
            continue
        parsed = _group_value(value)
        if parsed is None:
            if isinstance(value, tuple) and any(isinstance(item, str | tuple | list) for item in value):
                r.problem("-", f"group {name}", value, "a group is a list of hosts, or a tuple ([hosts], {data})")
            continue
        items, group_data = parsed
        clean = r.clean_data("-", group_data, f"group {name} data")
        groups[name] = (r.hosts_of(name, items), clean, dict.fromkeys(clean, r.file))
    all_hosts, all_data, all_sources = groups.pop("all", ([], {}, {}))
    # Every host once; the same key given twice with different values is an error, not "first wins".
    merged: dict[str, dict[str, tuple[Any, str]]] = {}
    for group, (hosts, _data, _src) in [("all", (all_hosts, all_data, all_sources)), *groups.items()]:
        for name, data in hosts:
            seen = merged.setdefault(name, {})
            for key, value in data.items():
                if key in seen and not _same(seen[key][0], value):
                    r.problem(
                        name,
                        key,
                        value,
                        f"the host is defined twice with different {key}: group {seen[key][1]} says "
                        f"{shown(seen[key][0])}, group {group} says {shown(value)}; define the host once, "
                        "or give both the same value",
                    )
                seen.setdefault(key, (value, group))
    host_data = {name: {k: v for k, (v, _g) in keys.items()} for name, keys in merged.items()}
    file_group = path.stem
    if file_group not in groups and file_group != "all":
        groups[file_group] = ([(n, {}) for n in merged], {}, {})
    folder = path.parent / "group_data"
    if folder.is_dir():
        for gfile in sorted(folder.glob("*.py")):
            gattrs, gfailure = run_python_file(gfile)
            if gfailure is not None or gattrs is None:
                r.problems.extend([gfailure] if gfailure else [])
                continue
            data = _module_data(gattrs)
            if gfile.stem == "all":
                all_data = {**all_data, **data}
                all_sources.update(dict.fromkeys(data, str(gfile)))
            elif gfile.stem in groups:
                groups[gfile.stem][1].update(data)
                groups[gfile.stem][2].update(dict.fromkeys(data, str(gfile)))
            else:
                groups[gfile.stem] = ([], dict(data), dict.fromkeys(data, str(gfile)))
    inventory = Inventory(  # type: ignore[no-untyped-call]
        ([(n, d) for n, d in host_data.items()], all_data),
        override_data=dict(overrides or {}),
        **{g: ([n for n, _d in hosts], data) for g, (hosts, data, _src) in groups.items()},
    )
    entries = []
    for host in inventory:
        host_groups = tuple(host.groups)
        sources = dict(all_sources)
        for g in host_groups:  # later groups win, as in pyinfra's get_groups_data
            sources.update(groups[g][2] if g in groups else {})
        sources.update(dict.fromkeys(host_data.get(host.name, {}), r.file))
        sources.update(dict.fromkeys(overrides or {}, COMMAND_LINE))
        data = host.data.dict()  # type: ignore[no-untyped-call]
        entries.append(HostEntry(host.name, host_groups, data, {k: sources.get(k, r.file) for k in data}))
    return InventoryFiles(str(path), inventory, entries, r.problems)


def load_pyinfra_inventory(path: str | Path) -> Inventory:
    """Load a pyinfra Python inventory file into ``pyinfra.api.Inventory`` (CLI semantics)."""
    files = read_inventory(path)
    if files.problems:
        raise InventoryError(files.problems)
    return files.pyinfra
