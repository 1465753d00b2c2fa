"""Ogg Opus through libsndfile (the system's libsndfile.so.1, built with libopus and libogg), by ctypes: written to
memory through libsndfile's virtual I/O, so each page can be sent as soon as it is written; and read back (frames,
rate), for checks. No Python binding is needed, and no command-line encoder."""

from __future__ import annotations

import ctypes
import os
import tempfile
from functools import cache

SF_FORMAT_OGG = 0x200000
SF_FORMAT_OPUS = 0x0064
SFM_READ, SFM_WRITE = 0x10, 0x20
_count = ctypes.c_int64


class _Info(ctypes.Structure):
    _fields_ = [("frames", _count), ("samplerate", ctypes.c_int), ("channels", ctypes.c_int),
                ("format", ctypes.c_int), ("sections", ctypes.c_int), ("seekable", ctypes.c_int)]


_LEN = ctypes.CFUNCTYPE(_count, ctypes.c_void_p)
_SEEK = ctypes.CFUNCTYPE(_count, _count, ctypes.c_int, ctypes.c_void_p)
_IO = ctypes.CFUNCTYPE(_count, ctypes.c_void_p, _count, ctypes.c_void_p)
_TELL = ctypes.CFUNCTYPE(_count, ctypes.c_void_p)


class _VirtualIO(ctypes.Structure):
    _fields_ = [("get_filelen", _LEN), ("seek", _SEEK), ("read", _IO), ("write", _IO), ("tell", _TELL)]


@cache
def _lib() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libsndfile.so.1")
    except OSError:
        return None
    lib.sf_open_virtual.restype = ctypes.c_void_p
    lib.sf_open_virtual.argtypes = [ctypes.POINTER(_VirtualIO), ctypes.c_int, ctypes.POINTER(_Info), ctypes.c_void_p]
    lib.sf_open.restype = ctypes.c_void_p
    lib.sf_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(_Info)]
    lib.sf_writef_short.restype = _count
    lib.sf_writef_short.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _count]
    lib.sf_close.argtypes = [ctypes.c_void_p]
    lib.sf_format_check.argtypes = [ctypes.POINTER(_Info)]
    return lib


@cache
def opus_writable() -> bool:
    """Whether libsndfile is here and can write mono Ogg Opus."""
    lib = _lib()
    return lib is not None and bool(lib.sf_format_check(ctypes.byref(_Info(0, 24000, 1, SF_FORMAT_OGG | SF_FORMAT_OPUS))))


class OggOpusWriter:
    """16-bit mono PCM in, the Ogg Opus file's bytes out as libsndfile writes them."""

    def __init__(self, rate: int):
        self._data = bytearray()
        self._pos = 0
        self._sent = 0
        # The callbacks are kept on the object: libsndfile calls them until sf_close.
        self._io = _VirtualIO(_LEN(lambda _: len(self._data)), _SEEK(self._seek), _IO(lambda p, n, _: 0),
                              _IO(self._write), _TELL(lambda _: self._pos))
        info = _Info(0, rate, 1, SF_FORMAT_OGG | SF_FORMAT_OPUS)
        lib = _lib()
        self._handle = lib.sf_open_virtual(ctypes.byref(self._io), SFM_WRITE, ctypes.byref(info), None) if lib else None
        if not self._handle:
            raise RuntimeError("libsndfile cannot write Ogg Opus here")

    def _seek(self, offset: int, whence: int, _) -> int:
        self._pos = {0: offset, 1: self._pos + offset, 2: len(self._data) + offset}[whence]
        return self._pos

    def _write(self, ptr, n: int, _) -> int:
        if self._pos < self._sent:
            return 0  # a rewrite of bytes already sent cannot be honoured: libsndfile reports the write failed
        self._data[self._pos:self._pos + n] = ctypes.string_at(ptr, n)
        self._pos += n
        return n

    def _take(self) -> bytes:
        out = bytes(self._data[self._sent:])
        self._sent = len(self._data)
        return out

    def write(self, pcm: bytes) -> bytes:
        """Encode PCM; the bytes written since the last call."""
        if pcm:
            buf = ctypes.create_string_buffer(pcm, len(pcm))
            _lib().sf_writef_short(self._handle, buf, len(pcm) // 2)
        return self._take()

    def close(self) -> bytes:
        """The last pages."""
        if self._handle:
            _lib().sf_close(self._handle)
            self._handle = None
        return self._take()


def read_info(data: bytes) -> tuple[int, int]:
    """(frames, sample rate) of an audio file libsndfile reads (for checks: the file is written to a temporary)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("libsndfile is not installed")
    with tempfile.NamedTemporaryFile(suffix=".ogg", delete=False) as f:
        f.write(data)
    try:
        info = _Info()
        handle = lib.sf_open(f.name.encode(), SFM_READ, ctypes.byref(info))
        if not handle:
            raise ValueError("libsndfile cannot read the file")
        lib.sf_close(handle)
        return info.frames, info.samplerate
    finally:
        os.unlink(f.name)
