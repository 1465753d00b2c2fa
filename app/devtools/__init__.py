"""Developers' benchmarks and scaffolding. Product code never imports it.

The benches by what they measure: engine/ (the engine and one runner), serving/ (through a real `hearth serve`),
gpu/ (devices and the offload path), parity/ (against llama.cpp and stock llama-server). Here at the top: what
they stand on (model makers and stand-ins, a serve child process, llama.cpp's C++ reference) and command.py,
`hearth bench`'s command line. What the household runs, `hearth bench replay` and the verdict, is app.verdict.
"""
