"""Inventories: load pyinfra's Python format and validate it into typed host specs."""
