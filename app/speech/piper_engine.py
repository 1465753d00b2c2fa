"""Piper, imported only here and only in the TTS process: a voice loaded with a thread budget, spoken a sentence
at a time as 16-bit mono PCM.

piper-tts's own PiperVoice.load builds its onnxruntime session with the default options, which take every core;
here the session is built with `threads` intra-op threads (and one inter-op), so synthesis leaves the LLM's
decode the cores the household gave it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

MISSING = ("Piper is not installed: text to speech is the optional extra `tts` (GPL-3.0): "
           "pip install 'hearth[tts]'")


class SpeechUnavailable(Exception):
    """Piper (the tts extra) is not installed here."""


@dataclass
class LoadedVoice:
    """A voice in memory, with what its load cost."""

    name: str
    voice: object  # piper.PiperVoice
    sample_rate: int
    load_s: float


def load(name: str, model: str, config: str, threads: int) -> LoadedVoice:
    """Load a voice's ONNX model with `threads` threads; ValueError for a file onnxruntime cannot read."""
    try:
        import json

        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
    except ImportError:
        raise SpeechUnavailable(MISSING) from None
    started = time.monotonic()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    with open(config, encoding="utf-8") as f:
        piper_config = PiperConfig.from_dict(json.load(f))
    try:
        session = onnxruntime.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own types (Fail, InvalidProtobuf, ...)
        raise ValueError(f"voice '{name}' cannot be loaded: {str(exc).splitlines()[0][:300]}") from None
    voice = PiperVoice(config=piper_config, session=session)
    return LoadedVoice(name=name, voice=voice, sample_rate=piper_config.sample_rate,
                       load_s=time.monotonic() - started)


def sentences(loaded: LoadedVoice, text: str) -> list[list[str]]:
    """The text as Piper's phonemizer splits it: one phoneme list per sentence."""
    return [p for p in loaded.voice.phonemize(text) if p]


def speak(loaded: LoadedVoice, phonemes: list[str], speed: float = 1.0, speaker: int | None = None) -> bytes:
    """One sentence's phonemes as 16-bit little-endian mono PCM at the voice's rate."""
    import numpy as np
    from piper.config import SynthesisConfig

    config = SynthesisConfig(speaker_id=speaker, length_scale=loaded.voice.config.length_scale / speed)
    audio = loaded.voice.phoneme_ids_to_audio(loaded.voice.phonemes_to_ids(phonemes), config)
    if isinstance(audio, tuple):
        audio = audio[0]
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def speak_text(loaded: LoadedVoice, text: str, speed: float = 1.0, speaker: int | None = None) -> Iterator[bytes]:
    """The text, a sentence of PCM at a time."""
    for phonemes in sentences(loaded, text):
        yield speak(loaded, phonemes, speed, speaker)
