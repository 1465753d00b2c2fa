"""Parity with llama.cpp: its chat templates, its own server tests, and images, against stock llama-server."""
