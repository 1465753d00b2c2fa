"""The Models page's placement fields: experts in RAM (--n-cpu-moe / --cpu-moe), GPUs (--device), split
(--tensor-split), split mode and main GPU are on each card, a choice is stored and reaches the runner's command, and a
bad value is refused on the card with what to enter (a made-up two-GPU box: the probe is replaced)."""

from __future__ import annotations

import html as htmllib
from dataclasses import replace

import pytest
from sqlalchemy import select

from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.gateway.context import services
from app.store.models import Model, RunnerSettings
from app.web import models as models_page
from tests.web.test_speculation_pages import _post

MIB = 1 << 20
GPUS = (Device("Vulkan0", "Vulkan", "gpu", "made-up", 8192 * MIB, 8192 * MIB),
        Device("Vulkan1", "Vulkan", "gpu", "made-up", 4096 * MIB, 4096 * MIB))


@pytest.fixture
def model(app, monkeypatch):
    monkeypatch.setattr(models_page, "offload_devices", lambda: GPUS)
    models = services(app).catalog.models_dir
    models.mkdir(parents=True, exist_ok=True)
    make_model(replace(SHAPES["qwen3moe-tiny"], n_layer=4), models / "moe.gguf")
    services(app).catalog.rescan()
    return models / "moe.gguf"


def _form(page: str, name: str) -> str:
    start = page.index(f'action="/models/{name}/placement"')
    return page[start:page.index("</form>", start)]


def _stored(app, name):
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == name))
        return s.execute(select(RunnerSettings.n_cpu_moe, RunnerSettings.devices, RunnerSettings.tensor_split,
                                RunnerSettings.split_mode, RunnerSettings.main_gpu)
                         .where(RunnerSettings.model_id == model_id)).one_or_none()


def test_each_card_has_the_placement_fields_at_their_defaults(app, admin, model):
    form = _form(htmllib.unescape(admin.get("/models").get_data(as_text=True)), "moe")
    for field in ("n_cpu_moe", "devices", "tensor_split", "split_mode", "main_gpu"):
        assert f'name="{field}"' in form
    assert '<option value="layer" selected>' in form and 'name="main_gpu" value="0"' in form
    assert "Runner: <code>" not in form  # the defaults pass no flag
    assert services(app).catalog.model_specs()["moe"].runner.placement_flag == []


def test_a_choice_is_stored_and_reaches_the_runner(app, admin, csrf_token, model):
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", n_cpu_moe="2", devices="Vulkan0, Vulkan1",
              tensor_split="3,1", split_mode="row", main_gpu="1")
    assert r.status_code == 200, r.get_data(as_text=True)
    body = htmllib.unescape(r.get_data(as_text=True))
    flags = "--n-cpu-moe 2 --device Vulkan0,Vulkan1 --tensor-split 3,1 --split-mode row --main-gpu 1"
    assert f"Saved: placement ({flags})." in body and f"<code>{flags}</code>" in body
    assert 'name="tensor_split" value="3,1"' in body and '<option value="row" selected>' in body
    assert _stored(app, "moe") == (2, "Vulkan0,Vulkan1", "3,1", "row", 1)
    cmd = services(app).catalog.model_specs()["moe"].runner.command(8081)
    assert cmd[cmd.index("--n-cpu-moe") + 1] == "2" and cmd[cmd.index("--device") + 1] == "Vulkan0,Vulkan1"
    # all: every layer's experts in RAM; empty fields: back to the defaults, no flag.
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", n_cpu_moe="all", devices="", tensor_split="",
              split_mode="layer", main_gpu="0")
    assert "Saved: placement (--cpu-moe)." in htmllib.unescape(r.get_data(as_text=True))
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", n_cpu_moe="", devices="", tensor_split="",
              split_mode="layer", main_gpu="0")
    assert "Saved: placement at the defaults." in r.get_data(as_text=True)
    assert _stored(app, "moe") == (None, None, None, None, None)


@pytest.mark.parametrize("field, value, message", [
    ("n_cpu_moe", "some", "Experts in RAM: a number of layers, 0 or more"),
    ("devices", "CUDA0", "No GPU called CUDA0: this box's GPUs are Vulkan0, Vulkan1."),
    ("tensor_split", "3,x", "Split: comma-separated shares of 0 or more, one per GPU"),
    ("tensor_split", "1,1,1", "Split: 3 shares for 2 GPU(s)"),
    ("split_mode", "diagonal", "Split mode: choose one of none, layer, row."),
    ("main_gpu", "2", "Main GPU: 2 is past the model's 2 GPU(s) (0 to 1)."),
    # Issue 50: float() takes these, and they were saved ("Saved: placement (--tensor-split nan)").
    ("tensor_split", "nan", "Split: comma-separated shares of 0 or more"),
    ("tensor_split", "inf,1", "--tensor-split 'inf,1': up to 16 comma-separated shares"),
    ("tensor_split", "1e308,1", "--tensor-split '1e308,1': up to 16 comma-separated shares"),
    ("n_cpu_moe", "99999999999999999999", "--n-cpu-moe 99999999999999999999: the number of layers"),
])
def test_a_bad_value_is_refused_on_the_card_with_what_to_enter(app, admin, csrf_token, model, field, value, message):
    data = {"n_cpu_moe": "", "devices": "", "tensor_split": "", "split_mode": "layer", "main_gpu": "0", field: value}
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", **data)
    assert r.status_code == 422
    body = htmllib.unescape(r.get_data(as_text=True))
    assert message in body and 'class="field-error"' in body
    assert f'name="{field}" value="{value}"' in body or f'<option value="{value}"' not in body  # the entry stays
    assert _stored(app, "moe") is None


def test_without_a_gpu_naming_one_says_the_build_sees_none(app, admin, csrf_token, model, monkeypatch):
    monkeypatch.setattr(models_page, "offload_devices", lambda: ())
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", n_cpu_moe="", devices="Vulkan0",
              tensor_split="", split_mode="layer", main_gpu="0")
    assert r.status_code == 422
    assert "the runners' llama.cpp build sees no GPU here" in htmllib.unescape(r.get_data(as_text=True))


def test_saving_the_placement_needs_csrf(app, admin, model):
    r = admin.post("/models/moe/placement", data={"n_cpu_moe": "2"}, headers={"HX-Request": "true"})
    assert r.status_code in (400, 403)


def test_the_fit_says_why_beside_the_fields(app, admin, model):
    services(app).catalog.devices = lambda: list(GPUS)
    services(app).catalog.rescan()
    form = _form(htmllib.unescape(admin.get("/models").get_data(as_text=True)), "moe")
    assert '<span class="placement-fit">Fit to the GPU: every layer on the GPU (Vulkan0 7,168 MiB, Vulkan1 3,072 MiB' in form


def test_without_a_gpu_an_absurd_main_gpu_is_still_a_field_error(app, admin, csrf_token, model, monkeypatch):
    """Issue 50: with no GPU to compare against, any index passed, and 99999999999999999999 overflowed the store."""
    monkeypatch.setattr(models_page, "offload_devices", lambda: ())
    r = _post(admin, csrf_token, "/models/moe/placement", "/models", n_cpu_moe="", devices="", tensor_split="",
              split_mode="layer", main_gpu="99999999999999999999")
    assert r.status_code == 422
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "--main-gpu 99999999999999999999: a GPU's index, 0 to 15" in body and 'class="field-error"' in body
    assert _stored(app, "moe") is None
