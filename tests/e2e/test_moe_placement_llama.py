"""A random-weight MoE under stock llama-server -ngl 99 --n-cpu-moe 4: the estimate per device against the buffers
llama.cpp says it placed, within 10 %, on the CPU build and, where the Vulkan build is there (Mesa's lavapipe), with
half the layers' experts in RAM and the rest on Vulkan0."""

from __future__ import annotations

import pytest

from app.devices import Device
from app.devtools.gguf_shapes import make_model
from app.devtools.gpu.moe_bench import BENCH_SHAPE, compare
from app.llama_tools import stock_llama_server, tools_cache_dir
from app.residency.estimate import MIB

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-bench.gguf"
    make_model(BENCH_SHAPE, path)
    return str(path)


def _within(rows, tolerance=0.10):
    for kind, device, mine, theirs in rows:
        assert theirs > 0 and abs(mine - theirs) <= tolerance * theirs, (kind, device, mine, theirs)


def test_the_cpu_estimate_is_what_llama_cpp_placed(moe):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    rows = compare(str(binary), moe, [], ngl=99, n_cpu_moe=4, n_ctx=1024, env={})
    assert {(k, d) for k, d, _, _ in rows} == {("model", "CPU"), ("KV", "CPU")}
    _within(rows)


def test_on_vulkan_the_experts_of_the_first_layers_stay_in_ram(moe):
    binary = tools_cache_dir().with_name(tools_cache_dir().name + "-vulkan") / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("no Vulkan build of llama-server (scripts/build_llama_tools.sh --vulkan)")
    lavapipe = Device("Vulkan0", "Vulkan", "gpu", "llvmpipe", 2048 * MIB, 2048 * MIB, reports_usage=False,
                    max_tensor_bytes=128 * MIB)
    rows = compare(str(binary), moe, [lavapipe], ngl=99, n_cpu_moe=4, n_ctx=1024,
                   env={"GGML_VK_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": str(binary.parent)})
    placed = {(k, d): (mine, theirs) for k, d, mine, theirs in rows}
    assert set(placed) == {("model", "CPU"), ("model", "Vulkan0"), ("KV", "Vulkan0")}
    _within(rows)
