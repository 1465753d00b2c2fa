"""hearth bench overhead: the instant backend drives the real engine, and the phase split adds up."""

from __future__ import annotations

import io

import pytest

from app.devtools.engine.overhead import PHASES, InstantModel, run_level, run_levels
from app.engine.engine import Engine
from app.engine.request import Finished, SamplingParams


def test_instant_backend_runs_every_request_to_its_length_through_the_real_engine():
    model = InstantModel(n_seq_max=4, n_ctx=512)
    engine = Engine(model)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        # All four queued before the loop runs: on a loaded box it could otherwise start the first one alone.
        handles = [engine.submit([100 + i, 200, 300, 400], params) for i in range(4)]
        engine.start()
        finals = []
        for h in handles:
            events = list(engine.events(h, poll_s=5.0))
            assert events[-1] is not None and isinstance(events[-1], Finished)
            finals.append(events[-1])
            text = "".join(e.text for e in events[:-1] if e is not None)
            assert text == "".join(model.token_bytes(t).decode() for t in h.output_tokens)
    finally:
        engine.stop()
    assert [f.finish_reason for f in finals] == ["length"] * 4
    assert all(len(h.output_tokens) == 12 for h in handles)
    # One prefill iteration, then every sequence decodes together: 12 samples need 12 decodes.
    assert model.num_decodes == 12
    assert max(i.num_seqs for i in engine.iterations) == 4


def test_instrumented_run_splits_the_steady_iterations_into_the_phases():
    run = run_level(8, gen_tokens=24, instrumented=True)
    assert run.iterations >= 20
    assert set(run.phases_us) == set(PHASES)
    assert all(v >= 0 for v in run.phases_us.values())
    assert run.phases_us["scheduling"] > 0 and run.phases_us["streaming"] > 0
    # The timed phases never exceed the iteration they were measured in.
    assert sum(v for k, v in run.phases_us.items() if k != "other") <= run.iteration_us_mean * 1.05
    assert run.iterations_per_s > 0


def test_levels_report_medians_and_keep_every_repetition():
    result = run_levels(levels=(1, 2), repeats=1, gen_tokens=8, out=io.StringIO())
    assert set(result) == {"1", "2"}
    for level, r in result.items():
        assert len(r["runs"]) == 2  # the plain and the instrumented repetition
        per_seq = r["phases_us_per_seq"]["scheduling"] * int(level)
        assert per_seq == pytest.approx(r["phases_us_per_iteration"]["scheduling"])
