"""Pulling models through a loopback hub: resolution by huggingface_hub, progress, resume, sha256, refusals."""

from __future__ import annotations

import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.residency.library import Library, Pull, PullError, part_path, pull, resolve
from tests.helpers import wait_until

WEIGHTS_MIB = 6


@pytest.fixture()
def hub(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = {"tiny-Q4_K_M.gguf": tiny_gguf(src / "a.gguf"), "tiny-Q8_0.gguf": tiny_gguf(src / "b.gguf"),
             "odd.gguf": tiny_gguf(src / "c.gguf", arch="nonesuch", weights_mib=1)}
    server = HubServer(files)
    yield server
    server.close()


@pytest.fixture()
def models(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return d


def test_resolve_through_huggingface_hub(hub):
    src = resolve("hf.co/owner/repo:q8_0", endpoint=hub.url)
    assert src.filename == "tiny-Q8_0.gguf" and src.sha256 == hub.sha256("tiny-Q8_0.gguf")
    assert src.size_bytes == hub.files["tiny-Q8_0.gguf"].stat().st_size
    assert ("GET", "/api/models/owner/repo/tree/main", None) in hub.log
    one = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    assert one.filename == "tiny-Q4_K_M.gguf" and one.url.endswith("/owner/repo/resolve/main/tiny-Q4_K_M.gguf")
    with pytest.raises(PullError, match="3 GGUF files"):
        resolve("hf.co/owner/repo", endpoint=hub.url)
    with pytest.raises(PullError, match="Ollama registry"):
        resolve("llama3.2")
    with pytest.raises(PullError, match="refused"):
        resolve("owner/repo/missing.gguf", endpoint=hub.url)


def test_pull_reports_progress_and_lands_the_checked_file(hub, models):
    seen = []
    src = resolve("hf.co/owner/repo:Q4_K_M", endpoint=hub.url)
    path = pull(src, models, progress=lambda p: seen.append((p.state, p.done_bytes)))
    assert path == models / "tiny-Q4_K_M.gguf" and path.read_bytes() == hub.files["tiny-Q4_K_M.gguf"].read_bytes()
    states = [s for s, _ in seen]
    assert states[0] == "downloading" and states[-2:] == ["verifying", "done"]
    done = [b for s, b in seen if s == "downloading"]
    assert done == sorted(done) and seen[-1][1] == src.size_bytes
    assert not part_path(path).exists()


def test_a_cut_connection_resumes_where_it_stopped(hub, models):
    src = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    hub.cut_after = 2 * 1024 * 1024 + 17
    path = pull(src, models)
    assert path.read_bytes() == hub.files["tiny-Q4_K_M.gguf"].read_bytes()
    gets = [r for m, p, r in hub.log if m == "GET" and p.endswith("tiny-Q4_K_M.gguf")]
    assert len(gets) == 2 and gets[0] is None
    resumed_at = int(gets[1].removeprefix("bytes=").rstrip("-"))
    assert 2 * 1024 * 1024 - 65536 < resumed_at <= 2 * 1024 * 1024 + 17  # where it stopped, not from the start


def test_a_stopped_pull_resumes_on_the_next_one(hub, models):
    src = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    hub.cut_after = 3 * 1024 * 1024
    with pytest.raises(PullError, match="pull it again to resume"):
        pull(src, models, max_retries=0)
    assert part_path(models / src.filename).stat().st_size == 3 * 1024 * 1024
    state = Pull(src.spec)
    path = pull(src, models, state=state)
    assert state.resumed_from == 3 * 1024 * 1024 and path.read_bytes() == hub.files[src.filename].read_bytes()


def test_sha256_mismatch_is_refused_and_nothing_is_left(hub, models):
    hub.sha_override = "ab" * 32
    src = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    with pytest.raises(PullError, match="sha256 mismatch"):
        pull(src, models)
    assert list(models.iterdir()) == []


def test_a_full_disk_is_refused_before_downloading(hub, models):
    src = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    state = Pull(src.spec)
    with pytest.raises(PullError, match="not enough disk") as e:
        pull(src, models, state=state, disk_free=lambda folder: 1024 * 1024)
    assert e.value.refused and state.state == "refused"
    assert not [r for r in hub.log if r[0] == "GET" and "resolve" in r[1]]  # not one byte was asked for
    assert list(models.iterdir()) == []


def test_memory_budget_is_checked_from_the_header_before_the_weights(hub, models):
    src = resolve("owner/repo/tiny-Q4_K_M.gguf", endpoint=hub.url)
    seen = []

    def too_big(metadata):
        seen.append(metadata.architecture)
        return "would not fit the memory budget"

    state = Pull(src.spec)
    with pytest.raises(PullError, match="memory budget"):
        pull(src, models, check_header=too_big, state=state)
    assert seen == ["llama"] and state.state == "refused"
    assert state.done_bytes < src.size_bytes // 2  # stopped at the header, the weights never came
    assert list(models.iterdir()) == []


def test_an_unservable_file_is_refused_from_its_header(hub, models, tmp_path):
    from app.residency.library import header_entry

    src = resolve("owner/repo/odd.gguf", endpoint=hub.url)
    with pytest.raises(PullError, match="nonesuch"):
        pull(src, models, check_header=lambda m: header_entry(m, "odd.gguf").unusable_reason)
    assert list(models.iterdir()) == []


def test_plain_url_with_sha_and_the_background_library(hub, models):
    done = []
    lib = Library(models, check_header=lambda m: None, on_done=done.append)
    sha = hub.sha256("tiny-Q8_0.gguf")
    # The hub is on loopback: the admin's allow-list names it (a public host needs none).
    p = lib.start(f"{hub.url}/files/tiny-Q8_0.gguf#sha256={sha}", allowed_hosts="127.0.0.1")
    assert lib.start(f"{hub.url}/files/tiny-Q8_0.gguf#sha256={sha}") is p  # one pull per source at a time
    wait_until(lambda: not p.active, 30, "the pull never ended")
    assert p.state == "done", p.error
    assert done == [models / "tiny-Q8_0.gguf"] and p.sha256 == sha and p.percent == 100
    again = lib.start(f"{hub.url}/files/tiny-Q8_0.gguf", allowed_hosts="127.0.0.1")
    wait_until(lambda: not again.active, 30, "the second pull never ended")
    assert again.state == "refused" and "already in the models folder" in again.error


def test_hearth_models_pull_from_the_command_line(hub, tmp_path, monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "cli-models"))
    from app.store.db import open_store
    from app.store.settings import set_setting

    db_engine, sessions = open_store(tmp_path / "data")
    with sessions() as s:
        set_setting(s, "hf_endpoint", hub.url)
        s.commit()
    db_engine.dispose()
    assert main(["models", "pull", "hf.co/owner/repo:Q4_K_M"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli-models" / "tiny-Q4_K_M.gguf")
    assert main(["models", "pull", "owner/repo/tiny-Q4_K_M.gguf"]) == 2
    assert "already in the models folder" in capsys.readouterr().err
