"""The push-cost benchmark parses what it times: each family's sample answer splits into its parts."""

import pytest

from app.engine.formats import bench, parse_answer


@pytest.mark.parametrize("label", list(bench.FAMILIES))
def test_each_sample_answer_is_a_thought_content_and_one_call(label):
    fmt = bench.FAMILIES[label]
    answer = parse_answer(fmt, bench.TOOLS, bench.sample_answer(fmt, words=40))
    assert bool(answer.reasoning) is fmt.reasoning
    assert answer.content.startswith("The forecast for Paris") and "<" not in answer.content.replace("<b>", "").replace(
        "</b>", "")
    assert [c.name for c in answer.calls] == ([] if fmt.name == "generic" else ["get_weather"])


def test_the_benchmark_prints_a_row_per_family(capsys):
    bench.main([])
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 1 + len(bench.FAMILIES) and all(len(r.split()) >= 4 for r in rows[1:])
