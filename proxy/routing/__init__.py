"""Prefix-aware routing, the shell around ``core.routing.decision``: plans, decisions, token
counting, churn records."""
