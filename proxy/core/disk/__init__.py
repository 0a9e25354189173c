"""The disk tier's pure rules: the snapshot index, prefix scopes, per-client write caps."""
