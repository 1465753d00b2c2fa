"""The speculation axis: its arms and labels, the runners it plans and how each is started, the serve arm's settings."""

import json

import pytest

from app.cli import build_parser
from app.residency.runner_spec import RunnerSpec, parse_runner_args
from app.verdict.command import run_from_args
from app.verdict.replay import BenchConfig, plan_for, total_runs
from app.verdict.runners import plan_runners
from app.verdict.scenarios import load_scenario
from app.verdict.spec import (
    DEFAULT_LLAMA_SPEC,
    SpecAxisError,
    is_off,
    label,
    parse_arms,
    runner_spec_type,
    serve_settings,
    split_label,
)

MIB = 1024 * 1024


def test_arms_are_the_models_speculation_settings_checked_in_order():
    assert parse_arms("off, ngram-lookup,off") == ("off", "ngram-lookup")
    assert parse_arms(["none", "auto"]) == ("off", "auto")  # llama-server's word for off
    with pytest.raises(SpecAxisError, match="unknown speculation arm 'draft-simple'; choose from auto, off, ngram-lookup"):
        parse_arms("off,draft-simple")
    with pytest.raises(SpecAxisError, match="no speculation arm"):
        parse_arms(" , ")
    with pytest.raises(SpecAxisError, match="llama-server arm ngram-lookup"):
        parse_arms("off,ngram-lookup", llama=True)


def test_labels_carry_the_arm_and_read_back():
    assert label("continuous", "ngram-lookup") == "continuous+ngram-lookup" and label("serial", None) == "serial"
    assert split_label("llama-server+ngram-map-k") == ("llama-server", "ngram-map-k")
    assert split_label("continuous") == ("continuous", None) and split_label("serve+auto") == ("serve", "auto")
    # A label whose tail is no arm is a name of its own.
    assert split_label("my+server") == ("my+server", None)
    assert is_off(None) and is_off("off") and not is_off("auto")


def test_each_arm_starts_its_runner_with_the_spec_type_it_means():
    assert [runner_spec_type(a, "hearth") for a in (None, "off", "auto", "ngram-mod")] == [
        None, "none", "ngram-lookup", "ngram-mod"]
    # llama-server: auto is its own default (no flag); no ngram-lookup of its own.
    assert [runner_spec_type(a, "llama-server") for a in (None, "off", "auto", "ngram-simple")] == [
        None, "none", None, "ngram-simple"]
    with pytest.raises(SpecAxisError):
        runner_spec_type("ngram-lookup", "llama-server")
    # The command lines the bench's targets get (start_hearth / start_llama_server pass spec_type so).
    hearth = RunnerSpec("m", "/m.gguf", spec_type=runner_spec_type("ngram-lookup", "hearth")).command(8000)
    assert hearth[hearth.index("--spec-type") + 1] == "ngram-lookup"
    plain = RunnerSpec("m", "/m.gguf", spec_type=runner_spec_type(None, "hearth")).command(8000)
    assert "--spec-type" not in plain
    stock = RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path="/bin/llama-server",
                       spec_type=runner_spec_type("ngram-mod", "llama-server")).command(8000)
    assert stock[stock.index("--spec-type") + 1] == "ngram-mod"


def test_a_serve_arm_is_a_runner_args_setting_serve_accepts_and_auto_is_its_default():
    assert serve_settings(None, "gemma") == {} and serve_settings("auto", "gemma") == {}
    off = serve_settings("off", "gemma")
    assert json.loads(off["runner_args"]) == {"gemma": ["--spec-type", "none"]}
    args = parse_runner_args(off["runner_args"])  # the setting's own check passes
    # runner_args' --spec-type wins over the one serve derives from the model's setting (auto).
    spec = RunnerSpec("gemma", "/m.gguf", spec_type="ngram-lookup", extra_args=args["gemma"]).command(8000)
    assert spec.count("--spec-type") == 1 and spec[spec.index("--spec-type") + 1] == "none"
    assert json.loads(serve_settings("ngram-mod", "g")["runner_args"]) == {"g": ["--spec-type", "ngram-mod"]}


def test_each_mode_runs_once_per_arm_and_llama_server_once_per_its_arm():
    p = plan_runners([1], ("continuous",), parallel=2, n_ctx=2048, llama_server=True,
                     spec=("off", "ngram-lookup"), llama_spec=DEFAULT_LLAMA_SPEC)
    (g,) = p.groups
    assert (g.spec, g.llama_spec) == (("off", "ngram-lookup"), DEFAULT_LLAMA_SPEC)
    assert g.runs() == 2 + 4 and g.runs(repeats=3) == 18
    assert g.as_dict()["spec"] == ["off", "ngram-lookup"]
    # Serial is measured once per level, in each arm; two serve arms are two external targets.
    p = plan_runners([1, 2], ("continuous", "serial"), parallel=2, n_ctx=2048, external=2, spec=("off", "auto"))
    assert p.runs() == 2 * (2 + 2 + 2)
    # Without an axis nothing changes.
    assert plan_runners([1], ("continuous",), parallel=2, n_ctx=2048).groups[0].spec == (None,)


def test_the_memory_check_counts_every_arms_runner():
    def runner_bytes(n_ctx, slots):
        return 100 * MIB

    fits = plan_runners([1], ("continuous",), parallel=2, n_ctx=2048, llama_server=True, runner_bytes=runner_bytes,
                        headroom_bytes=600 * MIB, spec=("off", "ngram-lookup"), llama_spec=DEFAULT_LLAMA_SPEC)
    assert fits.groups[0].estimate_bytes == 600 * MIB
    short = plan_runners([1], ("continuous",), parallel=2, n_ctx=2048, llama_server=True, runner_bytes=runner_bytes,
                         headroom_bytes=500 * MIB, spec=("off", "ngram-lookup"), llama_spec=DEFAULT_LLAMA_SPEC)
    assert short.groups == () and "6 runners" in short.skipped[0]


def test_the_bench_config_plans_the_scenarios_arms():
    code = load_scenario("code-edit")
    cfg = BenchConfig(scenario="code-edit", modes=("continuous",), spec=("off", "ngram-lookup"),
                      llama_server="/bin/llama-server", serve=True)
    assert cfg.arms() == ("off", "ngram-lookup") and cfg.llama_arms() == DEFAULT_LLAMA_SPEC
    # 2 hearth arms + 4 llama-server arms + 2 serve arms, one level.
    assert total_runs(cfg, code) == 8
    assert plan_for(cfg, code, check_memory=False).groups[0].external == 2
    assert BenchConfig().arms() == (None,) and BenchConfig().llama_arms() == (None,)


def test_a_bad_arm_on_the_command_line_is_refused_before_anything_starts(capsys):
    args = build_parser().parse_args(["bench", "replay", "--scenario", "code-edit", "--spec", "off,eagle"])
    assert run_from_args(args, "/nonexistent.gguf") == 2
    assert "unknown speculation arm 'eagle'" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "replay", "--scenario", "code-edit", "--llama-spec", "ngram-lookup"])
    assert run_from_args(args, "/nonexistent.gguf") == 2
    assert "llama-server arm ngram-lookup" in capsys.readouterr().err
