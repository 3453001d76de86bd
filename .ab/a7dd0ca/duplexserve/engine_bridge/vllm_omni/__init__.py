"""The vLLM-Omni engine: a bridge into vLLM-Omni's duplex engine (vLLM-Omni imported lazily)."""
