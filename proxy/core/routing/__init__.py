"""The routing decision: scores, options, waits, holds and the return odds."""
