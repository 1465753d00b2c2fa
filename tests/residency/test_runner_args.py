"""The runner_args setting: per-model extra runner arguments, validated, reaching the runner's command line."""

import pytest

from app.residency.runner_spec import RunnerSpec, parse_runner_args, runner_args_problem
from app.store.settings import Invalid, validate


def test_a_models_arguments_are_read_in_order():
    assert parse_runner_args('{"qwen3": ["--grammar-file", "/g.gbnf"], "other": []}') == {
        "qwen3": ("--grammar-file", "/g.gbnf"), "other": ()}
    assert parse_runner_args(None) == {} and parse_runner_args("  ") == {}


@pytest.mark.parametrize("text, words", [
    ("not json", "is JSON"),
    ('["--x"]', "an object of model name"),
    ('{"m": "--reasoning-format none"}', "a list of strings"),
    ('{"m": ["none"]}', "must be a flag"),
    ('{"m": ["--port", "9"]}', "--port is set by hearth serve"),
    ('{"m": ["--ctx-size=99"]}', "--ctx-size is set by hearth serve"),
    ('{"m": ["--x"' + ', "y"' * 64 + ']}', "at most 64 arguments"),
])
def test_a_wrong_value_is_refused_by_what_is_wrong(text, words):
    assert words in runner_args_problem(text)
    with pytest.raises(Invalid, match="runner_args"):
        validate("runner_args", text)


def test_the_arguments_end_the_runner_command_of_either_kind():
    args = ("--reasoning-format", "none")
    hearth = RunnerSpec("m", "/m.gguf", extra_args=args).command(8081)
    stock = RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path="/bin/llama-server", extra_args=args).command(8081)
    assert tuple(hearth[-2:]) == args and tuple(stock[-2:]) == args


def test_the_catalog_gives_a_model_its_own_arguments_and_no_one_elses():
    from pathlib import Path

    from app.residency.catalog import CatalogEntry
    from app.services.catalog import runner_spec

    defaults = {"ctx": 1024, "parallel": 1, "batch": 512, "threads": 1, "prefix_cache": True,
                "args": '{"qwen3": ["--grammar-file", "/g/qwen3.gbnf"]}'}

    def entry(name):
        return CatalogEntry(name, Path(f"/models/{name}.gguf"), "folder", 1, 0.0, True)

    assert runner_spec(entry("qwen3"), None, defaults).extra_args == ("--grammar-file", "/g/qwen3.gbnf")
    assert runner_spec(entry("gemma"), None, defaults).extra_args == ()
    assert runner_spec(entry("gemma"), None, {**defaults, "args": None}).extra_args == ()
