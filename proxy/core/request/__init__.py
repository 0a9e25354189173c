"""A client's request body: parsed and validated, the fields the proxy owns rewritten, and
Anthropic Messages requests and answers converted to and from chat completions."""
