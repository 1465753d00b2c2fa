"""The image's other accelerators, built by the real engine like the CPU image (tests/appliance/test_container_engine.py):
the Vulkan image, whose runner and stock llama-server run the GPU tier's greedy check on Mesa's lavapipe inside the
container; and the CUDA image, as far as a box that cannot reach the hub's nvidia/cuda images can take it."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from app.devtools import container as engine

pytestmark = [pytest.mark.container, pytest.mark.model]
REPO = engine.REPO
VULKAN_IMAGE = yaml.safe_load((REPO / "compose.vulkan.yaml").read_text())["services"]["hearth"]["image"]


def test_the_vulkan_image_runs_the_greedy_check_on_lavapipe_inside_the_container(engine_bases):
    log = Path(tempfile.gettempdir()) / "hearth-image-build-vulkan.log"
    seconds = engine.build(REPO, VULKAN_IMAGE, build_args={**engine_bases, "ACCEL": "vulkan"}, log_path=log)
    print(f"[container] {VULKAN_IMAGE} built in {seconds:.0f} s; size {engine.image_size_bytes(VULKAN_IMAGE) / 1e6:.0f} MB")
    # lavapipe is a CPU device, which ggml skips unless named (GGML_VK_VISIBLE_DEVICES): a real GPU needs /dev/dri
    # (compose.vulkan.yaml) and nothing else. `hearth bench vulkan` exits 1 when a check misses.
    done = engine.docker("run", "--rm", "-e", "GGML_VK_VISIBLE_DEVICES=0", VULKAN_IMAGE, "hearth", "bench", "vulkan",
                         check=False, timeout=1200)
    out = done.stdout
    print(out)
    assert done.returncode == 0, (out + done.stderr)[-4000:]
    assert "llvmpipe" in out and re.search(r"offloaded layers: (\d+)/\1\b", out)
    assert "greedy tokens equal to stock llama-server (Vulkan): 5 of 5 prompts" in out
    assert "after freeing 0 B" in out


def test_the_cuda_image_builds_up_to_the_hubs_cuda_base_and_stops_there_saying_so(engine_bases):
    """Every CUDA stage starts from nvidia/cuda (the toolkit and its runtime libraries are NVIDIA's to ship), which has
    no local stand-in: the stages every accelerator shares are built with ACCEL=cuda, then the image's own build is
    shown to stop at that base, and at nothing before it."""
    if not any(arg in engine_bases for arg in ("PYTHON_IMAGE", "NODE_IMAGE")):
        pytest.skip("the hub is reachable here: the CUDA image builds as the README says (a long compile)")
    for target in ("assets", "requirements"):
        engine.build(REPO, f"hearth-cuda-{target}:test", build_args={**engine_bases, "ACCEL": "cuda"}, target=target)
    with pytest.raises(RuntimeError) as failed:
        engine.build(REPO, "hearth-cuda:test", build_args={**engine_bases, "ACCEL": "cuda"}, timeout_s=600)
    message = str(failed.value)
    args = engine.dockerfile_args()
    cuda_bases = {f"docker.io/{args[a]}" for a in ("CUDA_DEVEL_IMAGE", "CUDA_RUNTIME_IMAGE")}
    assert {m for m in re.findall(r"load metadata for (\S+)", message)} & cuda_bases, message
