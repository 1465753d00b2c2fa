"""KV cache types (-ctk/-ctv): the table of sizes, the check a quantized V needs, the estimate in each type,
the runner's flags for either kind (none for f16: defaults unchanged) and runner_args winning over the setting."""

from __future__ import annotations

import pytest

from app.cli import build_parser
from app.engine.kv_types import KV_TYPE_BYTES, KV_TYPES, kv_type_problem
from app.residency.estimate import estimate_memory, kv_bytes_per_cell, size_runner
from app.residency.runner_spec import RunnerSpec
from tests.residency.test_estimate import MIB, synthetic


def test_the_types_are_llama_servers_and_their_sizes_ggmls_blocks():
    assert KV_TYPES == ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
    # q8_0: 32 int8 and an f16 scale per block, 17/32 of f16's two bytes a value; q4_0: 16 bytes and the scale.
    assert KV_TYPE_BYTES["q8_0"] / KV_TYPE_BYTES["f16"] == 17 / 32
    assert KV_TYPE_BYTES["q4_0"] / KV_TYPE_BYTES["f16"] == 9 / 32


def test_a_quantized_v_needs_flash_attention_and_unknown_names_are_named():
    assert kv_type_problem("q8_0", "q8_0", "auto") is None
    assert kv_type_problem("q8_0", "f16", "off") is None  # a quantized K alone works without flash attention
    assert "needs flash attention" in kv_type_problem("f16", "q8_0", "off")
    assert "-ctk 'q9'" in kv_type_problem("q9", "f16") and "q8_0" in kv_type_problem("q9", "f16")


def test_the_estimate_counts_k_and_v_each_in_its_type():
    e = synthetic()  # 32 layers, 8 KV heads, head size 128
    f16 = estimate_memory(e, 4096, 4)
    q8 = estimate_memory(e, 4096, 4, type_k="q8_0", type_v="q8_0")
    assert q8.kv_bytes == f16.kv_bytes * 17 // 32
    assert f16.total_bytes - q8.total_bytes == f16.kv_bytes - q8.kv_bytes
    mixed = estimate_memory(e, 4096, 4, type_k="q8_0", type_v="f16")
    assert mixed.kv_bytes == (f16.kv_bytes + q8.kv_bytes) // 2
    assert kv_bytes_per_cell(e) == 32 * 8 * 256 * 2
    # A smaller cache lets the sizing give more slots where f16 does not fit them.
    budget = 2 * 1024 * MIB
    assert size_runner(e, budget, type_k="q4_0", type_v="q4_0").parallel >= size_runner(e, budget).parallel


@pytest.mark.parametrize("kind", ["hearth", "llama-server"])
def test_the_runner_gets_ctk_ctv_and_f16_passes_no_flag(kind):
    binary = "/opt/llama-server" if kind == "llama-server" else None
    plain = RunnerSpec("m", "/m.gguf", kind=kind, binary_path=binary)
    assert plain.kv_type_flag == [] and not {"-ctk", "-ctv"} & set(plain.command(8081))
    q8 = RunnerSpec("m", "/m.gguf", kind=kind, binary_path=binary, cache_type_k="q8_0", cache_type_v="q8_0")
    cmd = q8.command(8081)
    assert cmd[cmd.index("-ctk") + 1] == "q8_0" and cmd[cmd.index("-ctv") + 1] == "q8_0"
    assert q8.kv_types == ("q8_0", "q8_0")


def test_runner_args_naming_the_flags_win_and_the_estimate_follows_them():
    spec = RunnerSpec("m", "/m.gguf", cache_type_k="q8_0", cache_type_v="q8_0",
                      extra_args=("--cache-type-k", "q4_0"))
    cmd = spec.command(8081)
    assert "-ctk" not in cmd and cmd[cmd.index("--cache-type-k") + 1] == "q4_0"
    assert cmd[cmd.index("-ctv") + 1] == "q8_0"
    assert spec.kv_types == ("q4_0", "q8_0")
    # A name the runner will refuse is not counted as a type: the setting's stands in the estimate.
    assert RunnerSpec("m", "/m.gguf", extra_args=("-ctv=q9",)).kv_types == ("f16", "f16")


def test_the_runner_parses_llama_servers_spellings():
    args = build_parser().parse_args(["runner", "-ctk", "q8_0", "--cache-type-v", "q4_0"])
    assert (args.cache_type_k, args.cache_type_v) == ("q8_0", "q4_0")
    defaults = build_parser().parse_args(["runner"])
    assert (defaults.cache_type_k, defaults.cache_type_v) == ("f16", "f16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["runner", "-ctk", "q9"])


def test_the_runner_refuses_a_quantized_v_without_flash_attention():
    from app.cli import main

    with pytest.raises(SystemExit, match="-ctv q8_0 needs flash attention"):
        main(["runner", "-ctv", "q8_0", "-fa", "off"])
