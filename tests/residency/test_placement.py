"""Placement as llama.cpp does it, against made-up device lists (two GPUs on a box with none): which device each
layer lands on (-ngl counts the output layer, the last layers go first, --tensor-split or free memory divides them,
--split-mode none keeps them on --main-gpu), tensor overrides (-ot, --cpu-moe, --n-cpu-moe; the first match wins),
the token embedding's copy for a tied output, the KV beside its layer, and the runner's flags for all of it."""

from __future__ import annotations

import re

import pytest

from app.devices import Device
from app.residency.placement import (
    CPU,
    EXPERT_PATTERN,
    TensorOverride,
    layer_devices,
    moe_overrides,
    parse_overrides,
    runner_overrides,
    split_by_device,
    weights_by_device,
)
from app.residency.runner_spec import RunnerSpec

GIB = 1 << 30


def gpu(name: str, free_gib: float, kind: str = "gpu") -> Device:
    return Device(name, name.rstrip("0123456789"), kind, f"made-up {name}", int(16 * GIB), int(free_gib * GIB))


def moe_tensors(n_layer: int = 4) -> list[tuple[str, int]]:
    """A MoE's tensors: 10 bytes of attention and 100 of experts a layer, an embedding of 50 and an output of 40."""
    out = [("token_embd.weight", 50)]
    for i in range(n_layer):
        out += [(f"blk.{i}.attn_q.weight", 10), (f"blk.{i}.ffn_gate_exps.weight", 40),
                (f"blk.{i}.ffn_up_exps.weight", 40), (f"blk.{i}.ffn_down_exps.weight", 20)]
    return out + [("output_norm.weight", 0), ("output.weight", 40)]


def test_ngl_counts_the_output_layer_and_offloads_the_last_layers_first():
    one = [gpu("CUDA0", 8)]
    assert layer_devices(4, 0, one) == [CPU] * 5
    assert layer_devices(4, 1, one) == [CPU] * 4 + ["CUDA0"]  # -ngl 1: the output layer only
    assert layer_devices(4, 3, one) == [CPU, CPU, "CUDA0", "CUDA0", "CUDA0"]
    assert layer_devices(4, 99, one) == layer_devices(4, -1, one) == ["CUDA0"] * 5
    # No GPU: -ngl changes nothing; a CPU-type device is no GPU.
    assert layer_devices(4, 99, []) == [CPU] * 5
    assert layer_devices(4, 99, [Device("CPU", "CPU", "cpu", "cpu", GIB, GIB)]) == [CPU] * 5


def test_two_gpus_share_the_layers_by_free_memory_or_tensor_split():
    two = [gpu("Vulkan0", 12), gpu("Vulkan1", 4)]
    # 9 layers offloaded (8 and the output), 3:1 by free memory: llama.cpp's upper_bound over the split points.
    assert layer_devices(8, 99, two) == ["Vulkan0"] * 7 + ["Vulkan1"] * 2
    assert layer_devices(8, 99, two, tensor_split=(1, 1)) == ["Vulkan0"] * 5 + ["Vulkan1"] * 4
    assert layer_devices(8, 99, two, tensor_split=(0, 1)) == ["Vulkan1"] * 9
    assert layer_devices(8, 99, two, split_mode="none", main_gpu=1) == ["Vulkan1"] * 9
    with pytest.raises(ValueError, match="--main-gpu 2: there are 2 GPUs"):
        layer_devices(8, 99, two, split_mode="none", main_gpu=2)
    with pytest.raises(ValueError, match="--tensor-split has 3 parts for 2 GPUs"):
        layer_devices(8, 99, two, tensor_split=(1, 1, 1))


def test_overrides_move_matching_tensors_and_the_first_rule_wins():
    tensors = moe_tensors()
    devices = layer_devices(4, 99, [gpu("CUDA0", 8)])
    plain = weights_by_device(tensors, 4, devices)
    assert plain == {CPU: 50, "CUDA0": 4 * 110 + 40}
    all_moe = weights_by_device(tensors, 4, devices, moe_overrides(cpu_moe=True))
    assert all_moe == {CPU: 50 + 4 * 100, "CUDA0": 4 * 10 + 40}
    two = weights_by_device(tensors, 4, devices, moe_overrides(n_cpu_moe=2))
    assert two == {CPU: 50 + 2 * 100, "CUDA0": 4 * 10 + 2 * 100 + 40}
    first_wins = [TensorOverride(r"blk\.0\.", "CUDA1"), *moe_overrides(cpu_moe=True)]
    assert weights_by_device(tensors, 4, devices, first_wins)["CUDA1"] == 110


def test_moe_overrides_are_llama_servers_patterns():
    assert moe_overrides(cpu_moe=True) == [TensorOverride(EXPERT_PATTERN, CPU)]
    rules = moe_overrides(n_cpu_moe=2)
    assert [r.flag for r in rules] == [rf"blk\.0{EXPERT_PATTERN}=CPU", rf"blk\.1{EXPERT_PATTERN}=CPU"]
    assert re.search(rules[1].pattern, "blk.1.ffn_down_exps.weight") and not re.search(rules[1].pattern, "blk.11.ffn_down_exps.weight")
    with pytest.raises(ValueError, match="--n-cpu-moe must be 0 or more"):
        moe_overrides(n_cpu_moe=-1)


