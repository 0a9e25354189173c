"""Replicas' pure rules: home backends, the partition while the store is down, replica
authentication."""
