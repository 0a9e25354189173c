"""Pure, synchronous, I/O-free decision code. Nothing here may import aiohttp, redis,
prometheus_client, asyncio, time, random or logging (tests/test_architecture.py checks)."""