def test_ot_values_parse_as_llama_server_takes_them():
    assert parse_overrides(r"blk\.[0-3]\.ffn_.*_exps=CPU,attn=Vulkan0") == [
        TensorOverride(r"blk\.[0-3]\.ffn_.*_exps", "CPU"), TensorOverride("attn", "Vulkan0")]
    with pytest.raises(ValueError, match="expected <tensor name pattern>=<buffer type>"):
        parse_overrides("exps")
    with pytest.raises(ValueError, match="no regular expression"):
        parse_overrides("blk[=CPU")


def test_a_tied_output_gets_a_copy_of_the_embedding_on_its_gpu_unless_too_large_for_it():
    tied = [t for t in moe_tensors() if t[0] != "output.weight"]
    devices = layer_devices(4, 1, [gpu("CUDA0", 8)])
    assert weights_by_device(tied, 4, devices) == {CPU: 50 + 4 * 110, "CUDA0": 50}
    assert weights_by_device(tied, 4, devices, max_tensor_bytes={"CUDA0": 49}) == {CPU: 50 + 4 * 110, "CUDA0": 0}


def test_the_split_puts_kv_beside_its_layers_and_compute_on_the_gpu():
    two = [gpu("Vulkan0", 8), gpu("Vulkan1", 8)]
    split = split_by_device(moe_tensors(), 4, kv_bytes=400, compute_bytes=30, gpus=two, n_gpu_layers=3,
                            overrides=moe_overrides(cpu_moe=True))
    # -ngl 3: layers 2, 3 and the output offloaded, split evenly over two GPUs (fractions 0, 1/3 | 2/3).
    assert split.kv == {CPU: 200, "Vulkan0": 200}
    assert split.weights == {CPU: 50 + 2 * 10 + 4 * 100, "Vulkan0": 2 * 10, "Vulkan1": 40}
    assert split.compute == {"Vulkan0": 30} and split.expert_bytes == 400
    assert split.devices == [CPU, "Vulkan0", "Vulkan1"] and split.total("Vulkan0") == 250


def test_runner_args_ot_comes_first_then_the_models_experts():
    rules = runner_overrides(2, ["-ot", "attn=CPU", "--override-tensor=output=CPU"])
    assert [r.pattern for r in rules[:2]] == ["attn", "output"] and len(rules) == 4
    assert runner_overrides(0, ["--cpu-moe"]) == moe_overrides(cpu_moe=True)


@pytest.mark.parametrize("kind", ["hearth", "llama-server"])
def test_the_runner_gets_the_placement_flags_and_defaults_pass_none(kind):
    binary = "/opt/llama-server" if kind == "llama-server" else None
    plain = RunnerSpec("m", "/m.gguf", kind=kind, binary_path=binary)
    assert plain.placement_flag == []
    spec = RunnerSpec("m", "/m.gguf", kind=kind, binary_path=binary, n_cpu_moe=3, devices=("Vulkan0", "Vulkan1"),
                      tensor_split=(3.0, 1.0), split_mode="row", main_gpu=1)
    assert spec.placement_flag == ["--n-cpu-moe", "3", "--device", "Vulkan0,Vulkan1", "--tensor-split", "3,1",
                                   "--split-mode", "row", "--main-gpu", "1"]
    assert RunnerSpec("m", "/m.gguf", n_cpu_moe=-1).placement_flag == ["--cpu-moe"]
    # runner_args naming a flag win over the setting.
    assert RunnerSpec("m", "/m.gguf", n_cpu_moe=3, extra_args=("--cpu-moe",)).placement_flag == []


def test_the_runner_parses_llama_servers_placement_flags():
    from app.cli import build_parser
    from app.runner.command import placement_config

    args = build_parser().parse_args(["runner", "-ot", "attn=CPU", "--n-cpu-moe", "1", "-dev", "Vulkan0,Vulkan1",
                                      "-ts", "3,1", "-sm", "row", "-mg", "1"])
    config = placement_config(args)
    assert config["tensor_overrides"][0] == ("attn", "CPU")
    assert config["tensor_overrides"][1] == (rf"blk\.0{EXPERT_PATTERN}", "CPU")
    assert config["devices"] == ("Vulkan0", "Vulkan1") and config["tensor_split"] == (3.0, 1.0)
    assert (config["split_mode"], config["main_gpu"]) == ("row", 1)
    with pytest.raises(SystemExit, match="expected <tensor name pattern>=<buffer type>"):
        placement_config(build_parser().parse_args(["runner", "-ot", "exps"]))
    with pytest.raises(SystemExit, match="--n-cpu-moe must be 0 or more"):
        placement_config(build_parser().parse_args(["runner", "--n-cpu-moe", "-2"]))
