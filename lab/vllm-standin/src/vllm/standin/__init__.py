"""The simulated vLLM: argument parsing, model architecture, memory arithmetic, GPUs, workers,
engine, HTTP server, metrics and fault injection, one module each."""
