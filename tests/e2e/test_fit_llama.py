"""Hearth's fit against llama-server's --fit on Mesa's lavapipe (a fixed 2 GiB Vulkan device), for a model that
does not fit whole: with llama-server's margin, Hearth offloads at least 90 % of the layers llama-server chooses,
and llama-server started with Hearth's choice places on the device the weights and KV Hearth's split says (within
10 %) and holds within the budget, its compute buffer (attention scores without flash attention) included."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.devtools.gpu.fit_bench import hearth_holds, llama_fit
from app.llama_tools import tools_cache_dir
from app.residency.catalog import scan
from app.residency.estimate import MIB
from app.residency.fit import fit_runner
from app.residency.placement import model_tensors

pytestmark = pytest.mark.model


# 1792: a 256 MiB budget, where Hearth took 4 layers to llama-server's 5 (80 %) while it counted the mask in f16 and
# 8 rows beside the scores (148 MiB of compute against 145.06 measured).
@pytest.mark.parametrize("target", [1664, 1792])
def test_hearths_fit_offloads_what_llama_servers_does_and_holds(tmp_path, target):
    binary = tools_cache_dir().with_name(tools_cache_dir().name + "-vulkan") / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("no Vulkan build of llama-server (scripts/build_llama_tools.sh --vulkan)")
    # About 300 MiB of q8_0 weights over 16 layers: a 1,664 MiB --fit-target leaves 384 MiB, part of the model.
    path = tmp_path / "dense.gguf"
    make_model(replace(SHAPES["llama-3.2-1b"], name="fit-test", n_vocab=32000, n_layer=16, n_embd=1024, n_head=16,
                       n_head_kv=4, n_ff=4096, n_ctx_train=8192), path)
    env = {"GGML_VK_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": str(binary.parent)}
    theirs = llama_fit(str(binary), str(path), target, env)
    assert 0 < theirs["ngl"] < 17, theirs
    lavapipe = Device("Vulkan0", "Vulkan", "gpu", "llvmpipe", 2048 * MIB, 2048 * MIB, reports_usage=False,
                    max_tensor_bytes=128 * MIB)
    mine = fit_runner(scan(None, path)[0], model_tensors(path), [lavapipe], parallel=1, margin_bytes=target * MIB,
                      kv_type="f16", flash_attn=False)
    assert mine.fits and mine.n_gpu_layers >= 0.9 * theirs["ngl"]
    assert mine.n_ctx >= 0.9 * theirs["n_ctx"]
    placed = hearth_holds(str(binary), str(path), mine, env)
    for kind, mine_bytes in (("model", mine.split.weights["Vulkan0"]), ("KV", mine.split.kv["Vulkan0"])):
        theirs_bytes = placed[kind]["Vulkan0"]
        assert abs(mine_bytes - theirs_bytes) <= 0.1 * theirs_bytes, (kind, mine_bytes, theirs_bytes)
    on_device = sum(v for kind in placed.values() for k, v in kind.items() if k != "CPU")
    assert mine.split.total("Vulkan0") <= mine.budgets["Vulkan0"] and on_device <= (2048 - target) * MIB
