"""Escaping where values land: moved to ``fleet.escape`` (a base module every stage may use: facts
build shell commands, render writes unit and env files); this name stays for existing imports."""

from __future__ import annotations

from fleet.escape import (
    check_host_path,
    comment_text,
    env_file_value,
    haproxy_word,
    ssh_command,
    systemd_arg,
    systemd_assignment,
    systemd_path,
    systemd_text,
    systemd_word,
)

__all__ = [
    "check_host_path",
    "comment_text",
    "env_file_value",
    "haproxy_word",
    "ssh_command",
    "systemd_arg",
    "systemd_assignment",
    "systemd_path",
    "systemd_text",
    "systemd_word",
]
