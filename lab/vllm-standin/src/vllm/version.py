"""The stand-in's version: vLLM 0.33.0 with a PEP 440 local label (``vllm==0.33.0`` accepts it)."""

__version__ = "0.33.0+fleetlab.1"
#: The vLLM release whose behaviour is imitated.
VLLM_VERSION = "0.33.0"
