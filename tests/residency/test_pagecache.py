"""The page-cache helper on real files: mincore residency, WILLNEED/read-ahead and DONTNEED, and the Warmer's choices."""

import os
import threading

import pytest

from app.residency import pagecache
from app.residency.pagecache import (
    WEIGHTS_COLD,
    WEIGHTS_PINNED,
    WEIGHTS_WARM,
    Warmer,
    WeightsFile,
    cached_fraction,
    drop,
    read_ahead,
    weights_problem,
)

MIB = 1 << 20


def _file(path, mib: int = 4) -> str:
    """A real file of `mib` MiB, written and synced (clean pages: DONTNEED can drop them), then dropped."""
    with open(path, "wb") as f:
        f.write(os.urandom(mib * MIB))
        f.flush()
        os.fsync(f.fileno())
    drop(path)
    return str(path)


def test_a_written_file_dropped_then_read_ahead_goes_from_out_to_in_the_page_cache(tmp_path):
    path = _file(tmp_path / "weights.gguf")
    assert cached_fraction(path) < 0.05
    assert read_ahead(path) == 4 * MIB
    assert cached_fraction(path) == 1.0
    drop(path)
    assert cached_fraction(path) < 0.05


def test_reading_part_of_a_file_shows_as_that_part(tmp_path):
    path = _file(tmp_path / "half.gguf", mib=8)
    with open(path, "rb") as f:
        f.read(2 * MIB)
    # Kernel read-ahead may bring a little more than was read, never the whole file.
    assert 0.2 <= cached_fraction(path) < 0.9


def test_an_empty_file_is_wholly_cached_and_a_missing_one_is_unknown(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert cached_fraction(tmp_path / "empty") == 1.0
    assert cached_fraction(tmp_path / "absent") is None


def test_weights_choices_are_checked_with_a_message_that_names_them():
    assert weights_problem(None) is None
    assert all(weights_problem(v) is None for v in (WEIGHTS_PINNED, WEIGHTS_WARM, WEIGHTS_COLD))
    assert weights_problem("hot") == "choose one of: pinned, warm, cold (got 'hot')"


class _Box:
    """Files by model and a settable free RAM for the Warmer."""

    def __init__(self, files: list[WeightsFile], free: int):
        self.files = files
        self.free = free
        self.resident: set[str] = set()

    def warmer(self, margin: int = 0) -> Warmer:
        return Warmer(lambda: self.files, lambda: set(self.resident), available=lambda: self.free, margin_bytes=margin)


def test_a_stopped_warm_model_is_read_back_into_the_page_cache_in_the_background(tmp_path):
    gguf, mmproj = _file(tmp_path / "m.gguf"), _file(tmp_path / "mmproj.gguf", mib=2)
    box = _Box([WeightsFile("m", WEIGHTS_WARM, (gguf, mmproj))], free=1 << 40)
    w = box.warmer()
    w.stopped("m")
    assert w.idle()
    assert cached_fraction(gguf) == 1.0 and cached_fraction(mmproj) == 1.0
    w.close()


def test_a_stopped_cold_model_is_dropped_from_the_page_cache(tmp_path):
    gguf = _file(tmp_path / "c.gguf")
    read_ahead(gguf)
    box = _Box([WeightsFile("c", WEIGHTS_COLD, (gguf,))], free=1 << 40)
    w = box.warmer()
    w.stopped("c")
    assert cached_fraction(gguf) < 0.05
    assert w.num_dropped == 1 and w.num_warmed == 0


def test_warming_never_goes_beyond_free_ram_and_the_most_recent_model_goes_first(tmp_path, monkeypatch):
    old, recent = _file(tmp_path / "old.gguf"), _file(tmp_path / "recent.gguf")
    box = _Box([WeightsFile("old", WEIGHTS_WARM, (old,)), WeightsFile("recent", WEIGHTS_WARM, (recent,))],
               free=6 * MIB)
    w = box.warmer(margin=1 * MIB)
    w.used("old")
    w.used("recent")
    # Room for one 4 MiB file beyond the margin. The kernel counts cached pages as available, so the free RAM
    # seen does not shrink as the first one is read: the warmer takes the kept file off it itself.
    reads = []
    real = pagecache.read_ahead

    def counting(path):
        reads.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(pagecache, "read_ahead", counting)
    assert w.sweep() == ["recent"]
    assert reads == ["recent.gguf"]
    assert cached_fraction(recent) == 1.0 and cached_fraction(old) < 0.05
    assert "needs 4 MiB" in w.last_skipped["old"]


def test_pinned_models_are_rewarmed_at_every_check_and_resident_or_unused_ones_are_left_alone(tmp_path):
    pinned, warm, up = _file(tmp_path / "p.gguf"), _file(tmp_path / "w.gguf"), _file(tmp_path / "u.gguf")
    box = _Box([WeightsFile("p", WEIGHTS_PINNED, (pinned,)), WeightsFile("w", WEIGHTS_WARM, (warm,)),
                WeightsFile("u", WEIGHTS_PINNED, (up,))], free=1 << 40)
    box.resident = {"u"}
    w = box.warmer()
    w.check()
    assert w.idle()
    # Pinned: warmed unasked. Warm but never used by this serve: not. Resident: its runner maps it.
    assert cached_fraction(pinned) == 1.0
    assert cached_fraction(warm) < 0.05 and cached_fraction(up) < 0.05
    drop(pinned)  # the kernel reclaimed it
    assert cached_fraction(pinned) < 0.05
    w.check()
    assert w.idle()
    assert cached_fraction(pinned) == 1.0
    w.close()


def test_requests_during_a_sweep_make_one_more_sweep(tmp_path):
    gguf = _file(tmp_path / "m.gguf")
    box = _Box([WeightsFile("m", WEIGHTS_PINNED, (gguf,))], free=1 << 40)
    w = box.warmer()
    entered, release = threading.Event(), threading.Event()
    sweeps = []
    real = w.sweep

    def slow():
        sweeps.append(1)
        entered.set()
        release.wait(10)
        return real()

    w.sweep = slow
    w.check()
    assert entered.wait(10)
    w.check()
    w.check()
    release.set()
    assert w.idle()
    assert len(sweeps) == 2
    w.close()


@pytest.mark.parametrize("choice", [WEIGHTS_WARM, WEIGHTS_PINNED])
def test_a_file_that_vanished_is_skipped_with_the_reason(tmp_path, choice):
    box = _Box([WeightsFile("gone", choice, (str(tmp_path / "gone.gguf"),))], free=1 << 40)
    w = box.warmer()
    w.used("gone")
    assert w.sweep() == []
    assert w.last_skipped["gone"].startswith("unreadable")


def test_a_file_already_in_the_cache_keeps_its_place_before_less_recent_ones(tmp_path):
    old, recent = _file(tmp_path / "old.gguf"), _file(tmp_path / "recent.gguf")
    read_ahead(recent)
    box = _Box([WeightsFile("old", WEIGHTS_WARM, (old,)), WeightsFile("recent", WEIGHTS_WARM, (recent,))],
               free=6 * MIB)
    w = box.warmer(margin=1 * MIB)
    w.used("old")
    w.used("recent")
    # Nothing to read for the recent one, and the old one would push it out: neither is read.
    assert w.sweep() == []
    assert cached_fraction(old) < 0.05 and "old" in w.last_skipped
