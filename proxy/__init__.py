"""llama-cache-proxy: a prompt-cache-aware reverse proxy for llama.cpp llama-server fleets."""

__version__ = "0.1.0"
