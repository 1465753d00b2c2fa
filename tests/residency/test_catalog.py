"""Tests for app.gguf_meta and app.residency.catalog: header facts and unusable files."""

import os
import struct
from dataclasses import replace

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType, LlamaFileType

from app.gguf_meta import GgufArray, GgufError, read_metadata
from app.residency.catalog import SUPPORTED_ARCHITECTURES, CatalogEntry, scan

MIB = 1024 * 1024
# Q8_0 packs 32 weights into 34 bytes (an f16 scale plus 32 int8).
Q8_0_BLOCK_BYTES = 34


def write_model(path, architecture="llama", *, template=None, file_type=LlamaFileType.MOSTLY_Q8_0,
                tensors=True, endianess=gguf.GGUFEndian.LITTLE, split_max_tensors=0, extra=None):
    """Writes a tiny but complete GGUF model: llama-style keys, a vocabulary and a few tensors."""
    writer = gguf.GGUFWriter(path, architecture, endianess=endianess,
                             split_max_tensors=split_max_tensors)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    if file_type is not None:
        writer.add_file_type(file_type)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if template is not None:
        writer.add_chat_template(template)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    if tensors:
        writer.add_tensor("token_embd.weight", np.ones((64, 64), dtype=np.float32))
        writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
        # Two rows of 64 Q8_0 weights: 2 blocks of 34 bytes each per row.
        raw = np.zeros((2, 2 * Q8_0_BLOCK_BYTES), dtype=np.uint8)
        writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Elements and bytes of write_model's tensors: 64×64 + 64 float32, and 2×64 in Q8_0.
TINY_PARAMS = 64 * 64 + 64 + 2 * 64
TINY_WEIGHTS_BYTES = (64 * 64 + 64) * 4 + 2 * 2 * Q8_0_BLOCK_BYTES


@pytest.fixture
def tiny(tmp_path):
    """A valid tiny llama-architecture model in its own folder."""
    return write_model(tmp_path / "tiny.gguf")


def only(entries, name):
    """Returns the single catalog entry called name."""
    matches = [entry for entry in entries if entry.name == name]
    assert len(matches) == 1, [entry.name for entry in entries]
    return matches[0]


# -- gguf_meta ----------------------------------------------------------------------------


def test_read_metadata_of_a_tiny_model(tiny):
    metadata = read_metadata(tiny)
    assert metadata.version == 3 and not metadata.big_endian
    assert metadata.architecture == "llama"
    assert metadata.arch_value("block_count") == 2
    assert metadata.fields["general.file_type"] == LlamaFileType.MOSTLY_Q8_0
    assert metadata.fields["tokenizer.ggml.tokens"] == GgufArray(GGUFValueType.STRING, 64)
    assert metadata.special_token_texts == {1: "<s>", 2: "</s>"}
    assert metadata.token_text(1) == "<s>" and metadata.token_text(99) is None
    assert metadata.token_text(True) is None
    names = {tensor.name: tensor for tensor in metadata.tensors}
    assert names["blk.0.attn_q.weight"].shape == (64, 2)
    assert names["blk.0.attn_q.weight"].ggml_type == GGMLQuantizationType.Q8_0
    assert names["blk.0.attn_q.weight"].n_bytes == 2 * 2 * Q8_0_BLOCK_BYTES
    assert metadata.n_params == TINY_PARAMS
    assert metadata.weights_bytes == TINY_WEIGHTS_BYTES
    assert metadata.data_offset % 32 == 0
    assert metadata.file_size == tiny.stat().st_size


def test_small_arrays_are_decoded_and_long_ones_summarised(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "arrays.gguf", "llama")
    writer.add_array("test.per_layer", [4, 4, 8])
    writer.add_array("test.names", ["a", "b"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.long", list(range(5000)))
    writer.add_string("test.after", "still read")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    fields = read_metadata(tmp_path / "arrays.gguf").fields
    assert fields["test.per_layer"] == (4, 4, 8)
    assert fields["test.names"] == ("a", "b")
    assert fields["test.nested"] == ((1, 2), (3,))
    assert fields["test.long"] == GgufArray(GGUFValueType.INT32, 5000)
    assert fields["test.after"] == "still read"


def test_big_endian_model_is_read(tmp_path):
    metadata = read_metadata(write_model(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG))
    assert metadata.big_endian and metadata.version == 3
    assert metadata.arch_value("embedding_length") == 64
    assert metadata.special_token_texts == {1: "<s>", 2: "</s>"}
    assert metadata.weights_bytes == TINY_WEIGHTS_BYTES


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "empty file"),
    (b"GG", "not a GGUF file"),
    (os.urandom(4096).replace(b"GGUF", b"xxxx"), "not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00\x00", "truncated: the header"),
    (b"GGUF\x01\x00\x00\x00" + bytes(16), "unsupported GGUF version 1"),
    (b"GGUF\x04\x00\x00\x00" + bytes(16), "unsupported GGUF version 4"),
    (b"GGUF\x03\x00\x00\x00" + struct.pack("<QQ", 0, 1 << 40), "corrupt header"),
])
def test_unreadable_files_raise_gguf_error_with_the_reason(tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match=reason):
        read_metadata(path)


