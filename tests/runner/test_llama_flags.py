"""`hearth runner` takes every flag the pinned llama-server's `--help` documents (issue 53): each is one of the
runner's own options, or accepted with a one-line notice where ignoring it is harmless, or refused with the reason.

The list comes from the pinned binary itself, so a newer pin that adds a flag fails here until the runner decides
what to do with it. Skipped while the stock llama-server is not built (scripts/build_llama_tools.sh).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from app.cli import build_parser
from app.llama_tools import stock_llama_server, vulkan_llama_server
from app.runner.llama_flags import FLAGS, NOTICE, print_notices

# A --help line: the flag spellings, then their value, left of column 40 (or alone on a longer line).
_FLAG = re.compile(r"(?:^|[\s,])(-{1,2}[A-Za-z0-9][\w.-]*)")


def help_flags(text: str) -> dict[str, str]:
    """Every flag spelling of llama-server's --help, with what follows the spellings (its value, "" for a switch)."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        left = (line[:40] if line[38:40] == "  " else line).strip()
        value = _FLAG.sub("", left).strip(" ,")
        for m in _FLAG.finditer(left):
            out[m.group(1)] = value
    return out


@pytest.fixture(scope="module")
def llama_help() -> str:
    binary = stock_llama_server() or vulkan_llama_server()
    if binary is None:
        pytest.skip("the pinned stock llama-server is not built (scripts/build_llama_tools.sh)")
    done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def _runner_parser():
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions if a.choices and "runner" in a.choices).choices["runner"]


def test_every_flag_of_the_pinned_llama_servers_help_is_taken_or_refused(llama_help):
    flags = help_flags(llama_help)
    options = _runner_parser()._option_string_actions
    tabled = {s: f for f in FLAGS for s in f.spellings}
    missing = sorted(f for f in flags if f not in options)
    assert not missing, f"llama-server flags hearth runner neither takes nor refuses: {missing}"
    notices = sum(1 for f in flags if f in tabled and tabled[f].kind == NOTICE)
    refused = sum(1 for f in flags if f in tabled and tabled[f].kind != NOTICE)
    print(f"\n{len(flags)} flag spellings in the pinned llama-server's --help: {len(flags) - notices - refused} "
          f"implemented by hearth runner, {notices} accepted with a notice, {refused} refused with a reason")
    # The table takes each flag's value as llama-server does (an ignored flag must not swallow the next one).
    for spelling, value in flags.items():
        if spelling in tabled:
            want = 0 if not value else ("?" if value in ("[on|off]", "[on|off|auto]") else
                                        2 if value == "START END" else 1)
            assert tabled[spelling].nargs == want, (spelling, value)
    assert not set(tabled) - set(flags), f"flags the pinned llama-server no longer has: {set(tabled) - set(flags)}"


def test_fit_flags_are_accepted_with_one_notice_each(capsys):
    args = build_parser().parse_args(["runner", "--fit", "off", "--fit-target", "1024", "-fitc", "4096", "-m", "x"])
    assert args.model == "x" and len(args.llama_notices) == 3
    print_notices(args)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" accepted")[0] for line in lines] == ["hearth runner: --fit", "hearth runner: --fit-target",
                                                              "hearth runner: -fitc"]
    assert all("hearth serve fits a runner" in line for line in lines)
    # --fit's value is optional, as llama-server's: the next flag is not taken for it.
    assert build_parser().parse_args(["runner", "--fit", "--ctx", "512"]).ctx == 512


def test_llama_servers_spellings_of_the_runners_own_switches():
    args = build_parser().parse_args(["runner", "-s", "7", "--temperature", "0.5", "-nocb", "-nr", "-rea", "off",
                                      "--no-cache-prompt", "-v"])
    assert (args.seed, args.temp, args.cont_batching, args.repack, args.reasoning, args.prefix_cache,
            args.runner_verbose) == (7, 0.5, False, False, "off", False, True)


def test_a_refused_flag_stops_the_runner_with_its_reason():
    done = subprocess.run([sys.executable, "-m", "app.cli", "runner", "--lora", "adapter.gguf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--lora is not supported: LoRA adapters and control vectors are not supported" in done.stderr
