"""Which runners a bench session starts: enough slots per level, slot sweeps, and the memory check."""

from app.verdict.replay import BenchConfig, plan_for
from app.verdict.runners import ctx_for, plan_runners
from app.verdict.scenarios import load_scenario

MODES = ("continuous", "serial", "static")
MIB = 1024 * 1024


def test_levels_above_the_slots_get_runners_with_enough_slots():
    p = plan_runners([1, 2, 4, 8, 16, 32], MODES, parallel=8, n_ctx=8192)
    assert [(g.slots, g.n_ctx, g.levels) for g in p.groups] == [
        (8, 8192, (1, 2, 4, 8)), (16, 16384, (16,)), (32, 32768, (32,))]
    # Each level is measured once per mode.
    assert p.runs() == 6 * 3 and p.runs(repeats=2) == 36
    assert p.notes == {} and p.skipped == ()


def test_a_slot_sweep_runs_every_level_on_every_slot_count_and_serial_once():
    p = plan_runners([4, 8], MODES, parallel=8, n_ctx=8192, slots_axis=(16, 4, 8))
    assert [(g.slots, g.n_ctx, g.levels, g.modes, g.once_levels) for g in p.groups] == [
        (4, 4096, (4, 8), MODES, (4, 8)),
        (8, 8192, (4, 8), ("continuous", "static"), ()),
        (16, 16384, (4, 8), ("continuous", "static"), ())]
    # Serial runs one request at a time whatever its slots: 2 levels × (3 + 2 + 2) modes.
    assert p.runs() == 14


def test_memory_caps_the_slots_and_says_why():
    # 100 MiB a runner plus 64 KiB a KV cell; room for three runners of 16 slots, not more.
    def runner_bytes(n_ctx, slots):
        return 100 * MIB + n_ctx * 64 * 1024

    headroom = 3 * (100 * MIB + 16384 * 64 * 1024)  # exactly 16 slots' worth for three runners
    p = plan_runners([8, 16, 32, 64], MODES, parallel=8, n_ctx=8192, runner_bytes=runner_bytes,
                     headroom_bytes=headroom, memory="RAM free now")
    assert [(g.slots, g.levels) for g in p.groups] == [(8, (8,)), (16, (16, 32, 64))]
    assert set(p.notes) == {32, 64}
    assert p.notes[32].startswith("32 slots would need 6.29 GiB for 3 runners, 3.29 GiB free (RAM free now): "
                                  "measured with 16, the most that fit")
    swept = plan_runners([8], MODES, parallel=8, n_ctx=8192, slots_axis=(8, 32), runner_bytes=runner_bytes,
                         headroom_bytes=headroom, memory="RAM free now")
    assert [g.slots for g in swept.groups] == [8]
    assert swept.skipped == ("32 slots: 3 runners need 6.29 GiB, 3.29 GiB free (RAM free now)",)
    nothing = plan_runners([1], MODES, parallel=1, n_ctx=512, runner_bytes=runner_bytes, headroom_bytes=MIB)
    assert nothing.groups == () and nothing.skipped[0].startswith("level 1: even 1 slot needs")


def test_kv_cells_per_slot_stay_the_same():
    assert ctx_for(8192, 8, 8) == 8192 and ctx_for(8192, 8, 32) == 32768 and ctx_for(1000, 3, 2) == 668


def test_external_and_llama_server_targets():
    p = plan_runners([1, 16], ("continuous",), parallel=8, n_ctx=8192, llama_server=True, external=True)
    assert [(g.slots, g.llama_server, g.external) for g in p.groups] == [(8, True, True), (16, True, True)]
    assert p.runs() == 2 * 3


def test_the_bench_estimates_the_real_model_against_free_memory(gemma_path):
    household = load_scenario("household")
    p = plan_for(BenchConfig(levels=(1, 64), model_path=str(gemma_path), n_ctx=8192, parallel=8), household)
    assert p.memory == "RAM free now, less the reserve"
    est = {g.slots: g.estimate_bytes for g in p.groups}
    # Three runners of 235 MiB weights each at least, and more KV with more slots.
    assert est[8] > 3 * 235 * MIB and est[64] > est[8]
    # A script's level is its request count, not an overlap: it keeps the configured slots.
    script = plan_for(BenchConfig(model_path=str(gemma_path), parallel=8, modes=("continuous",)),
                      load_scenario("voice-under-background"))
    assert [(g.slots, g.levels) for g in script.groups] == [(8, (14,))]
    unchecked = plan_for(BenchConfig(levels=(2,), model_path="/nonexistent.gguf"), household)
    assert unchecked.memory.startswith("not checked")
