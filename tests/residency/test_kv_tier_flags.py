"""hearth serve's runners get the KV tiers' flags: RAM budget, the data volume's folder and the disk budget."""

from pathlib import Path

import pytest

from app.cli import build_parser
from app.residency.catalog import CatalogEntry
from app.residency.runner_spec import RunnerSpec
from app.services.catalog import runner_spec

DEFAULTS = {"ctx": 1024, "parallel": 1, "batch": 512, "threads": 1, "prefix_cache": True, "args": None,
            "cache_ram_mib": 512, "cache_disk_mib": 4096}


def entry(name: str = "gemma") -> CatalogEntry:
    return CatalogEntry(name, Path(f"/models/{name}.gguf"), "folder", 1, 0.0, True)


def parsed(cmd: list[str]):
    """The runner command line as `hearth runner` parses it (an unknown flag would exit)."""
    i = cmd.index("runner")
    return build_parser().parse_args(cmd[i:])


def test_the_catalog_gives_hearth_runners_the_data_volume_s_kv_folder_and_the_budgets(tmp_path):
    spec = runner_spec(entry(), None, DEFAULTS, kv_dir=tmp_path / "kv-cache")
    args = parsed(spec.command(8081))
    assert (args.cache_ram, args.cache_disk, args.cache_disk_mib) == (512, str(tmp_path / "kv-cache"), 4096)


def test_a_disk_budget_of_0_turns_the_disk_tier_off_and_ram_0_the_ram_tier():
    spec = runner_spec(entry(), None, {**DEFAULTS, "cache_disk_mib": 0, "cache_ram_mib": 0}, kv_dir=Path("/data/kv"))
    args = parsed(spec.command(8081))
    assert args.cache_disk is None and args.cache_ram == 0


def test_unset_settings_take_the_runner_s_defaults_and_llama_server_gets_none_of_hearth_s_flags():
    spec = runner_spec(entry(), None, {k: v for k, v in DEFAULTS.items() if not k.startswith("cache_")})
    assert parsed(spec.command(8081)).cache_ram == 2048
    stock = RunnerSpec("m", "/m.gguf", kind="llama-server", binary_path="/bin/llama-server",
                       cache_disk_dir="/data/kv").command(8081)
    assert "--cache-disk" not in stock


@pytest.mark.parametrize("flags, words", [
    (["--cache-ram", "-2"], "--cache-ram must be -1 (no limit), 0 (off) or a size in MiB, not -2"),
    (["--cache-disk", "/tmp/kv", "--cache-disk-mib", "0"], "--cache-disk-mib must be -1 (no limit) or a size in MiB"),
])
def test_a_bad_budget_is_refused_at_start_with_what_to_fix(flags, words):
    from app.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["runner", "--model", "/nonexistent.gguf", *flags])
    assert words in str(exc.value)
