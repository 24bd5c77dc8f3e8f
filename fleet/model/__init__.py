"""Model architecture from a Hugging Face config.json, and vLLM's arithmetic over it."""
