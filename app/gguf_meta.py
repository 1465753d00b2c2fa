"""Reads a GGUF file's header — metadata and tensor infos — without touching the weights.

`gguf.GGUFReader` wraps every vocabulary entry and every tensor in numpy views: about 9 s for
Gemma 3's 262k-token vocabulary. This reader walks the header with `struct` over a read-only
memory map instead: scalars and small arrays are decoded, big arrays (vocabulary, merges,
scores) are only skipped over, and weight pages are never touched. The layout follows
ggml/src/gguf.cpp of the llama.cpp that the pinned llama-cpp-python vendors.
"""

import hashlib
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

# llama.cpp reads v2 and v3 (v3 only added big-endian files); v1 was dropped upstream.
SUPPORTED_VERSIONS = frozenset({2, 3})
# ggml tensors have at most four dimensions (GGML_MAX_DIMS).
MAX_TENSOR_DIMS = 4
# Arrays longer than this are skipped rather than decoded: per-layer arrays (head counts,
# feed-forward sizes) stay well below it, vocabularies and merges are far above it.
MAX_DECODED_ARRAY_ITEMS = 4096

KEY_ARCHITECTURE = "general.architecture"
KEY_ALIGNMENT = "general.alignment"
KEY_TOKENS = "tokenizer.ggml.tokens"
_SPECIAL_TOKEN_PREFIX = "tokenizer.ggml."
_SPECIAL_TOKEN_SUFFIX = "_token_id"

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class GgufError(ValueError):
    """The file is not a GGUF that llama.cpp could read; the message says why."""


