"""Developers' benchmarks and scaffolding (engine, memory, gateway, history, soak, llama.cpp reference). Product code never imports it."""
