"""KV cache types on the real embedded model: llama.cpp allocates what the estimate says (its KV buffer lines), q8_0
is 17/32 of f16's bytes, its next-token distributions stay close to f16's (KL measured), and a hearth runner with
-ctk/-ctv q8_0 answers a raw greedy /completion with stock llama-server's very tokens under the same flags."""

from __future__ import annotations

import pytest

from app.devtools.engine.kv_bench import greedy_against_stock, measure
from app.llama_tools import stock_llama_server

pytestmark = pytest.mark.model


def test_q8_0_kv_is_what_the_estimate_says_and_stays_close_to_f16(gemma_path):
    f16, q8 = measure(str(gemma_path), ["q8_0"], n_ctx=1024, threads=2, n_tokens=48)
    assert (q8.type_k, q8.type_v) == ("q8_0", "q8_0")
    for arm in (f16, q8):
        # The estimate and /props's figure against llama.cpp's buffers (it pads a buffer to its alignment only).
        assert abs(arm.estimate_bytes - arm.measured_bytes) <= 0.01 * arm.measured_bytes
        assert arm.engine_bytes == arm.estimate_bytes
    assert abs(q8.measured_bytes / f16.measured_bytes - 17 / 32) < 0.01
    assert f16.mean_kl == 0.0 and 0.0 < q8.mean_kl < 0.05
    assert q8.top1_agree >= 0.8


def test_a_q8_0_runner_answers_stock_llama_servers_greedy_tokens(gemma_path):
    binary = stock_llama_server()
    if binary is None:
        pytest.skip("stock llama-server is not built (scripts/build_llama_tools.sh)")
    hearth, stock = greedy_against_stock(str(gemma_path), str(binary), "q8_0", threads=2, n_ctx=1024, n_predict=24)
    assert len(hearth) == 24
    assert hearth == stock
