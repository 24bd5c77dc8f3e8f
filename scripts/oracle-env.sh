#!/usr/bin/env bash
# Build .oracle-venv: vLLM 0.33.0, whose own code is the oracle for tests/oracle, next to (never
# inside) fleet's .venv. It runs on CPU: vLLM's config and KV-cache planning code need torch
# (the CUDA build vLLM pins, whose libraries load without a GPU) but no GPU. vLLM is installed
# without its dependency tree (flashinfer, cutlass, ray, the multimodal and audio stacks...);
# only the packages that the modules tests/oracle imports pull in at import time are added.
# Indexes come from this machine's pip configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .oracle-venv/bin/python ]; then
    "$PYTHON" -m venv .oracle-venv
fi
PIP=".oracle-venv/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q --no-deps vllm==0.33.0 torchvision==0.29.0
$PIP install -q torch==2.14.0 'setuptools>=77.0.3,<81' \
    'transformers>=5.16.1,<5.21.0' 'huggingface_hub>=1.31.0' 'tokenizers>=0.23.2' 'safetensors>=0.6.2' \
    'pydantic>=2.12.0' fastapi llguidance xgrammar==0.2.8 compressed-tensors==0.17.0 \
    'openai>=2.25.0' openai-harmony 'aiohttp>=3.14.4' 'requests>=2.33.0' 'prometheus_client>=0.18.0' \
    numpy pyyaml psutil cachetools regex msgspec cloudpickle blake3 py-cpuinfo sentencepiece \
    typing_extensions filelock pyzmq einops cbor2 pybase64 xxhash urllib3 pillow uvloop partial-json-parser
.oracle-venv/bin/python -c "import vllm, torch; print('oracle environment: vLLM', vllm.__version__, 'torch', torch.__version__)"
