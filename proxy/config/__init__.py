"""The one settings tree: typed, validated, immutable (``settings``), its sections and sources."""
