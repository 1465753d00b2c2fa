"""serve's catalog fits a model to the GPUs it is given (a made-up list: two GPUs on a box with none): GPU layers,
experts in RAM and KV type from app.residency.fit, the reason in the Models page's note; without a GPU, or with GPU
layers set by the admin, nothing changes (the default model on a CPU box starts as before)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import select

from app.admin import set_model_kv_types
from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.services.catalog import Catalog
from app.services.settings import SettingsCache
from app.store import models as db
from app.store.db import open_store

MIB = 1 << 20


def gpu(name: str, mib: int) -> Device:
    return Device(name, "Vulkan", "gpu", f"made-up {name}", mib * MIB, mib * MIB)


@pytest.fixture
def make_catalog(tmp_path, standin_model):
    models = tmp_path / "models"
    models.mkdir()
    make_model(replace(SHAPES["qwen3moe-tiny"], n_layer=4), models / "moe.gguf")
    engine, sessions = open_store(tmp_path / "data")

    def make(devices):
        return Catalog.open(tmp_path / "data", sessions, SettingsCache(sessions), default_model=standin_model,
                            models_dir_override=str(models), devices=lambda: devices)
    yield make
    engine.dispose()


def test_without_a_gpu_nothing_changes(make_catalog):
    spec = make_catalog([]).model_specs()["moe"]
    assert spec.runner.gpu_layers == 0 and spec.runner.kv_type_flag == [] and spec.runner.placement_flag == []
    assert "fit to the GPU" not in (spec.sizing_note or "")


def test_a_gpu_with_room_takes_every_layer_and_says_why(make_catalog):
    spec = make_catalog([gpu("Vulkan0", 8192), gpu("Vulkan1", 8192)]).model_specs()["moe"]
    assert spec.runner.gpu_layers == 5 and spec.runner.n_cpu_moe == 0
    assert "fit to the GPU: every layer on the GPU (Vulkan0 7,168 MiB, Vulkan1 7,168 MiB" in spec.sizing_note
    cmd = spec.runner.command(8081)
    assert cmd[cmd.index("--gpu-layers") + 1] == "5"


def test_the_admins_gpu_layers_and_kv_type_stand(make_catalog):
    catalog = make_catalog([gpu("Vulkan0", 8192)])
    with catalog.sessions() as s:
        set_model_kv_types(s, "moe", "q4_0")
        s.commit()
    catalog.rescan()
    assert catalog.model_specs()["moe"].runner.kv_types == ("q4_0", "q4_0")
    with catalog.sessions() as s:
        model_id = s.scalar(select(db.Model.id).where(db.Model.name == "moe"))
        rs = s.scalar(select(db.RunnerSettings).where(db.RunnerSettings.model_id == model_id))
        rs.gpu_layers = 2
        s.commit()
    catalog.rescan()
    spec = catalog.model_specs()["moe"]
    assert spec.runner.gpu_layers == 2 and "fit to the GPU" not in (spec.sizing_note or "")


def test_each_spec_counts_its_bytes_per_device_for_the_residency(make_catalog):
    from app.residency.budget import ANY_GPU

    # No GPU: all of it in RAM, as the one RAM budget counted it before.
    spec = make_catalog([]).model_specs()["moe"]
    assert spec.need() == {"CPU": spec.estimate_bytes}
    # Two GPUs, every layer fits one: the GPU part is for whichever GPU has room (started there with --device).
    catalog = make_catalog([gpu("Vulkan0", 8192), gpu("Vulkan1", 8192)])
    need = catalog.model_specs()["moe"].need()
    assert set(need) == {"CPU", ANY_GPU} and need[ANY_GPU] > 0 and need["CPU"] > 0
    # The admin names both GPUs: split over them by name, as llama.cpp lays the layers out.
    from app.admin import set_model_placement

    with catalog.sessions() as s:
        set_model_placement(s, "moe", devices="Vulkan0,Vulkan1")
        s.commit()
    catalog.rescan()
    need = catalog.model_specs()["moe"].need()
    assert set(need) == {"CPU", "Vulkan0", "Vulkan1"} and need["Vulkan0"] > 0 and need["Vulkan1"] > 0
