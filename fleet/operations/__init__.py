"""pyinfra operations that take a host from bare to serving: the NVIDIA driver from NVIDIA's apt
layout, an immutable vLLM virtual environment per release, and the rendered unit files.

Each is a small generator of commands made idempotent by facts, the way pyinfra's own
``operations/apt.py`` is written; the decisions they take are pure functions in ``layout.py``.
"""
