"""llama-server as the proxy models it from outside: backends and slots, the RAM prompt cache, reuse
rules."""
