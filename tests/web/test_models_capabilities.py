"""What each model can do, detected from its own chat template without loading weights: the catalog's
entry, Ollama's /api/show (capabilities and Hearth's format) and the Models page."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import LlamaFileType

from app.gateway.context import services
from app.gateway.tokens import create_token
from app.residency.catalog import scan
from tests.helpers import dashboard_app, set_up_admin

# Qwen3's markers: calls in <tool_call>, thoughts in <think> (llama.cpp reads the same from the template).
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
              "{{ m.reasoning_content }}\n</think>\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if tools %}<tools>{{ tools | tojson }}</tools> answer with <tool_call>{...}</tool_call>{% endif %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def write_gguf(path: Path, template: str | None) -> Path:
    """A tiny, well-formed gemma3 GGUF (the catalog lists it as usable) with `template` as its chat template."""
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_context_length(4096)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "hello"]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    if template is not None:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def models(tmp_path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    write_gguf(folder / "thinker.gguf", QWEN3_LIKE)
    write_gguf(folder / "plain.gguf", PLAIN)
    return folder


def test_the_catalog_detects_format_tools_and_reasoning_from_the_header(models):
    entries = {e.name: e for e in scan(models, None)}
    thinker, plain = entries["thinker"], entries["plain"]
    assert thinker.usable and (thinker.chat_format, thinker.native_tools, thinker.reasoning) == ("hermes", True, True)
    assert (plain.chat_format, plain.native_tools, plain.reasoning) == ("generic", False, False)


@pytest.fixture
def app(tmp_path, models, standin_model):
    with dashboard_app(tmp_path, standin_model) as app:
        with services(app).sessions() as s:
            app.test_token, _ = create_token(s, "alice", "chat")
            s.commit()
        yield app


def _show(app, name: str) -> dict:
    r = app.test_client().post("/api/show", json={"model": name},
                               headers={"Authorization": f"Bearer {app.test_token}"})
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def test_api_show_lists_thinking_and_tools_for_a_reasoning_model_and_names_its_format(app):
    thinker = _show(app, "thinker")
    assert thinker["capabilities"][:3] == ["completion", "tools", "thinking"]
    assert thinker["hearth"] == {"chat_format": "hermes", "native_tools": True, "reasoning": True}
    plain = _show(app, "plain:latest")
    assert "thinking" not in plain["capabilities"] and "tools" not in plain["capabilities"]
    assert plain["hearth"] == {"chat_format": "generic", "native_tools": False, "reasoning": False}


def test_the_models_page_shows_what_each_model_can_do(app):
    admin = app.test_client()
    set_up_admin(admin)
    page = admin.get("/models").get_data(as_text=True)
    card = page[page.index('<h2>thinker</h2>'):]
    card = card[:card.index("</article>")]
    assert "format <code>hermes</code>" in card and ">native</span>" in card and ">reasoning</span>" in card
    card = page[page.index('<h2>plain</h2>'):]
    card = card[:card.index("</article>")]
    assert "format <code>generic</code>" in card and ">generic envelope</span>" in card and ">no reasoning</span>" in card


def test_the_models_page_shows_vision_and_the_paired_projector(tmp_path, standin_model):
    from app.devtools.mmproj import MMPROJ_SHAPES, make_mmproj

    folder = tmp_path / "models"
    folder.mkdir()
    write_gguf(folder / "cam.gguf", PLAIN)
    write_gguf(folder / "plain.gguf", PLAIN)
    projector = folder / "mmproj-cam-f32.gguf"
    make_mmproj(MMPROJ_SHAPES["mmproj-gemma3-tiny"], folder / "cam.gguf", projector)
    with dashboard_app(tmp_path, standin_model) as app:
        admin = app.test_client()
        set_up_admin(admin)
        page = admin.get("/models").get_data(as_text=True)
    card = page[page.index('<h2>cam</h2>'):]
    card = card[:card.index("</article>")]
    assert ">vision</span>" in card and f"projector <code>{projector}</code>" in card
    assert "Vision projector (weights + image compute)" in card
    card = page[page.index('<h2>plain</h2>'):]
    card = card[:card.index("</article>")]
    assert ">text only</span>" in card and "mmproj-plain.gguf" in card and "Vision projector" not in card
