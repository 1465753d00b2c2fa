"""The bench's tables: per target × level figures, hearth against the reference server, speculation's arms, the runner plan."""

from __future__ import annotations

import math

from app.policy import MODES
from app.telemetry.stats import median
from app.verdict.results import RunResult, as_evidence, identity, request_times
from app.verdict.spec import OFF


def figure(v, spec: str = ".1f", scale: float = 1.0) -> str:
    """A figure as the tables print it: "n/a" for a missing or NaN value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v * scale if scale != 1.0 else v, spec)


def format_table(results: list[RunResult]) -> str:
    """The per target × level table, plus per-class p95s."""
    head = (f"{'target':<27}{'L':>3}{'slots':>6}{'gen tok/s':>10}{'prm tok/s':>10}{'TTFT p50':>9}{'TTFT p95':>9}"
            f"{'TPOT p50':>9}{'done p50':>9}{'done p95':>9}{'KV mean':>8}{'KV peak':>8}{'preempt':>8}"
            f"{'Jain':>6}{'util':>6}{'gap':>6}{'err':>4}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.summary
        lines.append(
            f"{r.target:<27}{r.level:>3}{figure(r.slots, 'd'):>6}{figure(s['gen_tok_s']):>10}"
            f"{figure(s['prompt_tok_s'], '.0f'):>10}"
            f"{figure(s['ttft_p50_ms'], '.0f'):>9}{figure(s['ttft_p95_ms'], '.0f'):>9}{figure(s['tpot_p50_ms'], '.0f'):>9}"
            f"{figure(s['completion_p50_ms'], '.0f'):>9}{figure(s['completion_p95_ms'], '.0f'):>9}"
            f"{figure(s['kv_mean_util'], '.0f', 100):>7}%{figure(s['kv_peak_util'], '.0f', 100):>7}%"
            f"{figure(s['preemptions'], 'd'):>8}{figure(s['jain_fairness'], '.2f'):>6}{figure(s['util_mean'], '.0f', 100):>5}%"
            f"{figure(s['util_gap_share'], '.0f', 100):>5}%{s['errors']:>4}"
        )
    lines.append("")
    lines.append("per class, p95 ms (TTFT / completion) and SLO attainment:")
    for r in results:
        parts = [f"{n} {figure(c['ttft_p95_ms'], '.0f')}/{figure(c['completion_p95_ms'], '.0f')}"
                 f" slo {figure(c['slo_attainment'], '.0f', 100)}%" for n, c in r.summary["per_class"].items()]
        lines.append(f"  {r.target:<27}L={r.level:<3}S={figure(r.slots, 'd'):<4}" + "; ".join(parts))
    return "\n".join(lines)


def comparison(results: list[RunResult]) -> list[dict]:
    """Each hearth mode against the reference server (llama-server, else --target), same level, slots and repetition.

    Ratios are taken within one repetition (same prompts, neighbouring in time); with repeats the
    row holds the median of each ratio and all of them.
    """
    for ref_label in ("llama-server", "target"):
        # With a speculation axis the reference is the server's arm without drafts.
        refs = {(r.level, r.slots, r.rep): r for r in results if r.base == ref_label and r.arm in (None, OFF)}
        if refs:
            break
    else:
        return []
    pairs: dict[tuple[str, int, int | None], list[dict]] = {}
    for r in results:
        # An external reference was not started by the bench: its slots are unknown, any will do.
        ref = refs.get((r.level, r.slots, r.rep)) or refs.get((r.level, None, r.rep))
        if ref is None and r.base == "serve":
            # serve sized its own runner: compare with the reference at the same level and repetition.
            ref = next((v for k, v in refs.items() if k[0] == r.level and k[2] == r.rep), None)
        if ref is None or (r.base not in MODES and r.base != "serve"):
            continue
        a, b = r.summary, ref.summary
        one = {"gen_tok_s_ratio": _ratio(a["gen_tok_s"], b["gen_tok_s"]), "per_class": {}}
        for name, c in a["per_class"].items():
            rc = b["per_class"].get(name, {})
            one["per_class"][name] = {
                "ttft_p95_ratio": _ratio(c.get("ttft_p95_ms"), rc.get("ttft_p95_ms")),
                "completion_p95_ratio": _ratio(c.get("completion_p95_ms"), rc.get("completion_p95_ms")),
                # The slowest request of the class, ours over theirs: "finishes within 1.2×" is about all of them.
                "completion_max_ratio": _ratio(_max_done(r.requests, name), _max_done(ref.requests, name)),
            }
        pairs.setdefault((r.target, r.level, r.slots), []).append(one)
    out = []
    for (mode, level, slots), ones in pairs.items():
        row = {"mode": mode, "reference": refs_label(results, ref_label), "level": level, "slots": slots, "repeats": len(ones),
               "gen_tok_s_ratio": median([o["gen_tok_s_ratio"] for o in ones]),
               "gen_tok_s_ratios": [o["gen_tok_s_ratio"] for o in ones], "per_class": {}}
        for name in ones[0]["per_class"]:
            row["per_class"][name] = {
                key: median([o["per_class"][name][key] for o in ones if name in o["per_class"]])
                for key in ("ttft_p95_ratio", "completion_p95_ratio", "completion_max_ratio")}
            row["per_class"][name]["ttft_p95_ratios"] = [o["per_class"][name]["ttft_p95_ratio"] for o in ones
                                                         if name in o["per_class"]]
        out.append(row)
    return out


def refs_label(results: list[RunResult], base: str) -> str:
    """What the reference runs are called in the tables: the server, with its off arm's label on an axis."""
    return next((r.target for r in results if r.base == base and r.arm in (None, OFF)), base)


