"""peer_suite's launch mapping and its comparison table (no server started)."""

from pathlib import Path

from app.devtools.parity.peer_suite import map_args, report

MODEL = "/models/gemma.gguf"


def test_the_tests_model_flags_become_the_embedded_model():
    args = ["--port", "8080", "--hf-repo", "ggml-org/x", "--hf-file", "a.gguf", "--offline", "--no-jinja", "-np", "2"]
    assert map_args("hearth", args, MODEL) == ["--model", MODEL, "--port", "8080", "--no-jinja", "-np", "2"]
    assert map_args("llama-server", args, MODEL)[-1] == "--kv-unified"
    assert map_args("llama-server", [*args, "--kv-unified"], MODEL).count("--kv-unified") == 1


def _junit(folder: Path, file: str, cases: dict[str, str | None]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(
        f'<testcase classname="unit.{file}" name="{name}">'
        + (f'<failure message="{why}">x</failure>' if why else "") + "</testcase>"
        for name, why in cases.items()
    )
    (folder / f"{file}.xml").write_text(f'<testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')


def test_report_counts_each_outcome_and_names_what_only_stock_passes(tmp_path):
    _junit(tmp_path / "llama-server", "test_basic", {"a": None, "b": None, "c": "boom", "d": "boom"})
    _junit(tmp_path / "hearth", "test_basic", {"a": None, "b": "AssertionError: 404 != 200", "c": "boom", "d": None})
    text = report(tmp_path, ["test_basic"])
    row = next(line for line in text.splitlines() if line.startswith("test_basic"))
    assert row.split() == ["test_basic", "4", "1", "1", "1", "1", "0"]
    assert "Hearth passes 1 of the 2 in-scope tests stock llama-server passes (50.0 %)" in text
    assert "test_basic::b: failure: AssertionError: 404 != 200" in text


def test_out_of_scope_tests_are_shown_apart_and_left_out_of_the_share(tmp_path):
    # Router mode (all of test_stream) and /cors-proxy are outside the scope.
    _junit(tmp_path / "llama-server", "test_stream", {"test_stream_resume_x": None})
    _junit(tmp_path / "llama-server", "test_security", {"test_cors_proxy_only_forwards_explicit_proxy_headers": None,
                                                        "test_api_key[x]": None})
    _junit(tmp_path / "hearth", "test_stream", {"test_stream_resume_x": "404"})
    _junit(tmp_path / "hearth", "test_security", {"test_cors_proxy_only_forwards_explicit_proxy_headers": "died",
                                                  "test_api_key[x]": None})
    text = report(tmp_path, ["test_stream", "test_security"])
    assert "Hearth passes 1 of the 1 in-scope tests stock llama-server passes (100.0 %)" in text
    assert "Counting the out-of-scope tests too: 1 of 3 (33.3 %)" in text
    assert "test_security::test_cors_proxy_only_forwards_explicit_proxy_headers: /cors-proxy" in text
    assert next(line for line in text.splitlines() if line.startswith("test_stream")).split()[-1] == "1"
