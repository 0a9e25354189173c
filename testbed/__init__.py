"""The bed tests and benchmarks stand on: a fake llama-server that follows the real server's
rules (``fake_llama``, ``fake_memory``; fake-vs-real parity tests in ``tests/real`` prove it),
the real stack's processes (``stack``: llama-server, redis-server, Prometheus, the proxy), and
readings of a running proxy (``probes``)."""
