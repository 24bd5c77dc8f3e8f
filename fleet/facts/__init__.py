"""pyinfra facts fleet reads from hosts (the NVML probe first), and running them on many hosts."""

#: Seconds a read-only probe (``fleet plan``) waits for a host's SSH port to answer, all hosts at
#: once (``runner.open_connections``); ``fleet plan --probe-timeout``. Here, not in ``runner``, so
#: that the CLI can show it without importing paramiko.
PROBE_CONNECT_TIMEOUT = 3.0
