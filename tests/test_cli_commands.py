"""`hearth` dispatches every subcommand its parser offers from one table, and nothing else."""

import argparse

from app.cli import _COMMANDS, build_parser


def test_every_subcommand_of_the_parser_has_a_handler():
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(top.choices) == set(_COMMANDS)