@dataclass(frozen=True)
class GgufArray:
    """A metadata array too long to decode (a vocabulary, merges): its item type and length."""

    item_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `shape` is in ggml order (fastest-varying dimension first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GgufMetadata:
    """What a GGUF header says: key/value metadata, tensor infos and where the data lies."""

    path: str
    version: int
    big_endian: bool
    file_size: int
    data_offset: int
    fields: Mapping[str, Any]
    tensors: tuple[TensorInfo, ...]
    # Vocabulary text of every id named by a tokenizer.ggml.*_token_id key (BOS, EOS, PAD…):
    # templates need those strings, and decoding the whole vocabulary is what makes readers slow.
    special_token_texts: Mapping[int, str] = field(default_factory=dict)
    # sha256 of the vocabulary's token strings as stored (tokenizer.ggml.tokens), and the tokenizer's model:
    # two files with the same digest tokenize alike, so one can draft for the other. None without a vocabulary.
    vocab_digest: str | None = None

    @property
    def architecture(self) -> str | None:
        """Returns general.architecture, or None when the file does not name one."""
        value = self.fields.get(KEY_ARCHITECTURE)
        return value if isinstance(value, str) else None

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """Returns the architecture-scoped key `<arch>.<suffix>` (e.g. "block_count")."""
        return self.fields.get(f"{self.architecture}.{suffix}", default)

    @property
    def n_params(self) -> int:
        """Returns the number of weights over all tensors (what llama.cpp reports as n_params)."""
        return sum(tensor.n_elements for tensor in self.tensors)

    @property
    def weights_bytes(self) -> int:
        """Returns the bytes of tensor data, i.e. what loading the weights occupies."""
        return sum(tensor.n_bytes for tensor in self.tensors)

    def token_text(self, token_id: Any) -> str | None:
        """Returns the vocabulary text of a special token id, None if unknown or out of range."""
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            return None
        return self.special_token_texts.get(token_id)


def read_metadata(path: str | PathLike[str]) -> GgufMetadata:
    """Reads a GGUF header; raises GgufError when it is not a complete, readable GGUF."""
    # OSError (missing file, no permission) propagates: it is about access, not the format.
    with open(path, "rb") as file:
        file_size = os.fstat(file.fileno()).st_size
        if file_size == 0:
            raise GgufError("empty file, not a GGUF")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _HeaderWalker(view, os.fspath(path)).metadata()


def read_typed_fields(path: str | PathLike[str]) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """Every key of a GGUF header, decoded in full (vocabularies and merges too), with its value type and, for an
    array, its item type: for tools that copy keys into another GGUF. ~0.2 s for a 151k-token vocabulary and its
    merges, where gguf.GGUFReader takes ~10 s."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise GgufError("empty file, not a GGUF")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            walker = _HeaderWalker(view, os.fspath(path), decode_all=True)
            fields = walker.metadata().fields
    return {key: (value, *walker.types[key]) for key, value in fields.items()}


def projector_modalities(path: str | PathLike[str] | None) -> tuple[bool, bool]:
    """(vision, audio): which encoders a multimodal projector (an mmproj GGUF) has; (False, False) without one.

    A projector that says neither (older files) is a vision one, as clip.cpp reads it."""
    if path is None:
        return False, False
    try:
        fields = read_metadata(path).fields
    except (OSError, GgufError):
        return True, False
    vision, audio = fields.get("clip.has_vision_encoder"), fields.get("clip.has_audio_encoder")
    if vision is None and audio is None:
        return True, False
    return bool(vision), bool(audio)


def audio_projector_type(path: str | PathLike[str] | None) -> str | None:
    """The audio encoder's projector type of an mmproj GGUF as clip.cpp names it ("qwen2a", "ultravox", ...);
    None without a projector, or one that does not say."""
    if path is None:
        return None
    try:
        fields = read_metadata(path).fields
    except (OSError, GgufError):
        return None
    kind = fields.get("clip.audio.projector_type") or fields.get("clip.projector_type")
    return kind if isinstance(kind, str) else None


def read_metadata_prefix(prefix: bytes, file_size: int, name: str) -> GgufMetadata:
    """Reads the header from the first bytes of a GGUF of `file_size` bytes (a download under way);
    raises GgufError, "truncated" while the prefix is too short to hold the whole header."""
    walker = _HeaderWalker(prefix, name, file_size=file_size)
    metadata = walker.metadata()
    if walker._offset > len(prefix):
        raise walker._truncated()
    return metadata


class _HeaderWalker:
    """Sequential reader over a GGUF header: magic, version, key/values, tensor infos."""

    def __init__(self, view: mmap.mmap | bytes, path: str, file_size: int | None = None,
                 decode_all: bool = False) -> None:
        self._view = view
        # Decode long arrays too, and keep each key's (value type, item type) in types (read_typed_fields only).
        self._decode_all = decode_all
        self.types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        self._path = path
        # The file's size; larger than the view when only its first bytes have arrived (a download).
        self._size = len(view) if file_size is None else file_size
        self._end = len(view)
        self._offset = 0
        self._byte_order = "<"

    def metadata(self) -> GgufMetadata:
        """Walks the whole header, turning low-level decoding failures into GgufError."""
        try:
            return self._metadata()
        except struct.error as exc:
            # Every struct read has a fixed size, so the only way one fails is running out.
            raise self._truncated() from exc

    def _truncated(self) -> GgufError:
        """Returns the error for a header that needs more bytes than the file has."""
        return GgufError(
            f"truncated: the header runs past the end of the file ({self._size} bytes)"
        )

    def _metadata(self) -> GgufMetadata:
        """Reads the header in file order and checks the tensor data fits in the file."""
        if self._view[:4] != struct.pack("<I", GGUF_MAGIC):
            raise GgufError(f"not a GGUF file (starts with {bytes(self._view[:4])!r}, not b'GGUF')")
        (version,) = struct.unpack_from("<I", self._view, 4)
        # A big-endian GGUF reads as a huge version number on a little-endian host.
        big_endian = version & 0xFFFF == 0 and version != 0
        if big_endian:
            self._byte_order = ">"
            (version,) = struct.unpack_from(">I", self._view, 4)
        if version not in SUPPORTED_VERSIONS:
            raise GgufError(
                f"unsupported GGUF version {version} (llama.cpp reads versions "
                f"{', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}; re-convert the model)"
            )
        self._offset = 8
        n_tensors = self._read("Q")
        n_keys = self._read("Q")
        # Each entry needs more than 8 bytes, so counts beyond the file size are corruption;
        # checking here keeps a damaged header from looking like a long walk.
        if n_tensors > self._size or n_keys > self._size:
            raise GgufError(
                f"corrupt header: it claims {n_keys} keys and {n_tensors} tensors "
                f"in a {self._size}-byte file"
            )
        fields, tokens_at, tokens_end = self._read_fields(n_keys)
        alignment = fields.get(KEY_ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GgufError(f"{KEY_ALIGNMENT} is {alignment!r}, not a power of two")
        tensors = self._read_tensor_infos(n_tensors)
        data_offset = -(-self._offset // alignment) * alignment
        self._check_data_fits(tensors, data_offset)
        special = self._special_token_texts(fields, tokens_at)
        digest = None
        if tokens_at is not None and tokens_end <= self._end:
            h = hashlib.sha256(str(fields.get("tokenizer.ggml.model")).encode())
            h.update(self._view[tokens_at[0]:tokens_end])
            digest = h.hexdigest()
        return GgufMetadata(
            path=self._path,
            version=version,
            big_endian=big_endian,
            file_size=self._size,
            data_offset=data_offset,
            fields=fields,
            tensors=tensors,
            special_token_texts=special,
            vocab_digest=digest,
        )

    def _read_fields(self, n_keys: int) -> tuple[dict[str, Any], tuple[int, int] | None, int]:
        """Reads every key/value pair; returns them, where the vocabulary's strings start (and how many), and
        where they end."""
        fields: dict[str, Any] = {}
        tokens_at, tokens_end = None, 0
        for _ in range(n_keys):
            key = self._read_string()
            if key in fields:
                raise GgufError(f"corrupt header: duplicate key {key!r}")
            value_type = self._read_value_type(key)
            if key == KEY_TOKENS and value_type == GGUFValueType.ARRAY:
                item_type = self._read_value_type(key)
                count = self._read("Q")
                if item_type == GGUFValueType.STRING:
                    # Remembered so special tokens can be decoded once their ids are known,
                    # which in converted models is usually after the vocabulary.
                    tokens_at = (self._offset, count)
                if self._decode_all:
                    fields[key] = self._read_items(item_type, count, key)
                else:
                    fields[key] = GgufArray(item_type, count)
                    self._skip_array_items(item_type, count)
                tokens_end = self._offset
                if self._decode_all:
                    self.types[key] = (value_type, item_type)
            else:
                item_at = self._offset
                fields[key] = self._read_value(value_type, key)
                if self._decode_all:
                    item_type = None
                    if value_type == GGUFValueType.ARRAY:  # an array's value starts with its item type
                        item_type = GGUFValueType(struct.unpack_from(self._byte_order + "I", self._view, item_at)[0])
                    self.types[key] = (value_type, item_type)
        return fields, tokens_at, tokens_end

    def _read_tensor_infos(self, n_tensors: int) -> tuple[TensorInfo, ...]:
        """Reads name, shape, type and data offset of every tensor."""
        tensors = []
        names = set()
        for _ in range(n_tensors):
            name = self._read_string()
            if name in names:
                raise GgufError(f"corrupt header: duplicate tensor {name!r}")
            names.add(name)
            n_dims = self._read("I")
            if n_dims > MAX_TENSOR_DIMS:
                raise GgufError(f"tensor {name!r} has {n_dims} dimensions (ggml allows 4)")
            shape = tuple(self._read("Q") for _ in range(n_dims))
            raw_type = self._read("I")
            offset = self._read("Q")
            try:
                ggml_type = GGMLQuantizationType(raw_type)
                block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            except (ValueError, KeyError):
                raise GgufError(
                    f"tensor {name!r} has ggml type {raw_type}, unknown to this reader "
                    "(a quantisation newer than the bundled llama.cpp?)"
                ) from None
            n_elements = 1
            for dim in shape:
                n_elements *= dim
            if shape and shape[0] % block_size:
                raise GgufError(
                    f"tensor {name!r}: its first dimension {shape[0]} is not a multiple of "
                    f"{ggml_type.name}'s block size {block_size}"
                )
            n_bytes = n_elements // block_size * type_size
            tensors.append(TensorInfo(name, shape, ggml_type, offset, n_elements, n_bytes))
        return tuple(tensors)

    def _check_data_fits(self, tensors: tuple[TensorInfo, ...], data_offset: int) -> None:
        """Raises GgufError when some tensor's data would lie past the end of the file."""
        if not tensors:
            return
        last = max(tensors, key=lambda tensor: tensor.offset + tensor.n_bytes)
        end = data_offset + last.offset + last.n_bytes
        if end > self._size:
            raise GgufError(
                f"truncated: tensor data needs {end} bytes (up to the end of {last.name!r}) "
                f"but the file has {self._size}"
            )

    def _special_token_texts(
        self, fields: Mapping[str, Any], tokens_at: tuple[int, int] | None
    ) -> dict[int, str]:
        """Decodes the vocabulary entries whose ids the tokenizer.ggml.*_token_id keys name."""
        if tokens_at is None:
            return {}
        start, count = tokens_at
        wanted = {
            value
            for key, value in fields.items()
            if key.startswith(_SPECIAL_TOKEN_PREFIX)
            and key.endswith(_SPECIAL_TOKEN_SUFFIX)
            and isinstance(value, int)
            and not isinstance(value, bool)
            and 0 <= value < count
        }
        if not wanted:
            return {}
        texts = {}
        unpack = struct.Struct(self._byte_order + "Q").unpack_from
        offset = start
        for token_id in range(max(wanted) + 1):
            (length,) = unpack(self._view, offset)
            if token_id in wanted:
                texts[token_id] = self._decode(offset + 8, length)
            offset += 8 + length
        return texts

    def _read(self, code: str) -> Any:
        """Reads one scalar in the file's byte order."""
        (value,) = struct.unpack_from(self._byte_order + code, self._view, self._offset)
        self._offset += struct.calcsize(code)
        return value

    def _read_value_type(self, key: str) -> GGUFValueType:
        """Reads a value-type tag, rejecting numbers that are not GGUF types."""
        raw = self._read("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GgufError(f"corrupt header: key {key!r} has unknown value type {raw}") from None

    def _decode(self, start: int, length: int) -> str:
        """Decodes bytes as UTF-8; invalid sequences are replaced, never fatal."""
        end = start + length
        if end > self._end:
            raise self._truncated()
        return self._view[start:end].decode("utf-8", errors="replace")

    def _read_string(self) -> str:
        """Reads a length-prefixed string."""
        length = self._read("Q")
        text = self._decode(self._offset, length)
        self._offset += length
        return text

    def _read_value(self, value_type: GGUFValueType, key: str) -> Any:
        """Reads a scalar, a string, or an array (a GgufArray summary when it is long)."""
        if value_type == GGUFValueType.STRING:
            return self._read_string()
        if value_type != GGUFValueType.ARRAY:
            return self._read(_SCALAR_FORMATS[value_type])
        item_type = self._read_value_type(key)
        count = self._read("Q")
        if count > MAX_DECODED_ARRAY_ITEMS and not self._decode_all:
            self._skip_array_items(item_type, count)
            return GgufArray(item_type, count)
        return self._read_items(item_type, count, key)

    def _read_items(self, item_type: GGUFValueType, count: int, key: str) -> tuple:
        """Decodes `count` array items of one type."""
        if item_type in _SCALAR_FORMATS:
            code = _SCALAR_FORMATS[item_type]
            values = struct.unpack_from(
                f"{self._byte_order}{count}{code}", self._view, self._offset
            )
            self._offset += count * struct.calcsize(code)
            return values
        return tuple(self._read_value(item_type, key) for _ in range(count))

    def _skip_array_items(self, item_type: GGUFValueType, count: int) -> None:
        """Moves past `count` array items without decoding them."""
        if item_type == GGUFValueType.STRING:
            unpack = struct.Struct(self._byte_order + "Q").unpack_from
            view = self._view
            offset = self._offset
            for _ in range(count):
                offset += 8 + unpack(view, offset)[0]
            self._offset = offset
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(count):
                self._skip_array_items(self._read_value_type("array item"), self._read("Q"))
        else:
            self._offset += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        if self._offset > self._end:
            raise self._truncated()
