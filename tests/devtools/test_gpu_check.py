"""scripts/gpu_check.sh: valid bash, failing fast and by name when something is missing; its JSON summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.devtools.gpu.gpu_report import build_report, engine_figures
from app.llama_tools import pinned_llama_cpp_version

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def _fake_carry(tmp_path: Path, version: str) -> Path:
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    (carry / "llama.cpp.tar.gz").write_bytes(b"")
    (carry / "llama_cpp_py.tar.gz").write_bytes(b"")
    (carry / "version").write_text(version + "\n")
    return carry


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_run_without_a_prepared_carry_folder_says_how_to_make_one(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = _run("run", "--cpu", "--carry", str(empty), tmp_path=tmp_path)
    assert done.returncode == 1
    assert "no prepared carry folder" in done.stderr and "prepare" in done.stderr


def test_a_carry_folder_for_another_llama_cpp_python_is_refused(tmp_path):
    carry = _fake_carry(tmp_path, "0.0.1")
    done = _run("run", "--cpu", "--carry", str(carry), tmp_path=tmp_path)
    assert done.returncode == 1
    assert "0.0.1" in done.stderr and pinned_llama_cpp_version() in done.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_the_gpu_run_on_a_machine_without_a_gpu_stops_before_building_and_points_at_the_cpu_dry_run(tmp_path):
    carry = _fake_carry(tmp_path, pinned_llama_cpp_version())
    done = _run("run", "--carry", str(carry), tmp_path=tmp_path)
    assert done.returncode == 1
    assert "or pass --cpu" in done.stderr
    assert not (tmp_path / "work" / "build").exists()


def test_unknown_options_and_verbs_are_refused_with_the_usage(tmp_path):
    assert "unknown option --gpus" in _run("run", "--gpus", tmp_path=tmp_path).stderr
    done = _run("launch", tmp_path=tmp_path)
    assert done.returncode == 1 and "usage:" in done.stderr


def _engine_doc() -> dict:
    uniform = [{"workload": "uniform", "mode": "continuous", "level": lvl,
                "summary": {"decode_tok_s": tok, "outside_decode_share_decode_phase": 0.05}}
               for lvl, tok in ((1, 100.0), (8, 500.0))]
    return {
        "constants": {"model_desc": "llama 1B Q8_0", "gpu_layers": 99, "n_ctx": 16384},
        "summary": {"ratios": {"1": {"median": 0.95, "all": [0.95]}, "8": {"median": 0.8, "all": [0.8]}}},
        "reference": [{"1": {"decode_tokens_per_s": 105.0}, "8": {"decode_tokens_per_s": 625.0}}],
        "runs": [{"workload": "mixed", "mode": "continuous", "level": 8, "summary": {}}, *uniform],
    }


def test_engine_figures_pair_each_level_with_the_reference_and_the_target():
    levels = engine_figures(_engine_doc())["levels"]
    assert levels["1"] == {"engine_decode_tok_s": 100.0, "reference_decode_tok_s": 105.0, "ratio": 0.95,
                           "outside_decode_share": 0.05, "meets_target": True}
    assert levels["8"]["meets_target"] is False


def test_the_report_keeps_every_step_and_survives_missing_or_broken_files(tmp_path):
    (tmp_path / "steps.jsonl").write_text(
        '{"step": "build", "status": "ok", "rc": 0, "seconds": 200}\n'
        '{"step": "engine_8b", "status": "skipped", "reason": "out of time"}\n')
    (tmp_path / "engine_1b.json").write_text(json.dumps(_engine_doc()))
    (tmp_path / "served_1b.json").write_text("{not json")
    report = build_report(tmp_path, 540, 530)
    assert [s["step"] for s in report["steps"]] == ["build", "engine_8b"]
    assert report["engine_1b"]["levels"]["8"]["ratio"] == 0.8
    assert report["engine_8b"] is None and report["served_1b"] is None and report["vram"] is None
