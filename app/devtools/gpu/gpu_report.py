"""The summary of one scripts/gpu_check.sh run: every step's status and the figures the issue asks for, in one JSON.

`python -m app.devtools.gpu.gpu_report OUT BUDGET_S ELAPSED_S` reads OUT/steps.jsonl and the JSON
files the steps wrote there (engine_1b.json, engine_8b.json, vram.json, served_1b.json,
voice.json) and writes OUT/gpu_check.json. A missing or partial file is reported as such, never
fatal: a run that ran out of time still says what it measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from app.hardware import machine

# The targets on the GPU.
ENGINE_OVER_REFERENCE_MIN = 0.9
VRAM_TOLERANCE = 0.10


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def engine_figures(doc: dict | None) -> dict | None:
    """Decode tok/s of the engine and llama-batched-bench per level, their ratio, outside-decode share."""
    if not doc:
        return None
    ratios = (doc.get("summary") or {}).get("ratios") or {}
    uniform = {str(r["level"]): r["summary"] for r in doc.get("runs", []) if r.get("workload") == "uniform"}
    levels = {}
    for level, s in uniform.items():
        refs = [rep.get(level) or rep.get(int(level)) for rep in (doc.get("reference") or [])]
        refs = [r["decode_tokens_per_s"] for r in refs if r]
        levels[level] = {
            "engine_decode_tok_s": s.get("decode_tok_s"),
            "reference_decode_tok_s": refs[0] if len(refs) == 1 else refs or None,
            "ratio": (ratios.get(level) or {}).get("median"),
            "outside_decode_share": s.get("outside_decode_share_decode_phase"),
            "meets_target": None if (ratios.get(level) or {}).get("median") is None
            else ratios[level]["median"] >= ENGINE_OVER_REFERENCE_MIN,
        }
    c = doc.get("constants", {})
    return {"model": c.get("model_desc"), "gpu_layers": c.get("gpu_layers"), "n_ctx": c.get("n_ctx"),
            "levels": levels, "memory": (doc.get("summary") or {}).get("memory")}


def replay_figures(doc: dict | None) -> dict | None:
    """The served comparison (hearth over llama-server, per level) and the verdict, as the replay wrote them."""
    if not doc:
        return None
    return {"scenario": doc.get("scenario"), "comparison": doc.get("comparison"), "verdict": doc.get("verdict")}


def vram_figures(doc: dict | None) -> dict | None:
    """Estimate vs measured, and what the NVML sampler read under load."""
    if not doc:
        return None
    s = doc.get("sampler", {})
    return {k: doc.get(k) for k in ("measured_on", "measured_bytes", "estimate_over_measured", "within_tolerance",
                                     "nvml_process_bytes_loaded", "load_ok", "load_requests")} | {
        "estimate_total_bytes": (doc.get("estimate") or {}).get("total_bytes"),
        "sampler": {k: s.get(k) for k in ("num_samples", "num_readings", "gpu_util_pct_max", "gpu_util_pct_mean")},
    }


def build_report(out: Path, budget_s: float, elapsed_s: float) -> dict:
    """Everything in `out` folded into one document."""
    steps = []
    steps_path = out / "steps.jsonl"
    if steps_path.is_file():
        for line in steps_path.read_text().splitlines():
            if line.strip():
                steps.append(json.loads(line))
    return {
        "budget_s": budget_s, "elapsed_s": elapsed_s, "steps": steps, "machine": machine(),
        "targets": {"engine_over_reference_min": ENGINE_OVER_REFERENCE_MIN, "vram_tolerance": VRAM_TOLERANCE},
        "engine_1b": engine_figures(_load(out / "engine_1b.json")),
        "engine_8b": engine_figures(_load(out / "engine_8b.json")),
        "vram": vram_figures(_load(out / "vram.json")),
        "served_1b": replay_figures(_load(out / "served_1b.json")),
        "voice_under_background": replay_figures(_load(out / "voice.json")),
    }


def main(argv: list[str]) -> int:
    """Write OUT/gpu_check.json and print it."""
    out = Path(argv[0])
    report = build_report(out, float(argv[1]), float(argv[2]))
    text = json.dumps(report, indent=1)
    (out / "gpu_check.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
