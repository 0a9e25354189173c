"""The backends' life: slot admission (``scheduler``), health probing and draining, the reuse-rule
probe."""
