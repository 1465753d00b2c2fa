"""OpenAI-compatible gateway: auth, classes, admission, routing, relay."""
