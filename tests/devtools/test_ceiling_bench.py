"""hearth bench ceiling: its table and the CPU it reads of a process tree."""

import os

import psutil

from app.devtools.serving.ceiling_bench import Row, table, tree_cpu_s


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
