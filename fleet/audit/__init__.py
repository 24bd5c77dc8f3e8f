"""Audit probed hosts against their GPU model (rules), against their peers (fleet rules), and
report (tables, JSON, HTML with a topology picture per host)."""
