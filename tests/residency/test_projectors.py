"""Vision projectors beside their models: paired by name in the catalog, passed to the runner as --mmproj,
counted in the memory estimate, and shown as the `vision` capability."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.devtools.mmproj import MmprojShape, make_mmproj
from app.gateway.ollama import capabilities
from app.residency.catalog import PROJECTOR_REASON, scan
from app.residency.estimate import (
    IMAGE_BYTES_PER_PIXEL,
    MIB,
    MTMD_CONTEXT_BYTES,
    estimate_memory,
    projector_compute_bytes,
    vision_facts,
)
from app.residency.runner_spec import RunnerSpec
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
    # A header without a vision tower's keys: no compute term to derive, only the file.
    assert with_projector.projector_compute_bytes == 0
    assert with_projector.total_bytes == without.total_bytes + size
    fields = {"general.architecture": "llama"}
    assert "vision" in capabilities(fields, None, vision=True)
    assert "vision" not in capabilities(fields, None)


# Two of the calibration's towers (app/residency/estimate.py's docstring) and the buffer stock llama-server logged.
PATCH_BOUND = MmprojShape("wide-image", image_size=896, patch_size=14, n_embd=128, n_ff=256, n_layer=1, n_head=4)
BLOCK_BOUND = MmprojShape("wide-tower", image_size=448, patch_size=14, n_embd=512, n_ff=2048, n_layer=1, n_head=8)


@pytest.mark.parametrize(("shape", "logged_mib"), [(PATCH_BOUND, 13.78), (BLOCK_BOUND, 13.25)])
def test_the_projectors_compute_comes_from_its_header(tmp_path, shape, logged_mib):
    model = write_model(tmp_path / "cam-Q4_K_M.gguf")
    projector = tmp_path / "mmproj-cam-f32.gguf"
    make_mmproj(shape, model, projector)
    facts = vision_facts(projector)
    assert (facts.image_size, facts.patch_size, facts.n_embd, facts.n_ff, facts.n_layer) == (
        shape.image_size, shape.patch_size, shape.n_embd, shape.n_ff, shape.n_layer)
    compute = projector_compute_bytes(projector, 64)
    buffer = compute - MTMD_CONTEXT_BYTES - IMAGE_BYTES_PER_PIXEL * shape.image_size**2
    assert buffer / MIB == pytest.approx(logged_mib, rel=0.02)
    entry = by_name(scan(tmp_path, None))["cam-Q4_K_M"]
    with_projector = estimate_memory(entry, 1024, 1)
    without = estimate_memory(replace(entry, mmproj=None), 1024, 1)
    assert with_projector.projector_compute_bytes == compute
    assert with_projector.total_bytes == without.total_bytes + projector.stat().st_size + compute
    # A bigger image needs more: the estimate follows the header, not a constant.
    bigger = tmp_path / "bigger" / "mmproj-cam-f32.gguf"
    bigger.parent.mkdir()
    make_mmproj(replace(shape, image_size=shape.image_size * 2), model, bigger)
    assert projector_compute_bytes(bigger, 64) > compute


def test_image_url_fetching_reaches_a_vision_runner_only_when_the_setting_is_on(tmp_path):
    from app.services.catalog import RUNNER_DEFAULTS, runner_spec

    write_model(tmp_path / "cam-Q4_K_M.gguf")
    write_model(tmp_path / "mmproj-cam-f16.gguf", architecture="clip")
    write_model(tmp_path / "text-Q4_K_M.gguf")
    entries = by_name(scan(tmp_path, None))
    defaults = {k: None for k in RUNNER_DEFAULTS} | {"batch": 512, "threads": 2}
    assert "--image-url-fetch" not in runner_spec(entries["cam-Q4_K_M"], None, defaults).command(8081)
    on = defaults | {"image_url_fetch": True, "image_url_hosts": "camera.lan"}
    cmd = runner_spec(entries["cam-Q4_K_M"], None, on).command(8081)
    assert "--image-url-fetch" in cmd and cmd[cmd.index("--image-url-hosts") + 1] == "camera.lan"
    # A model without a projector takes no images: nothing to fetch for.
    assert "--image-url-fetch" not in runner_spec(entries["text-Q4_K_M"], None, on).command(8081)