def spec_rows(results: list[RunResult]) -> list[dict]:
    """One row per speculation arm × level: median tok/s and ratio to its own off arm, drafting figures, identity.

    Ratios are taken within one repetition (on and off neighbouring in time), then the median."""
    by: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        if r.arm is not None:
            by.setdefault((r.target, r.level), []).append(r)
    if not by:
        return []
    off = {(r.base, r.level, r.rep): r for r in results if r.arm == OFF}
    same = identity(as_evidence(results))
    rows = []
    for (target, level), runs in by.items():
        base, arm = runs[0].base, runs[0].arm
        pairs = [(r, off.get((base, level, r.rep))) for r in runs]

        def ratio(key: str, pairs=pairs, arm=arm) -> float | None:
            return None if arm == OFF else median([on.summary[key] / o.summary[key] for on, o in pairs
                                                   if o is not None and on.summary.get(key) and o.summary.get(key)])

        def med(key: str, runs=runs):
            return median([r.summary.get(key) for r in runs])

        e = same.get(target)
        rows.append({"target": target, "base": base, "spec": arm, "level": level, "repeats": len(runs),
                     "gen_tok_s": med("gen_tok_s"), "gen_tok_s_all": [r.summary.get("gen_tok_s") for r in runs],
                     "ratio_to_off": ratio("gen_tok_s"), "decode_tok_s": med("decode_tok_s"),
                     "decode_ratio_to_off": ratio("decode_tok_s"),
                     "acceptance": med("spec_acceptance"), "tokens_per_draft": med("spec_tokens_per_draft"),
                     "draft_tokens": med("spec_draft_tokens"), "accepted_tokens": med("spec_accepted_tokens"),
                     "ttft_p50_ms": med("ttft_p50_ms"), "tpot_p50_ms": med("tpot_p50_ms"),
                     "per_class": {n: {key: median([r.summary["per_class"].get(n, {}).get(key) for r in runs])
                                       for key in ("ttft_p95_ms", "tpot_p95_ms")}
                                   for n in runs[0].summary.get("per_class", {})},
                     # The cost rule per draft source in the last repetition (results.spec_rule; hearth only).
                     "rule": runs[-1].summary.get("spec_rule"),
                     "identical": None if e is None else e["all_identical"],
                     "identical_against": None if e is None else e["against"],
                     "identical_counts": None if e is None else [e["identical"], e["compared"]]})
    return rows


