"""`hearth bench` dispatches every bench its parser offers from the table, and nothing else."""

import argparse

from app.cli import build_parser
from app.devtools.command import _BENCH_STEPS, _BENCHES


def _bench_names() -> set[str]:
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = top.choices["bench"]
    return set(next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_every_bench_of_the_parser_has_one_way_to_run():
    names = _bench_names()
    assert names == set(_BENCHES) | set(_BENCH_STEPS)
    assert not set(_BENCHES) & set(_BENCH_STEPS)
