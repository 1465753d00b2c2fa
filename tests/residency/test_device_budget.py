"""The budget per device, on made-up two-GPU lists: RAM and each GPU a budget of its own; a model that fits one GPU
goes to the one with room, started there with --device; a device short of room evicts only the models that hold
memory on it; the runner's bytes per device as the catalog counts them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.devices import Device
from app.devtools.gguf_shapes import SHAPES, make_model
from app.residency.budget import ANY_GPU, RAM_DEVICE, MemoryBudget, detect_budget, device_budgets, plan_on_devices
from app.residency.catalog import scan
from app.residency.fit import device_need
from app.residency.manager import ModelSpec, ModelState, NotEnoughMemory, ResidencyManager, _Model, _on_device
from app.residency.placement import CPU, model_tensors
from app.residency.runner_spec import RunnerSpec

MIB = 1 << 20
BUDGETS = {RAM_DEVICE: 8000 * MIB, "Vulkan0": 4000 * MIB, "Vulkan1": 6000 * MIB}


def gpu(name: str, mib: int, free_mib: int | None = None, reports_usage: bool = True) -> Device:
    free = mib if free_mib is None else free_mib
    return Device(name, "Vulkan", "gpu", f"made-up {name}", mib * MIB, free * MIB, reports_usage)


def mib(d: dict[str, int]) -> dict[str, int]:
    return {k: v // MIB for k, v in d.items()}


def test_budgets_are_ram_and_each_gpu_less_its_reserve():
    ram = MemoryBudget("ram", 16000 * MIB, 12000 * MIB, 1600 * MIB, 14400 * MIB)
    cpu = Device("CPU", "CPU", "cpu", "host", 16000 * MIB, 12000 * MIB)
    budgets = device_budgets(ram, [cpu, gpu("Vulkan0", 4000, 1000), gpu("Vulkan1", 2048, reports_usage=False)])
    assert list(budgets) == [RAM_DEVICE, "Vulkan0", "Vulkan1"]  # the CPU device is RAM's budget, not a second one
    assert budgets[RAM_DEVICE] is ram
    assert (budgets["Vulkan0"].usable_bytes, budgets["Vulkan0"].available_bytes) == (3600 * MIB, 1000 * MIB)
    # lavapipe reports a fixed free figure: all of it counts as free, Hearth's own count is the limit.
    assert budgets["Vulkan1"].available_bytes == 2048 * MIB


def test_a_ram_only_box_has_one_budget_the_same_as_before():
    class Memory:
        total, available = 16000 * MIB, 12000 * MIB

    ram = detect_budget(use_gpu=False, virtual_memory=Memory, cgroup_root=Path("/nonexistent"))
    assert device_budgets(ram, []) == {RAM_DEVICE: ram}


def test_a_model_that_fits_one_gpu_goes_to_the_one_with_most_room():
    placed = {"a": {RAM_DEVICE: 500 * MIB, "Vulkan1": 5000 * MIB}}
    where, victims = plan_on_devices({RAM_DEVICE: 300 * MIB, ANY_GPU: 900 * MIB}, BUDGETS, placed, ["a"])
    # Vulkan1 has 1000 MiB left, Vulkan0 4000: the model goes to Vulkan0 and nobody is evicted.
    assert (mib(where), victims) == ({RAM_DEVICE: 300, "Vulkan0": 900}, [])


def test_a_full_gpu_evicts_only_the_models_on_it():
    placed = {"old_on_0": {RAM_DEVICE: 100 * MIB, "Vulkan0": 3500 * MIB},
              "on_1": {RAM_DEVICE: 100 * MIB, "Vulkan1": 5000 * MIB},
              "ram_only": {RAM_DEVICE: 3000 * MIB}}
    # Least recently used first: on_1 and ram_only are older than old_on_0, but hold nothing on Vulkan0.
    where, victims = plan_on_devices({RAM_DEVICE: 100 * MIB, "Vulkan0": 1000 * MIB}, BUDGETS, placed,
                                     ["on_1", "ram_only", "old_on_0"])
    assert victims == ["old_on_0"] and mib(where) == {RAM_DEVICE: 100, "Vulkan0": 1000}


def test_a_movable_model_goes_where_eviction_is_needed_least():
    placed = {"x": {"Vulkan0": 3000 * MIB}, "y": {"Vulkan1": 5500 * MIB}}
    # Neither GPU holds 1500 MiB beside what is there: Vulkan0 (1000 MiB left) beats Vulkan1 (500) and x goes.
    where, victims = plan_on_devices({ANY_GPU: 1500 * MIB}, BUDGETS, placed, ["y", "x"])
    assert (mib(where), victims) == ({"Vulkan0": 1500}, ["x"])


def test_a_short_device_with_nothing_evictable_is_refused():
    placed = {"pinned": {"Vulkan0": 3500 * MIB}}
    assert plan_on_devices({"Vulkan0": 1000 * MIB}, BUDGETS, placed, []) is None
    assert plan_on_devices({ANY_GPU: 7000 * MIB}, BUDGETS, {}, []) is None  # larger than either GPU


def test_ram_counts_too():
    placed = {"big": {RAM_DEVICE: 7000 * MIB}}
    where, victims = plan_on_devices({RAM_DEVICE: 2000 * MIB, ANY_GPU: 100 * MIB}, BUDGETS, placed, ["big"])
    assert victims == ["big"] and where["Vulkan1"] == 100 * MIB  # the GPU with the most room


def _manager(specs: dict[str, ModelSpec], budgets: dict[str, int]) -> ResidencyManager:
    return ResidencyManager(lambda: specs, lambda: 0, lambda event: None, device_budgets=lambda: budgets)


def _resident(manager: ResidencyManager, spec: ModelSpec, placed: dict[str, int], last_used: float) -> _Model:
    m = manager._sync(spec)
    m.state, m.placed, m.resident_bytes, m.last_used = ModelState.READY, placed, sum(placed.values()), last_used
    return m


def test_the_manager_plans_per_device_and_starts_the_runner_on_the_chosen_gpu(tmp_path):
    runner = RunnerSpec(model_name="new", model_path=str(tmp_path / "new.gguf"), gpu_layers=99)
    new = ModelSpec("new", runner.model_path, 1200 * MIB, runner=runner,
                    need_by_device={RAM_DEVICE: 200 * MIB, ANY_GPU: 1000 * MIB})
    on0 = ModelSpec("on0", "on0.gguf", 3600 * MIB)
    on1 = ModelSpec("on1", "on1.gguf", 5600 * MIB)
    manager = _manager({"new": new, "on0": on0, "on1": on1}, BUDGETS)
    _resident(manager, on0, {RAM_DEVICE: 100 * MIB, "Vulkan0": 3500 * MIB}, last_used=2.0)
    _resident(manager, on1, {RAM_DEVICE: 100 * MIB, "Vulkan1": 5500 * MIB}, last_used=1.0)
    m = manager._sync(new)
    victims, placed = manager._plan_room(m)
    # Vulkan0 and Vulkan1 have 500 MiB left each: neither holds 1000 MiB without evicting. Vulkan0 comes first (a tie
    # in room, by name), and only the model on it goes, though on1 was used less recently.
    assert [v.name for v in victims] == ["on0"] and mib(placed) == {RAM_DEVICE: 200, "Vulkan0": 1000}
    started = _on_device(new, placed)
    assert started.runner.devices == ("Vulkan0",)
    args = started.runner.command(port=1)
    assert args[args.index("--device") + 1] == "Vulkan0"


def test_the_manager_refuses_with_the_short_device_named():
    on0 = ModelSpec("on0", "on0.gguf", 3600 * MIB, policy="pinned")
    new = ModelSpec("new", "new.gguf", 1000 * MIB, need_by_device={"Vulkan0": 1000 * MIB})
    manager = _manager({"new": new, "on0": on0}, BUDGETS)
    _resident(manager, on0, {"Vulkan0": 3500 * MIB}, last_used=1.0)
    with pytest.raises(NotEnoughMemory) as exc:
        manager._plan_room(manager._sync(new))
    assert "Vulkan0 needs 1000 MiB beside 3500 MiB of 4000 MiB" in str(exc.value)
    assert "cannot evict on0 (pinned)" in str(exc.value)
    assert exc.value.budget_bytes == 4000 * MIB


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("need") / "dense.gguf"
    make_model(replace(SHAPES["tiny"], name="dense", n_vocab=1024, n_embd=256, n_layer=8, n_head=4, n_head_kv=2,
                       n_ff=1024, n_ctx_train=32768), path)
    return scan(None, path)[0], model_tensors(path)


def test_need_per_device_of_a_runner(dense):
    entry, tensors = dense
    runner = RunnerSpec(model_name="dense", model_path=str(entry.path), gpu_layers=9)
    total, kv, compute = 64 * MIB, 8 * MIB, 4 * MIB
    two = [gpu("Vulkan0", 4096), gpu("Vulkan1", 8192)]
    need = device_need(entry, tensors, runner, total, kv, compute, two)
    # Every layer fits one GPU: keyed ANY_GPU, the token embedding in RAM with the rest of the total.
    assert set(need) == {CPU, ANY_GPU} and sum(need.values()) == total
    assert need[CPU] >= dict(tensors)["token_embd.weight"]
    # Devices named by the admin: laid out over them as llama.cpp would, each by name.
    split = device_need(entry, tensors, replace(runner, devices=("Vulkan0", "Vulkan1")), total, kv, compute, two)
    assert set(split) == {CPU, "Vulkan0", "Vulkan1"} and sum(split.values()) == total
    # No GPU layer: all in RAM.
    assert device_need(entry, tensors, replace(runner, gpu_layers=0), total, kv, compute, two) == {CPU: total}


def test_a_gpu_share_with_no_gpu_left_is_counted_in_ram():
    where, victims = plan_on_devices({RAM_DEVICE: 100 * MIB, ANY_GPU: 900 * MIB}, {RAM_DEVICE: 8000 * MIB}, {}, [])
    assert (mib(where), victims) == ({RAM_DEVICE: 1000}, [])
