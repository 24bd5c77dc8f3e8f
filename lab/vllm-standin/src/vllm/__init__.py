"""fleet lab stand-in for vLLM 0.33.0 — NOT vLLM.

It behaves like ``vllm serve`` 0.33.0 at the boundaries fleet touches (install, flags, memory
arithmetic and its errors, readiness, HTTP API, metrics, SIGTERM drain, worker processes, GPU
memory visible through NVML) without any model or GPU. See ``vllm.standin``.
"""

from vllm.version import __version__

__all__ = ["__version__"]