def test_unknown_value_type_is_reported(tmp_path):
    path = tmp_path / "odd.gguf"
    key = b"test.key"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path.write_bytes(header + struct.pack("<I", 99) + bytes(8))
    with pytest.raises(GgufError, match="'test.key' has unknown value type 99"):
        read_metadata(path)


@pytest.mark.parametrize(("where", "reason"), [
    ("key/values", "truncated"),
    ("tensor infos", "truncated: the header"),
    ("tensor data", "truncated: tensor data needs"),
])
def test_truncation_anywhere_is_detected(tiny, tmp_path, where, reason):
    metadata = read_metadata(tiny)
    last = max(metadata.tensors, key=lambda tensor: tensor.offset + tensor.n_bytes)
    length = {
        "key/values": 200,
        "tensor infos": metadata.data_offset - 40,
        # One byte short of the last tensor's end (the padding after it is not needed).
        "tensor data": metadata.data_offset + last.offset + last.n_bytes - 1,
    }[where]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:length])
    with pytest.raises(GgufError, match=reason):
        read_metadata(cut)


def test_unknown_tensor_type_is_reported(tiny, tmp_path):
    content = bytearray(tiny.read_bytes())
    name = b"output_norm.weight"
    # Tensor info layout: name, n_dims (u32), dims (u64 each), type (u32), offset (u64).
    at = content.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8
    assert struct.unpack_from("<I", content, at)[0] == GGMLQuantizationType.F32
    struct.pack_into("<I", content, at, 250)
    path = tmp_path / "newtype.gguf"
    path.write_bytes(content)
    with pytest.raises(GgufError, match="ggml type 250"):
        read_metadata(path)


def test_real_gemma_header_without_decoding_its_vocabulary(gemma_path):
    metadata = read_metadata(gemma_path)
    assert metadata.architecture == "gemma3"
    assert metadata.fields["tokenizer.ggml.tokens"] == GgufArray(GGUFValueType.STRING, 262144)
    assert metadata.special_token_texts[2] == "<bos>"
    assert metadata.special_token_texts[1] == "<eos>"
    assert len(metadata.tensors) == 236
    # llama.cpp logs "model size = 235.16 MiB" for this file.
    assert metadata.weights_bytes / MIB == pytest.approx(235.16, abs=0.01)


# -- catalog ------------------------------------------------------------------------------


def test_real_gemma_catalog_entry(gemma_path):
    (entry,) = scan(None, gemma_path)
    assert entry.name == gemma_path.stem
    assert entry.source == "default"
    assert entry.usable and entry.unusable_reason is None
    assert entry.architecture == "gemma3"
    assert entry.n_params == pytest.approx(268e6, rel=0.01)
    assert entry.quantization == "Q4_K_M"
    assert entry.n_ctx_train == 32768
    assert entry.n_layers == 18
    assert entry.n_embd == 640
    assert entry.n_ff == 2048
    assert (entry.n_head, entry.n_head_kv) == (4, 1)
    assert (entry.head_dim_k, entry.head_dim_v) == (256, 256)
    assert entry.n_swa == 512
    assert entry.n_vocab == 262144
    assert entry.has_chat_template is False
    assert entry.size_bytes == gemma_path.stat().st_size
    assert entry.mtime == gemma_path.stat().st_mtime


def test_tiny_model_entry(tiny):
    (entry,) = scan(tiny.parent, None)
    assert entry.name == "tiny" and entry.source == "folder" and entry.usable
    assert entry.architecture == "llama"
    assert entry.quantization == "Q8_0"
    assert entry.n_params == TINY_PARAMS
    assert entry.weights_bytes == TINY_WEIGHTS_BYTES
    assert (entry.n_ctx_train, entry.n_layers, entry.n_embd, entry.n_ff) == (2048, 2, 64, 128)
    assert (entry.n_head, entry.n_head_kv) == (4, 2)
    # No key_length/value_length: llama.cpp's n_embd / n_head.
    assert (entry.head_dim_k, entry.head_dim_v) == (16, 16)
    assert entry.n_swa is None
    assert entry.n_vocab == 64
    assert entry.has_chat_template is False


def test_chat_template_is_noticed(tmp_path):
    write_model(tmp_path / "chatty.gguf", template="{{ messages[0].content }}")
    assert only(scan(tmp_path, None), "chatty").has_chat_template is True


def test_quantisation_falls_back_to_the_type_holding_most_weights(tmp_path):
    write_model(tmp_path / "untyped.gguf", file_type=None)
    write_model(tmp_path / "guessed.gguf", file_type=LlamaFileType.GUESSED)
    entries = scan(tmp_path, None)
    assert only(entries, "untyped").quantization == "F32"
    assert only(entries, "guessed").quantization == "F32"


