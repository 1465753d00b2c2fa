"""BatchBuffer: the llama_batch the engine fills per iteration, checked without a model."""

from __future__ import annotations

import pytest

from app.engine.llama_model import BatchBuffer
from app.engine.request import Request
from app.engine.scheduler import Chunk


def _request(slot: int) -> Request:
    r = Request(prompt_tokens=[1, 2, 3])
    r.slot = slot
    return r


def test_decode_tokens_and_prompt_chunks_land_at_their_positions_with_logits_where_asked():
    buf = BatchBuffer(16)
    chunks = [
        Chunk(_request(0), [7], 10, True),
        Chunk(_request(3), [8], 4, True),
        Chunk(_request(1), [20, 21, 22, 23], 0, False),  # a prompt chunk that does not end the prompt
        Chunk(_request(2), [30, 31], 5, True),
    ]
    batch, logit_idx = buf.fill(chunks)
    assert batch.n_tokens == 8
    assert logit_idx == [0, 1, -1, 7]
    assert [batch.token[i] for i in range(8)] == [7, 8, 20, 21, 22, 23, 30, 31]
    assert [batch.pos[i] for i in range(8)] == [10, 4, 0, 1, 2, 3, 5, 6]
    assert [batch.seq_id[i][0] for i in range(8)] == [0, 3, 1, 1, 1, 1, 2, 2]
    assert [batch.n_seq_id[i] for i in range(8)] == [1] * 8
    assert [batch.logits[i] for i in range(8)] == [1, 1, 0, 0, 0, 0, 0, 1]


def test_a_refill_clears_the_previous_batch_logit_flags_within_the_new_batch():
    buf = BatchBuffer(8)
    buf.fill([Chunk(_request(0), [1, 2, 3, 4], 0, True)])
    batch, idx = buf.fill([Chunk(_request(0), [5], 4, False), Chunk(_request(1), [6], 0, True)])
    assert idx == [-1, 1]
    assert batch.n_tokens == 2
    assert [batch.logits[i] for i in range(batch.n_tokens)] == [0, 1]


def test_more_tokens_than_the_batch_holds_are_refused_before_llama_cpp_sees_them():
    buf = BatchBuffer(4)
    with pytest.raises(ValueError, match="exceeds n_batch 4"):
        buf.fill([Chunk(_request(0), [1, 2, 3], 0, False), Chunk(_request(1), [4, 5], 0, True)])
