"""Hearth: the household's shared local LLM server."""
