"""The llama-server-compatible runner process: routes, generation jobs, answer writers."""
