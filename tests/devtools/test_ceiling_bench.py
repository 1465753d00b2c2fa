"""hearth bench ceiling: its table and the CPU it reads of a process tree."""

import os

import psutil

from app.devtools.serving.ceiling_bench import Row, merge_rounds, table, tree_cpu_s


def test_table_gives_the_ratio_to_llama_server_and_cpu_per_1k_tokens():
    rows = [Row("llama-server", 8, 8000.0, 2048, {"llama-server": 2.048}, [7000.0, 8000.0]),
            Row("runner", 8, 6000.0, 2048, {"runner": 4.096}, [6000.0, 5500.0])]
    out = table(rows)
    assert "| llama-server | 8 | 8,000 | 1.00× | 7,000 8,000 | llama-server 1.000 |" in out
    assert "| runner | 8 | 6,000 | 0.75× | 6,000 5,500 | runner 2.000 |" in out


def test_tree_cpu_reads_what_psutil_reads_of_the_process():
    t = psutil.Process(os.getpid()).cpu_times()
    got = tree_cpu_s([os.getpid()])
    assert got >= t.user + t.system
    assert tree_cpu_s([2 ** 22 + 12345]) == 0.0  # no such process: counts zero


def test_rounds_merge_into_the_median_of_their_bests_with_tokens_and_cpu_summed():
    rounds = [[Row("runner", 1, tok_s, 768, {"runner": 1.0}, [tok_s]), Row("runner", 8, 10.0 * tok_s, 6144,
                                                                           {"runner": 2.0}, [10.0 * tok_s])]
              for tok_s in (300.0, 100.0, 200.0)]
    merged = {r.streams: r for r in merge_rounds(rounds)}
    assert merged[1].tok_s == 200.0 and merged[1].runs_tok_s == [300.0, 100.0, 200.0]
    assert merged[1].tokens == 3 * 768 and merged[1].cpu_s == {"runner": 3.0}
    assert merged[8].tok_s == 2000.0 and merged[8].target == "runner"
