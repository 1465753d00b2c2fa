"""Embedding batching, measured: 64 short inputs in one call against one input, same model, same run.

Run: python -m app.devtools.engine.embed_bench [GGUF] [--threads N] [--reps N]. Prints what it held constant,
the median wall time of each over interleaved repetitions with the spread, their ratio, and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from app.engine.embeddings import EmbeddingContext
from app.engine.llama_model import LlamaModel
from app.engine.model_config import ModelConfig

SHORT_INPUTS = [f"Turn on the light in room {i}." for i in range(64)]


def main(argv: list[str] | None = None) -> int:
    """Print the 64-vs-1 embedding time ratio."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", nargs="?", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.model is None:
        from app.paths import data_dir
        from app.residency.default_model import ensure_default_model

        args.model = str(ensure_default_model(data_dir(), progress=False))
    model = LlamaModel(ModelConfig(path=args.model, n_ctx=256, n_seq_max=1, n_batch=64, n_threads=args.threads))
    emb = EmbeddingContext(model, n_threads=args.threads)
    tokens = [model.tokenize(t, add_special=True, parse_special=False) for t in SHORT_INPUTS]
    emb.embed(tokens[:1])  # warm-up: first-use allocations
    one, many, decodes = [], [], 0
    for _ in range(args.reps):
        t0 = time.perf_counter()
        emb.embed(tokens[:1])
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decodes = emb.embed(tokens).num_decodes
        many.append(time.perf_counter() - t0)
    out = {
        "model": args.model, "pooling": emb.pooling, "n_batch": emb.n_batch, "threads": args.threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "inputs": len(tokens), "tokens": sum(map(len, tokens)), "decodes_for_64": decodes,
        "one_s": one, "many_s": many,
        "median_one_ms": statistics.median(one) * 1000, "median_many_ms": statistics.median(many) * 1000,
    }
    out["ratio"] = out["median_many_ms"] / out["median_one_ms"]
    print(f"model {args.model} pooling {emb.pooling} n_batch {emb.n_batch} threads {args.threads} ({out['machine']})")
    print(f"1 input: median {out['median_one_ms']:.1f} ms (min {min(one) * 1000:.1f}, max {max(one) * 1000:.1f})")
    print(f"64 inputs ({out['tokens']} tokens, {decodes} decodes): median {out['median_many_ms']:.1f} ms "
          f"(min {min(many) * 1000:.1f}, max {max(many) * 1000:.1f})")
    print(f"ratio 64/1: {out['ratio']:.2f}x")
    print(json.dumps(out))
    emb.close()
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
