"""Coordination between proxy replicas through the state store: the shared view, releases, the
roster."""