def test_unusable_files_are_listed_with_their_reason(tiny, tmp_path):
    folder = tiny.parent
    content = tiny.read_bytes()
    (folder / "truncated.gguf").write_bytes(content[: len(content) - 300])
    (folder / "noise.gguf").write_bytes(os.urandom(1000).replace(b"GGUF", b"...."))
    (folder / "empty.gguf").write_bytes(b"")
    write_model(folder / "future.gguf", architecture="notallama9")
    write_model(folder / "mmproj.gguf", architecture="clip")
    write_model(folder / "vocab-only.gguf", tensors=False)
    entries = scan(folder, None)
    reasons = {entry.name: entry.unusable_reason for entry in entries if not entry.usable}
    assert set(reasons) == {"truncated", "noise", "empty", "future", "mmproj", "vocab-only"}
    assert reasons["truncated"].startswith("truncated: tensor data needs")
    assert reasons["noise"].startswith("not a GGUF file")
    assert reasons["empty"] == "empty file, not a GGUF"
    assert reasons["future"] == (
        "architecture 'notallama9' is not supported by the bundled llama.cpp "
        "(llama-cpp-python 0.3.36)"
    )
    assert "vision projector" in reasons["mmproj"]
    assert "no tensors" in reasons["vocab-only"]
    assert only(entries, "tiny").usable
    # Header facts of a readable but unsupported model are still shown.
    assert only(entries, "future").n_layers == 2
    assert only(entries, "noise").size_bytes == 1000


def test_scan_never_raises(tmp_path, gemma_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "folder.gguf").mkdir()
    (folder / "dangling.gguf").symlink_to(tmp_path / "gone.gguf")
    (folder / ".partial.gguf").write_bytes(b"GGUF")
    (folder / "notes.txt").write_text("not a model")
    entries = scan(folder, tmp_path / "missing-default.gguf")
    reasons = {entry.name: entry.unusable_reason for entry in entries}
    assert set(reasons) == {"missing-default", "folder", "dangling"}
    assert entries[0].source == "default"
    assert all("cannot read the file" in reason for reason in reasons.values())
    assert scan(tmp_path / "no-such-folder", gemma_path)[0].usable
    assert scan(None, None) == []


def test_architecture_list_comes_from_llama_cpp():
    assert {"llama", "gemma3", "qwen3", "phi3", "mistral3", "gpt-oss"} <= SUPPORTED_ARCHITECTURES
    assert "clip" not in SUPPORTED_ARCHITECTURES


def test_name_collisions_get_a_suffix(tmp_path):
    default = write_model(tmp_path / "model.gguf")
    folder = tmp_path / "models"
    folder.mkdir()
    write_model(folder / "model.gguf")
    write_model(folder / "model.GGUF")
    entries = scan(folder, default)
    assert [entry.name for entry in entries] == ["model", "model-2", "model-3"]
    assert [entry.source for entry in entries] == ["default", "folder", "folder"]


def test_default_model_inside_the_models_folder_is_listed_once(tiny):
    entries = scan(tiny.parent, tiny)
    assert [(entry.name, entry.source) for entry in entries] == [("tiny", "default")]


def test_split_model_is_served_through_its_first_shard(tmp_path):
    write_model(tmp_path / "big.gguf", split_max_tensors=1)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == [f"big-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    entries = scan(tmp_path, None)
    first = only(entries, "big-00001-of-00003")
    assert first.usable, first.unusable_reason
    assert first.n_params == TINY_PARAMS
    assert first.weights_bytes == TINY_WEIGHTS_BYTES
    assert first.size_bytes == sum(path.stat().st_size for path in tmp_path.iterdir())
    second = only(entries, "big-00002-of-00003")
    assert not second.usable
    assert second.unusable_reason == (
        "shard 2 of 3 of a split model: "
        "it is served through its first shard big-00001-of-00003.gguf"
    )
    (tmp_path / "big-00003-of-00003.gguf").unlink()
    first = only(scan(tmp_path, None), "big-00001-of-00003")
    assert first.unusable_reason == "split model is missing shard big-00003-of-00003.gguf"


def test_unchanged_files_are_not_read_again(tmp_path):
    write_model(tmp_path / "a.gguf")
    write_model(tmp_path / "b.gguf")
    first = scan(tmp_path, None)
    # A marker on the previous entries shows which ones were reused rather than re-read.
    marked = [replace(entry, quantization="from-before") for entry in first]
    write_model(tmp_path / "b.gguf", file_type=LlamaFileType.ALL_F32)
    os.utime(tmp_path / "b.gguf", ns=(0, 10**18))
    again = scan(tmp_path, None, previous=marked)
    assert only(again, "a").quantization == "from-before"
    assert only(again, "b").quantization == "F32"


def test_reused_entries_lose_a_collision_suffix_that_no_longer_applies(tmp_path):
    default = write_model(tmp_path / "model.gguf")
    folder = tmp_path / "models"
    folder.mkdir()
    write_model(folder / "model.gguf")
    first = scan(folder, default)
    assert [entry.name for entry in first] == ["model", "model-2"]
    assert [entry.name for entry in scan(folder, None, previous=first)] == ["model"]


def test_catalog_entries_are_frozen(tiny):
    (entry,) = scan(tiny.parent, None)
    assert isinstance(entry, CatalogEntry)
    with pytest.raises(AttributeError):
        entry.name = "other"
