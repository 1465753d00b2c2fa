"""Vision projectors beside their models: paired by name in the catalog, passed to the runner as --mmproj,
counted in the memory estimate, and shown as the `vision` capability."""

from __future__ import annotations

from dataclasses import replace

from app.gateway.ollama import capabilities
from app.residency.catalog import PROJECTOR_REASON, scan
from app.residency.estimate import estimate_memory
from app.residency.supervisor import RunnerSpec
from tests.residency.test_catalog import write_model


def by_name(entries):
    return {e.name: e for e in entries}


def test_a_projector_pairs_with_the_models_its_name_starts(tmp_path):
    write_model(tmp_path / "gemma-3-4b-it-Q4_K_M.gguf")
    write_model(tmp_path / "gemma-3-4b-it-Q8_0.gguf")
    write_model(tmp_path / "qwen2.5-7b-instruct-Q4_K_M.gguf")
    write_model(tmp_path / "mmproj-gemma-3-4b-it-f16.gguf", architecture="clip")
    entries = by_name(scan(tmp_path, None))
    projector = tmp_path / "mmproj-gemma-3-4b-it-f16.gguf"
    assert entries["gemma-3-4b-it-Q4_K_M"].mmproj == projector
    assert entries["gemma-3-4b-it-Q8_0"].mmproj == projector
    assert entries["qwen2.5-7b-instruct-Q4_K_M"].mmproj is None
    # The projector itself stays listed as unusable, with its reason.
    assert entries["mmproj-gemma-3-4b-it-f16"].unusable_reason == PROJECTOR_REASON


def test_a_bare_projector_pairs_only_with_the_one_model_of_its_folder(tmp_path):
    alone, crowded = tmp_path / "alone", tmp_path / "crowded"
    for folder in (alone, crowded):
        folder.mkdir()
        write_model(folder / "model-Q4_K_M.gguf")
        write_model(folder / "mmproj-F16.gguf", architecture="clip")
    write_model(crowded / "another-Q4_K_M.gguf")
    assert by_name(scan(alone, None))["model-Q4_K_M"].mmproj == alone / "mmproj-F16.gguf"
    assert all(e.mmproj is None for e in scan(crowded, None))


def test_a_removed_projector_unpairs_on_the_next_scan(tmp_path):
    write_model(tmp_path / "llava-Q4_K_M.gguf")
    write_model(tmp_path / "mmproj-llava-f16.gguf", architecture="clip")
    first = scan(tmp_path, None)
    assert by_name(first)["llava-Q4_K_M"].mmproj is not None
    (tmp_path / "mmproj-llava-f16.gguf").unlink()
    assert by_name(scan(tmp_path, None, previous=first))["llava-Q4_K_M"].mmproj is None


def test_the_runner_gets_mmproj_unless_runner_args_choose():
    spec = RunnerSpec(model_name="m", model_path="/models/m.gguf", mmproj="/models/mmproj-m.gguf", threads=2)
    cmd = spec.command(8081)
    assert cmd[cmd.index("--mmproj") + 1] == "/models/mmproj-m.gguf"
    assert "--mmproj" not in replace(spec, extra_args=("--no-mmproj",)).command(8081)
    theirs = replace(spec, extra_args=("--mmproj", "/other.gguf")).command(8081)
    assert theirs.count("--mmproj") == 1 and theirs[theirs.index("--mmproj") + 1] == "/other.gguf"
    stock = replace(spec, kind="llama-server", binary_path="/bin/llama-server").command(8081)
    assert stock[stock.index("--mmproj") + 1] == "/models/mmproj-m.gguf"
    assert "--mmproj" not in replace(spec, mmproj=None).command(8081)


def test_the_estimate_counts_the_projector_and_show_lists_vision(tmp_path):
    write_model(tmp_path / "cam-Q4_K_M.gguf")
    write_model(tmp_path / "mmproj-cam-f16.gguf", architecture="clip")
    entry = by_name(scan(tmp_path, None))["cam-Q4_K_M"]
    with_projector = estimate_memory(entry, 1024, 1)
    without = estimate_memory(replace(entry, mmproj=None), 1024, 1)
    size = (tmp_path / "mmproj-cam-f16.gguf").stat().st_size
    assert with_projector.projector_bytes == size
    assert with_projector.total_bytes == without.total_bytes + size
    fields = {"general.architecture": "llama"}
    assert "vision" in capabilities(fields, None, vision=True)
    assert "vision" not in capabilities(fields, None)
