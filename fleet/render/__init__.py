"""Rendering plans into files that land on hosts: systemd units and environment files."""