def format_spec(rows: list[dict]) -> str:
    """The speculation arms as the CLI prints them: one line per arm × level, every repetition's tok/s."""
    head = (f"{'arm':<28}{'L':>3}{'gen tok/s':>10}{'× off':>7}{'decode':>8}{'× off':>7}{'accept':>8}{'tok/draft':>10}"
            f"{'drafted':>8}{'TTFT p50':>9}{'TPOT p50':>9}  {'same as off':<16}each repetition (gen tok/s)")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = ("n/a" if r["identical"] is None else
                f"{'yes' if r['identical'] else 'NO'} {r['identical_counts'][0]}/{r['identical_counts'][1]}")
        accept = "n/a" if r["acceptance"] is None else f"{r['acceptance'] * 100:.0f}%"
        lines.append(f"{r['target']:<28}{r['level']:>3}{figure(r['gen_tok_s']):>10}{figure(r['ratio_to_off'], '.2f'):>7}"
                     f"{figure(r['decode_tok_s']):>8}{figure(r['decode_ratio_to_off'], '.2f'):>7}"
                     f"{accept:>8}{figure(r['tokens_per_draft'], '.2f'):>10}"
                     f"{figure(r['draft_tokens'], '.0f'):>8}{figure(r['ttft_p50_ms'], '.0f'):>9}"
                     f"{figure(r['tpot_p50_ms'], '.1f'):>9}  {same:<16}"
                     + ", ".join(figure(v) for v in r["gen_tok_s_all"]))
    lines.append("  × off: over the same target without drafts, median of the per-repetition ratios; gen tok/s: "
                 "generated tokens over the run's wall time (prefill included); decode: tokens per second after the "
                 "first (median request); accept: draft tokens kept; tok/draft: tokens kept per draft verified; same as off: greedy outputs "
                 "byte-identical to the off arm's (hearth's off arm: to llama-server's), requests identical/compared")
    return "\n".join(lines)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _max_done(rows: list[dict], class_name: str) -> float | None:
    done = [request_times(r)["completion_ms"] for r in rows if r["class_name"] == class_name]
    done = [d for d in done if d is not None]
    return max(done) if done else None


def format_comparison(rows: list[dict]) -> str:
    """The comparison as the CLI prints it."""
    lines = []
    for row in rows:
        parts = [f"{n}: TTFT p95 {figure(c['ttft_p95_ratio'], '.3f')}×, done p95 {figure(c['completion_p95_ratio'], '.2f')}×,"
                 f" slowest {figure(c['completion_max_ratio'], '.2f')}×" for n, c in row["per_class"].items()]
        reps = f" (median of {row['repeats']})" if row["repeats"] > 1 else ""
        slots = f", {row['slots']} slots" if row.get("slots") else ""
        lines.append(f"  {row['mode']} / {row['reference']} at L={row['level']}{slots}{reps}: generated tok/s "
                     f"{figure(row['gen_tok_s_ratio'], '.2f')}×; " + "; ".join(parts))
    return "\n".join(lines)


def format_plan(p: dict) -> list[str]:
    """The runner groups of a session's constants, one line each, for the CLI."""
    lines = []
    for g in p["groups"]:
        est = f", est. {g['estimate_bytes'] / 1024 ** 3:.2f} GiB" if g.get("estimate_bytes") else ""
        arms = [a for a in g.get("spec") or [] if a is not None]
        spec = f" × speculation {', '.join(arms)}" if arms else ""
        llama = [a for a in g.get("llama_spec") or [] if a is not None]
        stock = f"; llama-server {', '.join(llama)}" if g.get("llama_server") and llama else (
            "; llama-server" if g.get("llama_server") else "")
        lines.append(f"  {g['slots']} slots, {g['n_ctx']} KV cells: levels {g['levels']}, "
                     f"modes {', '.join(g['modes']) or 'none'}{spec}{stock}{est}")
    lines += [f"  level {lv}: {note}" for lv, note in p["notes"].items()]
    lines += [f"  not measured: {line}" for line in p["skipped"]]
    lines.append(f"  memory check: {p['memory']}")
    return lines
