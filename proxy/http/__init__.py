"""The HTTP face: handlers, middleware, body intake, relaying responses, status and admin endpoints,
forwarding to a peer replica."""
