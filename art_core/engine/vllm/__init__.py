"""The vLLM engine."""
