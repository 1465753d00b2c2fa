"""`hearth token|models|classes|settings` against a real store in a temporary data folder."""

import sqlite3

import pytest

from app.cli import main
from app.store.db import open_store
from app.store.models import Setting
from app.store.settings import REGISTRY, get_setting


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
    # The big-model settings (migration 0020): KV type, experts in RAM, GPUs; a bad one is refused with what to fix.
    assert main(["models", "set", "gemma-3-270m-q4_k_m", "--kv-type", "q8_0", "--n-cpu-moe", "-1", "--devices",
                 "Vulkan0,Vulkan1", "--tensor-split", "3,1"]) == 0
    assert query(data, "select cache_type_k, cache_type_v, n_cpu_moe, devices, tensor_split from runner_settings") == [
        ("q8_0", "q8_0", -1, "Vulkan0,Vulkan1", "3,1")]
    assert main(["models", "set", "gemma-3-270m-q4_k_m", "--kv-type", "q9"]) == 2
    assert "KV cache type: -ctk 'q9'" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--tensor-split", "nan"), ("--tensor-split", "inf"),
                                             ("--tensor-split", "1e308,1"), ("--main-gpu", "99999999999999999999"),
                                             ("--n-cpu-moe", "99999999999999999999")])
def test_models_set_refuses_non_finite_or_absurd_placement_numbers(data, capsys, flag, value):
    """Issue 50: nan, inf and 1e308 were saved as the split; a huge --main-gpu ended in an OverflowError traceback."""
    assert main(["models", "list"]) == 0
    capsys.readouterr()
    assert main(["models", "set", "gemma-3-270m-q4_k_m", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert query(data, "select tensor_split, main_gpu, n_cpu_moe from runner_settings") in ([], [(None, None, None)])


def test_classes_and_settings(data, capsys):
    assert main(["classes", "set", "voice", "max_concurrent=8", "weight=5", "preemptible=yes"]) == 0
    assert query(data, "select max_concurrent, weight, preemptible from request_classes where name='voice'") == [(8, 5.0, 1)]
    assert main(["classes", "set", "voice", "colour=blue"]) == 2
    assert main(["classes", "set", "voice", "max_queue=lots"]) == 2
    assert "not a valid max_queue" in capsys.readouterr().err
    assert main(["settings", "set", "memory_limit_mb", "2048"]) == 0
    assert main(["settings", "list"]) == 0
    assert "memory_limit_mb                  2048" in capsys.readouterr().out
    assert main(["settings", "set", "nope", "1"]) == 2


def stored_settings(data):
    """The registry's settings that have a stored value, read back through the store."""
    db_engine, sessions = open_store(data)
    try:
        with sessions() as s:
            return {k: get_setting(s, k) for k in REGISTRY if s.get(Setting, k) is not None}
    finally:
        db_engine.dispose()


@pytest.mark.parametrize(("name", "value", "message"), [
    # Stored before, and then `hearth serve` could not start: int("abc") in the gateway's admission.
    ("max_in_flight_total", "abc", "max_in_flight_total must be a whole number (got abc)"),
    # Stored before, and then every runner exited: 8 KV cells hold no chat template.
    ("runner_ctx", "8", "runner_ctx must be at least 256 (got 8)"),
    ("runner_parallel", "1000", "runner_parallel must be at most 256 (got 1000)"),
    ("samples_retention_h", "inf", "samples_retention_h must be a number (got inf)"),
    ("status_public", "maybe", "status_public must be true or false (got maybe)"),
    ("bind", "8080", "bind must be host:port"),
    ("models_dir", "models", "models_dir must be an absolute path"),
    ("api_open_class", "poetry", "api_open_class must be one of: background, chat, coding, documents, voice (got poetry)"),
])
def test_settings_set_refuses_what_serve_and_runners_cannot_run_with(data, capsys, name, value, message):
    assert main(["settings", "list"]) == 0  # the store exists, nothing stored yet
    capsys.readouterr()
    assert main(["settings", "set", name, value]) == 2
    assert capsys.readouterr().err.strip().startswith(f"hearth settings: {message}")
    assert stored_settings(data) == {}


def test_settings_set_reads_values_by_kind_and_checks_settings_together(data, capsys):
    assert main(["settings", "set", "runner_ctx", "2048"]) == 0
    assert main(["settings", "set", "status_public", "yes"]) == 0
    assert main(["settings", "set", "samples_retention_h", "72"]) == 0
    assert main(["settings", "set", "bind", "0.0.0.0:8081"]) == 0
    assert "restart hearth serve to apply" in capsys.readouterr().out
    assert stored_settings(data) == {"runner_ctx": 2048, "status_public": True, "samples_retention_h": 72.0,
                                     "bind": "0.0.0.0:8081"}
    # One token per slot in every batch: a batch below the slots is refused whichever of the two changes.
    assert main(["settings", "set", "runner_parallel", "64"]) == 0
    assert main(["settings", "set", "runner_batch", "32"]) == 2
    assert "runner_batch must be at least runner_parallel (64)" in capsys.readouterr().err
    assert main(["settings", "set", "runner_batch", "64"]) == 0
    assert main(["settings", "set", "runner_parallel", "128"]) == 2
    assert main(["settings", "set", "runner_ctx", "null"]) == 0
    assert "runner_ctx" not in stored_settings(data)


def test_settings_set_default_model_to_a_catalogued_model(data, capsys):
    assert main(["settings", "set", "default_model", "gemma-3-270m-q4_k_m"]) == 2  # nothing scanned yet
    assert "default_model must be one of: none yet" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert main(["settings", "set", "default_model", "broken"]) == 2  # catalogued, but not usable
    assert main(["settings", "set", "default_model", "gemma-3-270m-q4_k_m"]) == 0
    assert stored_settings(data)["default_model"] == "gemma-3-270m-q4_k_m"


def test_settings_list_shows_sections_bounds_and_restarts(data, capsys):
    assert main(["settings", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "[Models and runners]" in lines["runner_ctx"] and "(256 to 1048576 cells)" in lines["runner_ctx"]
    assert "needs a restart" in lines["bind"] and "needs a restart" not in lines["runner_ctx"]


def test_printing_commands_called_in_process_leave_sigpipe_alone(data, capsys):
    """A test (or server) process calling main() must not inherit SIGPIPE's kill-on-hangup default."""
    import signal

    before = signal.getsignal(signal.SIGPIPE)
    assert main(["settings", "list"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN



def test_models_list_and_serve_agree_on_the_stored_models_folder_and_runner_settings(data, capsys, monkeypatch):
    from app.factory import create_app, shutdown_app
    from app.gateway.context import services

    monkeypatch.delenv("HEARTH_MODELS_DIR")
    stored = data / "stored-models"
    stored.mkdir()
    (stored / "only-here.gguf").write_bytes(b"GGUF\x03\x00")
    assert main(["settings", "set", "models_dir", str(stored)]) == 0
    assert main(["settings", "set", "runner_parallel", "2"]) == 0
    assert main(["models", "list"]) == 0  # records the default model, so its runner settings can be set
    assert main(["models", "set", "gemma-3-270m-q4_k_m", "--ctx", "1024"]) == 0
    capsys.readouterr()
    assert main(["models", "list"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    app = create_app({"HEARTH_DATA": str(data), "SCHEDULER": False, "TESTING": True})
    try:
        catalog = services(app).catalog
        assert catalog.models_dir == stored
        assert set(listed) == {e.name for e in catalog.entries} == {"gemma-3-270m-q4_k_m", "only-here"}
        spec = catalog.model_specs()["gemma-3-270m-q4_k_m"]
        assert (spec.runner.n_ctx, spec.runner.parallel) == (1024, 2)
        runner, estimate = listed["gemma-3-270m-q4_k_m"].split()[6:8]
        assert runner == "1024×2" and estimate == f"{spec.estimate_bytes / 1024 / 1024:.0f}M"
        assert "unusable" in listed["only-here"]
    finally:
        shutdown_app(app)


def json_string(path) -> str:
    """A path as the JSON string `hearth settings set` reads."""
    return '"' + str(path) + '"'


def test_runner_serves_metrics_only_when_asked_as_llama_server_and_serve_asks():
    from app.cli import build_parser
    from app.residency.runner_spec import RunnerSpec

    p = build_parser()
    assert p.parse_args(["runner", "--model", "m.gguf"]).metrics is False
    assert p.parse_args(["runner", "--model", "m.gguf", "--metrics"]).metrics is True
    # The runners `hearth serve` starts: the load probe and the telemetry sampler read /metrics.
    assert "--metrics" in RunnerSpec(model_name="m", model_path="m.gguf").command(8080)


def test_models_truncate_writes_a_draft_model_and_set_chooses_it(data, capsys):
    from app.devtools.gguf_shapes import SHAPES, make_model
    from app.gguf_meta import read_metadata

    target = data / "models" / "target.gguf"
    make_model(SHAPES["tiny"], target)
    assert main(["models", "truncate", str(target), str(data / "models" / "small.gguf"), "--layers", "1"]) == 0
    assert "target.gguf with its first 1 of 2 blocks" in capsys.readouterr().out
    small = read_metadata(data / "models" / "small.gguf")
    assert small.arch_value("block_count") == 1 and small.vocab_digest == read_metadata(target).vocab_digest
    assert main(["models", "truncate", str(target), str(data / "x.gguf"), "--layers", "5"]) == 2
    assert "has 2 blocks: keep 1 to 2, not 5" in capsys.readouterr().err
    assert main(["models", "list"]) == 0  # the scan records both files
    capsys.readouterr()
    assert main(["models", "set", "target", "--draft-model", "small"]) == 0
    assert query(data, "select draft_model from runner_settings") == [("small",)]
    assert main(["models", "set", "target", "--draft-model", "target"]) == 2
    assert "cannot be its own draft model" in capsys.readouterr().err
    assert main(["models", "set", "target", "--draft-model", "none"]) == 0
    assert query(data, "select draft_model from runner_settings") == [(None,)]
