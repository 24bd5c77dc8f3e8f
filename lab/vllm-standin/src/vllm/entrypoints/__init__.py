"""vLLM's ``vllm.entrypoints`` package path (stand-in): only what tools import to parse ``vllm serve``."""
