"""`hearth token|models|classes|settings` against a real store in a temporary data folder."""

import sqlite3

import pytest

from app.cli import main


@pytest.fixture()
def data(tmp_path, monkeypatch, standin_model):
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path))
    monkeypatch.setenv("HEARTH_DEFAULT_MODEL", str(standin_model))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    return tmp_path


def query(data, sql):
    with sqlite3.connect(data / "hearth.db") as db:
        return db.execute(sql).fetchall()


def test_token_create_list_revoke(data, capsys):
    assert main(["token", "create", "--member", "alice", "--class", "voice", "--allow", "chat"]) == 0
    token = capsys.readouterr().out.strip()
    assert token.startswith("hth_")
    stored = query(data, "select prefix, token_hash, default_class, allowed_classes from api_tokens")
    assert stored[0][0] == token[:12] and token not in str(stored)  # only the hash is kept
    assert main(["token", "list"]) == 0
    assert "alice" in capsys.readouterr().out
    assert main(["token", "revoke", token[:12]]) == 0
    assert query(data, "select revoked_at is not null from api_tokens") == [(1,)]
    assert main(["token", "create", "--member", "bob", "--class", "poetry"]) == 2
    assert "unknown class(es) poetry" in capsys.readouterr().err


def test_models_list_records_the_catalog_and_set_edits_it(data, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m-q4_k_m" in out and "unusable: " in out and "broken" in out
    assert main(["models", "set", "gemma-3-270m-q4_k_m", "--policy", "pinned", "--alias", "assistant",
                 "--runner", "llama-server"]) == 2  # llama-server without a binary
    assert "needs --binary" in capsys.readouterr().err
    assert main(["models", "set", "gemma-3-270m-q4_k_m", "--policy", "pinned", "--alias", "assistant",
                 "--ctx", "2048"]) == 0
    assert query(data, "select policy, alias from models where name='gemma-3-270m-q4_k_m'") == [("pinned", "assistant")]
    assert query(data, "select n_ctx from runner_settings") == [(2048,)]
    assert main(["models", "node", "add", "gemma-3-270m-q4_k_m", "http://10.0.0.5:8080", "--label", "nas2"]) == 0
    assert query(data, "select url, label from nodes") == [("http://10.0.0.5:8080", "nas2")]
    assert main(["models", "node", "add", "gemma-3-270m-q4_k_m", "ftp://x"]) == 2
    assert main(["models", "set", "nope", "--policy", "pinned"]) == 2


def test_classes_and_settings(data, capsys):
    assert main(["classes", "set", "voice", "max_concurrent=8", "weight=5", "preemptible=yes"]) == 0
    assert query(data, "select max_concurrent, weight, preemptible from request_classes where name='voice'") == [(8, 5.0, 1)]
    assert main(["classes", "set", "voice", "colour=blue"]) == 2
    assert main(["classes", "set", "voice", "max_queue=lots"]) == 2
    assert "not a valid max_queue" in capsys.readouterr().err
    assert main(["settings", "set", "memory_limit_mb", "2048"]) == 0
    assert main(["settings", "list"]) == 0
    assert "memory_limit_mb        2048" in capsys.readouterr().out
    assert main(["settings", "set", "nope", "1"]) == 2


def test_printing_commands_called_in_process_leave_sigpipe_alone(data, capsys):
    """A test (or server) process calling main() must not inherit SIGPIPE's kill-on-hangup default."""
    import signal

    before = signal.getsignal(signal.SIGPIPE)
    assert main(["settings", "list"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN

