"""`hearth bench pull` at a tiny size: a partial file resumed through a real `hearth serve` while
/healthz and /api/show are probed; the figures are printed and written."""

import json

from app.cli import main


def test_the_serve_bench_resumes_the_part_and_reports_its_figures(tmp_path, standin_model, capsys):
    out = tmp_path / "pull.json"
    rc = main(["bench", "pull", "--model", str(standin_model), "--partial-gb", "0.02", "--rest-mb", "4",
               "--quiet-s", "0.3", "--show-rate", "10", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == (0 if result["healthz_p99_ms"] <= 100 else 1)  # the exit status says whether the target held
    assert result["pull_outcome"] == "success" and result["landed"]
    assert result["ranges"] == [f"bytes={result['partial_bytes']}-"]  # resumed, not started over
    assert result["healthz_n"] > 0 and result["show_n"] > 0 and result["show_not_200"] == 0
    printed = capsys.readouterr().out
    assert "/healthz during the pull" in printed and "target p99 ≤ 100 ms" in printed
