"""fleet: provision and roll out vLLM serving fleets on NVIDIA GPU hosts."""

__version__ = "0.1.0"
