"""The disk tier: KV snapshots of stable prefixes through llama-server's slot save/restore."""
