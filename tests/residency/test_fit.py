"""The fit, against made-up device lists: every layer on the GPU when it fits; the KV cache in q8_0 before a smaller
context where the admin chose no type; an unset context shrunk to fit; a MoE's experts kept in RAM for the first
layers; whole layers from the back for a dense model; two GPUs each within its budget; the CPU when there is no GPU;
and placing a model on the GPU with room."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.residency.catalog import scan
from app.residency.fit import attention_peak_bytes, fit_runner, place_on
from app.residency.placement import CPU, model_tensors

MIB = 1 << 20


def gpu(name: str, mib: int, free_mib: int | None = None, reports_usage: bool = True) -> Device:
    free = mib if free_mib is None else free_mib
    return Device(name, "Vulkan", "gpu", f"made-up {name}", mib * MIB, free * MIB, reports_usage)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "dense.gguf"
    # About 10 MiB of weights over 8 layers, 8 KiB of KV a cell in f16.
    make_model(replace(SHAPES["tiny"], name="dense", n_vocab=1024, n_embd=256, n_layer=8, n_head=4, n_head_kv=2,
                       n_ff=1024, n_ctx_train=32768), path)
    return scan(None, path)[0], model_tensors(path)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "moe.gguf"
    make_model(replace(SHAPES["qwen3moe-tiny"], n_vocab=1024, n_embd=256, n_layer=8, n_expert=16, n_ff_exp=256,
                       n_ctx_train=32768), path)
    return scan(None, path)[0], model_tensors(path)


def test_without_a_gpu_the_model_runs_on_the_cpu(dense):
    entry, tensors = dense
    choice = fit_runner(entry, tensors, [Device("CPU", "CPU", "cpu", "cpu", 8 << 30, 8 << 30)], parallel=1)
    assert choice.n_gpu_layers == 0 and choice.reason == "no GPU: the model runs on the CPU"
    assert choice.type_k == "f16" and choice.n_ctx == 32768


def test_a_model_that_fits_goes_whole_at_its_context(dense):
    entry, tensors = dense
    choice = fit_runner(entry, tensors, [gpu("Vulkan0", 4096)], parallel=1, n_ctx=8192)
    assert (choice.n_gpu_layers, choice.n_ctx, choice.type_k) == (9, 8192, "f16")
    assert choice.split.weights.get(CPU, 0) == dict(tensors)["token_embd.weight"]  # the input layer stays in RAM
    assert "every layer on the GPU" in choice.reason


def test_q8_0_kv_comes_before_a_smaller_context_and_an_admins_type_stands(dense):
    entry, tensors = dense
    # A GPU with room for the whole model at 32768 cells with a q8_0 KV cache, not with f16's.
    need = {kv: fit_runner(entry, tensors, [gpu("Vulkan0", 8192)], parallel=1, kv_type=kv).split.total("Vulkan0")
            for kv in ("f16", "q8_0")}
    assert need["q8_0"] < need["f16"]
    dev = [gpu("Vulkan0", 1024 + (need["f16"] + need["q8_0"]) // 2 // MIB)]
    choice = fit_runner(entry, tensors, dev, parallel=1)
    assert (choice.n_gpu_layers, choice.n_ctx, choice.type_k, choice.type_v) == (9, 32768, "q8_0", "q8_0")
    assert "the KV cache in q8_0 (f16 would not fit)" in choice.reason
    kept = fit_runner(entry, tensors, dev, parallel=1, kv_type="f16")
    assert kept.type_k == "f16" and kept.n_gpu_layers == 9 and 4096 <= kept.n_ctx < 32768
    assert "the context shrunk from 32,768" in kept.reason
    assert kept.split.total("Vulkan0") <= kept.budgets["Vulkan0"]


def test_a_dense_model_too_big_gets_whole_layers_from_the_back(dense):
    entry, tensors = dense
    whole = fit_runner(entry, tensors, [gpu("Vulkan0", 8192)], parallel=1, n_ctx=4096).split.total("Vulkan0")
    half = [gpu("Vulkan0", 1024 + whole // MIB // 2)]
    choice = fit_runner(entry, tensors, half, parallel=1, n_ctx=4096)
    assert 0 < choice.n_gpu_layers < 9 and choice.n_cpu_moe == 0
    assert choice.split.total("Vulkan0") <= choice.budgets["Vulkan0"]
    assert f"-ngl {choice.n_gpu_layers}" in choice.reason


def test_a_moe_keeps_the_experts_of_its_first_layers_in_ram(moe):
    entry, tensors = moe
    whole = fit_runner(entry, tensors, [gpu("Vulkan0", 8192)], parallel=1, n_ctx=4096)
    need = whole.split.total("Vulkan0")
    choice = fit_runner(entry, tensors, [gpu("Vulkan0", 1024 + need // MIB // 2)], parallel=1, n_ctx=4096)
    assert choice.n_gpu_layers == 9 and 0 < choice.n_cpu_moe < 8
    assert f"--n-cpu-moe {choice.n_cpu_moe}" in choice.reason
    assert choice.split.total("Vulkan0") <= choice.budgets["Vulkan0"]


def test_two_gpus_each_stay_within_their_budget(dense):
    entry, tensors = dense
    whole = fit_runner(entry, tensors, [gpu("Vulkan0", 8192)], parallel=1, n_ctx=4096).split.total("Vulkan0")
    two = [gpu("Vulkan0", 1024 + whole // MIB // 2), gpu("Vulkan1", 1024 + whole // MIB // 4)]
    choice = fit_runner(entry, tensors, two, parallel=1, n_ctx=4096)
    assert 0 < choice.n_gpu_layers < 9
    for name in ("Vulkan0", "Vulkan1"):
        assert choice.split.total(name) <= choice.budgets[name]


def test_a_model_goes_to_the_gpu_with_room():
    devices = [gpu("Vulkan0", 8192, free_mib=1000), gpu("Vulkan1", 8192, free_mib=3000),
               Device("CPU", "CPU", "cpu", "cpu", 64 << 30, 64 << 30)]
    assert place_on(devices, {"GPU": 2000 * MIB}) == "Vulkan1"
    assert place_on(devices, {"GPU": 500 * MIB}) == "Vulkan1"  # the most room
    assert place_on(devices, {"GPU": 4000 * MIB}) is None
    # A device that reports no usage (lavapipe) is charged what Hearth placed on it.
    lava = [gpu("Vulkan0", 2048, reports_usage=False)]
    assert place_on(lava, {"GPU": 1500 * MIB}) == "Vulkan0"
    assert place_on(lava, {"GPU": 1500 * MIB}, used={"Vulkan0": 1000 * MIB}) is None


def test_without_flash_attention_the_fit_never_quantizes_the_kv_cache(dense):
    entry, tensors = dense
    # The same GPU as above, where q8_0 would have fitted the whole context: a runner without flash attention (on
    # lavapipe) could not start with a quantized V, so the fit keeps f16 and shrinks the context instead.
    need = {kv: fit_runner(entry, tensors, [gpu("Vulkan0", 8192)], parallel=1, kv_type=kv).split.total("Vulkan0")
            for kv in ("f16", "q8_0")}
    dev = [gpu("Vulkan0", 1024 + (need["f16"] + need["q8_0"]) // 2 // MIB)]
    choice = fit_runner(entry, tensors, dev, parallel=1, flash_attn=False)
    assert (choice.type_k, choice.type_v) == ("f16", "f16") and choice.n_ctx < 32768


@pytest.mark.parametrize("n_head, n_embd, cells, measured_mib", [
    (16, 1024, 2048, 77.06), (16, 1024, 3072, 111.06), (16, 1024, 4096, 145.06), (16, 2048, 4096, 152.25)])
def test_the_attention_peak_holds_what_llama_cpp_reserved_on_lavapipe(n_head, n_embd, cells, measured_mib):
    # "Vulkan0 compute buffer size" of llama-server -fa off, 512-token micro-batch (random weights, lavapipe).
    estimate = attention_peak_bytes(n_head, n_embd, cells, 512) / MIB
    assert measured_mib <= estimate <= measured_mib * 1.02
