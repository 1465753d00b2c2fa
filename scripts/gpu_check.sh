#!/usr/bin/env bash
# One prepared GPU check for Hearth (issue 18): build llama.cpp's CUDA libraries for the installed
# GPU, point the pinned bindings at them, make random-weight models of real shapes, and measure:
# engine vs llama-batched-bench (1/8/32/64 sequences), the served comparison against a CUDA
# llama-server, voice under background, the VRAM estimate against NVML, the NVML sampler.
# Every figure goes into JSON under the output folder.
#
# Two verbs:
#   scripts/gpu_check.sh prepare [--carry DIR]
#       HERE (a machine with PyPI): packs what the GPU machine cannot fetch into DIR (default
#       .gpu_carry, ignored by git; well under 64 MiB): the llama.cpp tree vendored in the pinned
#       llama-cpp-python sdist (without docs, models, UI sources and foreign GPU backends), the
#       bindings' Python package from the same sdist, and wheels of the Python packages Hearth
#       imports that the GPU machine's image lacks (for CPython $WHEEL_PYTHON, default 3.12).
#   scripts/gpu_check.sh run [--cpu] [--carry DIR] [--out DIR] [--work DIR] [--budget-s N]
#       THERE: builds, makes the models, runs the steps in order of importance while the time
#       budget (default 540 s, one device command may run 600 s) allows; a step that no longer
#       fits is recorded as skipped. Builds and models are kept in --work, so a second call on
#       the same (warm) machine resumes where the first stopped. --out defaults to $OUT.
#       --cpu: no CUDA (the dry-run of the whole path on a CPU machine): a CPU build, the tiny
#       and 1B shapes, short levels.
#
# What the GPU machine is assumed to offer (checked first; a missing piece fails at once, by name):
#   - x86-64 Linux with bash, coreutils, tar, gzip, timeout; NO network at all (nothing is fetched);
#   - python3 >= 3.11 ($PYTHON) with pip, numpy, psutil, jinja2, werkzeug, httpx, prometheus_client,
#     tqdm, yaml, click and pynvml (nvidia-ml-py) already installed (the 'cuda' image's python has
#     them); everything else Hearth imports travels as wheels;
#   - cmake >= 3.21 and a C/C++17 compiler; ninja if present (faster);
#   - for the GPU run: nvcc (the CUDA toolkit) and an NVIDIA driver with nvidia-smi;
#   - free disk under --work: ~3 GB, plus ~9 GB when the 8B shape fits the budget.
# Usage on the device tool (carry names the folder `prepare` filled):
#   run(command="bash scripts/gpu_check.sh run", carry=[".gpu_carry"], timeout_s=600)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="$(sed -n 's/^[[:space:]]*"llama-cpp-python==\([^"]*\)".*$/\1/p' "$repo_root/pyproject.toml" | head -n 1)"
python_bin="${PYTHON:-python3}"
carry="$repo_root/.gpu_carry"
out="${OUT:-$repo_root/.gpu_out}"
work="${GPU_CHECK_WORK:-/tmp/hearth-gpu-check}"
budget_s=540
cpu_only=0
wheel_python="${WHEEL_PYTHON:-3.12}"

# Python packages Hearth imports on the measured paths that the GPU image does not ship (its
# package list, /work/.library/device/KINDS.md, has no pydantic, sqlalchemy, gguf, ...), with their
# own needs. Versions: those installed beside the tests here ($PYTHON), so both run the same code.
WHEELS=(gguf gunicorn pydantic pydantic-core sqlalchemy alembic apscheduler cachetools diskcache mako
        annotated-types typing-inspection tzlocal greenlet)
# Modules the steps import, checked after the install (their absence is the usual failure).
MODULES=(numpy psutil jinja2 werkzeug httpx prometheus_client tqdm yaml gguf gunicorn pydantic pydantic_core
         sqlalchemy alembic apscheduler cachetools diskcache llama_cpp)

die() { echo "gpu_check: $*" >&2; exit 1; }
say() { echo "gpu_check [$(date +%H:%M:%S)] $*" >&2; }

vendor_dir() {
    # The unpacked sdist that scripts/build_llama_tools.sh leaves in its cache.
    local root="${HEARTH_TOOLS_CACHE:-$HOME/.cache/hearth/llama-tools}/$version/src/llama_cpp_python-$version"
    [[ -f "$root/vendor/llama.cpp/CMakeLists.txt" ]] || die "no unpacked llama-cpp-python $version sdist at $root (run scripts/build_llama_tools.sh once)"
    echo "$root"
}

# -- prepare (here) ---------------------------------------------------------------------------

prepare() {
    [[ -n "$version" ]] || die "no llama-cpp-python==X pin in pyproject.toml"
    local sdist; sdist="$(vendor_dir)"
    mkdir -p "$carry/wheels"
    # .gitignore lists it, so it travels to the device only when named in `carry`.
    git -C "$repo_root" check-ignore -q "$carry/version" 2>/dev/null || die "$carry is not ignored by git (.gitignore)"
    say "packing the vendored llama.cpp sources ($version)"
    # Only what the libraries, llama-batched-bench and llama-server build from: the CPU and CUDA
    # backends, not the others; the UI's build files, not its sources (it is built without UI).
    tar -C "$sdist/vendor" -czf "$carry/llama.cpp.tar.gz" \
        --exclude='llama.cpp/docs' --exclude='llama.cpp/models' --exclude='llama.cpp/media' \
        --exclude='llama.cpp/.github' --exclude='llama.cpp/.devops' --exclude='llama.cpp/benches' \
        --exclude='llama.cpp/examples' --exclude='llama.cpp/tests' --exclude='llama.cpp/gguf-py' \
        --exclude='llama.cpp/conversion' --exclude='llama.cpp/tools/ui/src' --exclude='llama.cpp/tools/ui/tests' \
        --exclude='llama.cpp/tools/ui/package-lock.json' \
        --exclude='llama.cpp/ggml/src/ggml-vulkan' --exclude='llama.cpp/ggml/src/ggml-sycl' \
        --exclude='llama.cpp/ggml/src/ggml-opencl' --exclude='llama.cpp/ggml/src/ggml-metal' \
        --exclude='llama.cpp/ggml/src/ggml-hexagon' --exclude='llama.cpp/ggml/src/ggml-webgpu' \
        --exclude='llama.cpp/ggml/src/ggml-openvino' --exclude='llama.cpp/ggml/src/ggml-et' \
        --exclude='llama.cpp/ggml/src/ggml-cann' --exclude='llama.cpp/ggml/src/ggml-zdnn' \
        --exclude='llama.cpp/ggml/src/ggml-zendnn' --exclude='llama.cpp/ggml/src/ggml-virtgpu' \
        llama.cpp
    say "packing the bindings' Python package"
    tar -C "$sdist" -czf "$carry/llama_cpp_py.tar.gz" --exclude='llama_cpp/server' --exclude='llama_cpp/lib' llama_cpp
    echo "$version" > "$carry/version"
    say "fetching wheels for CPython $wheel_python (manylinux x86-64)"
    local plats=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    local pins; pins="$("$python_bin" -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "${WHEELS[@]}")" \
        || die "$python_bin lacks one of: ${WHEELS[*]}"
    read -r -a pins <<< "$pins"
    rm -f "$carry"/wheels/*.whl
    "$python_bin" -m pip download -q --no-deps --only-binary=:all: --python-version "$wheel_python" \
        --implementation cp "${plats[@]}" -d "$carry/wheels" "${pins[@]}" \
        || die "pip could not fetch wheels for CPython $wheel_python: ${pins[*]}"
    du -sh "$carry" >&2
    local bytes; bytes="$(du -sb "$carry" | cut -f1)"
    (( bytes < 48 * 1024 * 1024 )) || die "the carry folder is $bytes bytes: too close to the 64 MiB a device call takes"
    say "ready: run(command=\"bash scripts/gpu_check.sh run\", carry=[\".gpu_carry\"], timeout_s=600)"
}

# -- run (there) ------------------------------------------------------------------------------

t_start=$(date +%s)
results=""
steps_file=""
log_file=""

left_s() { echo $(( budget_s - ($(date +%s) - t_start) )); }

# step NAME NEED_S COMMAND...: run when NEED_S seconds are left, bounded by what is left; record it.
# A step that succeeded in an earlier call on this (warm) machine is not run again: its figures
# are still in $results, which outlives $OUT (emptied before every device command).
step() {
    local name="$1" need="$2"; shift 2
    local left; left="$(left_s)"
    local t0; t0=$(date +%s)
    if [[ -f "$results/$name.done" ]]; then
        say "step $name: done in an earlier call, kept"
        return 0
    fi
    if (( left < need )); then
        say "skip $name: needs ~${need} s, ${left} s left"
        printf '{"step": "%s", "status": "skipped", "reason": "out of time (%s s left, ~%s s needed)"}\n' \
            "$name" "$left" "$need" >> "$steps_file"
        return 0
    fi
    say "step $name (up to ${left} s)"
    local rc=0
    timeout --kill-after=10 "$left" "$@" >> "$log_file" 2>&1 || rc=$?
    local status=ok
    (( rc == 0 )) || status="failed"
    (( rc == 124 || rc == 137 )) && status="timed out"
    printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %d}\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" >> "$steps_file"
    say "  $name: $status ($(( $(date +%s) - t0 )) s)"
    if [[ "$status" == ok ]]; then
        touch "$results/$name.done"
    else
        tail -n 20 "$log_file" >&2
    fi
    return 0
}

check_machine() {
    [[ "$(uname -m)" == x86_64 ]] || die "expected x86-64, got $(uname -m)"
    for tool in tar gzip timeout cmake "$python_bin"; do
        command -v "$tool" >/dev/null 2>&1 || die "'$tool' is missing (see the assumptions at the top of $0)"
    done
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler (c++ or g++)"
    "$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$python_bin is older than 3.11"
    "$python_bin" -m pip --version >/dev/null 2>&1 || die "$python_bin has no pip (needed to unpack the carried wheels)"
    [[ -f "$carry/llama.cpp.tar.gz" && -f "$carry/llama_cpp_py.tar.gz" ]] || \
        die "no prepared carry folder at $carry (run 'scripts/gpu_check.sh prepare' where PyPI is reachable, then carry it)"
    [[ "$(cat "$carry/version")" == "$version" ]] || die "the carry folder is for llama-cpp-python $(cat "$carry/version"), the pin is $version"
    if (( ! cpu_only )); then
        command -v nvcc >/dev/null 2>&1 || die "nvcc is missing: the CUDA toolkit is needed to build for the GPU (or pass --cpu)"
        command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi is missing: no NVIDIA driver (or pass --cpu)"
        nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi sees no GPU"
    fi
    local free_kb; free_kb="$(df -Pk "$work" | awk 'NR==2 {print $4}')"
    (( free_kb > 3 * 1024 * 1024 )) || die "less than 3 GB free under $work"
}

install_python() {
    local site="$work/site"
    if [[ ! -f "$site/.installed" ]]; then
        rm -rf "$site"; mkdir -p "$site"
        tar -C "$site" -xzf "$carry/llama_cpp_py.tar.gz"
        # Only the wheels whose module the interpreter lacks: the image's own versions stay.
        local wheel mod
        for wheel in "$carry"/wheels/*.whl; do
            mod="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z' 'a-z')"
            if ! "$python_bin" -c "import importlib, sys; importlib.import_module(sys.argv[1])" "$mod" >/dev/null 2>&1; then
                "$python_bin" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" \
                    || die "could not install $(basename "$wheel") for $("$python_bin" -V)"
            fi
        done
        touch "$site/.installed"
    fi
    export PYTHONPATH="$repo_root:$site${PYTHONPATH:+:$PYTHONPATH}"
}

check_modules() {
    local missing
    missing="$("$python_bin" - "${MODULES[@]}" <<'EOF'
import importlib, sys
gone = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # ImportError, or the bindings failing to load the library
        gone.append(f"{name} ({type(exc).__name__}: {exc})")
print("; ".join(gone))
EOF
)"
    [[ -z "$missing" ]] || die "Python modules missing or broken: $missing"
}

build_llama() {
    local src="$work/llama.cpp" build="$work/build"
    [[ -f "$src/CMakeLists.txt" ]] || tar -C "$work" -xzf "$carry/llama.cpp.tar.gz"
    local args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON
                -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
                -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
                -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
    if (( ! cpu_only )); then
        # Only the installed GPU's architecture: a fat build for every architecture takes far longer.
        local cc; cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')"
        [[ -n "$cc" ]] || die "nvidia-smi did not report the GPU's compute capability"
        args+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$cc")
    fi
    local stamp="${args[*]}"
    if [[ -f "$build/.stamp" && "$(cat "$build/.stamp")" == "$stamp" && -x "$build/bin/llama-server" ]]; then
        say "llama.cpp already built ($build)"
        return 0
    fi
    local gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
    cmake -S "$src" -B "$build" "${gen[@]}" "${args[@]}"
    cmake --build "$build" --config Release -j "$(nproc)" --target llama llama-batched-bench llama-server
    [[ -f "$build/bin/libllama.so" ]] || die "the build left no $build/bin/libllama.so"
    printf '%s' "$stamp" > "$build/.stamp"
}

run_checks() {
    mkdir -p "$out" "$work"
    results="$work/results"
    mkdir -p "$results"
    steps_file="$results/steps.jsonl"
    log_file="$results/run.log"
    printf '{"call": "started", "at": "%s", "budget_s": %s, "cpu_only": %s}\n' "$(date -Is)" "$budget_s" "$cpu_only" >> "$steps_file"
    check_machine
    say "machine ok; budget ${budget_s} s; work in $work; figures to $out"
    install_python
    # A function cannot run under `timeout`: the build runs as this script's internal verb.
    step build 60 env GPU_CHECK_WORK="$work" bash "$repo_root/scripts/gpu_check.sh" _build $( (( cpu_only )) && echo --cpu ) --carry "$carry"
    # A build cut short by the budget leaves some of the pieces: all three are needed.
    local piece
    for piece in libllama.so llama-batched-bench llama-server; do
        [[ -e "$work/build/bin/$piece" ]] || { cp "$log_file" "$out/" || true
            die "the llama.cpp build has no $piece (cut short? a second call resumes it); see $out/run.log"; }
    done
    export LLAMA_CPP_LIB_PATH="$work/build/bin"
    check_modules
    local bin="$work/build/bin" models="$work/models"
    mkdir -p "$models"
    local hearth=("$python_bin" -m app.cli)
    export HEARTH_DATA="$work/data"
    local gl=99 threads; threads="$(nproc)"
    (( threads > 8 )) && threads=8
    local levels="1,8,32,64" small="llama-3.2-1b" ctx=16384
    if (( cpu_only )); then
        gl=0; levels="1,2"; ctx=2048; threads="$(nproc)"
        step model_tiny 5 "${hearth[@]}" models random tiny "$models/tiny.gguf"
    fi
    [[ -f "$models/$small.gguf" ]] || step "model_$small" 20 "${hearth[@]}" models random "$small" "$models/$small.gguf"
    local m1="$models/$small.gguf" engine_model="$models/$small.gguf"
    # On a CPU the 1B shape decodes at a few tokens per second: the dry-run measures the tiny one.
    (( cpu_only )) && engine_model="$models/tiny.gguf" && m1="$models/tiny.gguf"
    step engine_1b 120 "${hearth[@]}" bench engine --model "$engine_model" --reference "$bin/llama-batched-bench" \
        --levels "$levels" --modes continuous --gpu-layers "$gl" --threads "$threads" --ctx "$ctx" \
        --parallel "${levels##*,}" --pressure-ctx 0 --json "$results/engine_1b.json"
    step vram_nvml 45 "${hearth[@]}" bench vram --model "$m1" --ctx 8192 --parallel 8 --gpu-layers "$gl" \
        --threads "$threads" --requests 8 --json "$results/vram.json"
    step served_1b 120 "${hearth[@]}" bench replay --model "$engine_model" --scenario household --levels "$levels" \
        --modes continuous --llama-server "$bin/llama-server" --gpu-layers "$gl" --threads "$threads" \
        --ctx "$ctx" --parallel "${levels##*,}" --json "$results/served_1b.json"
    step voice_under_background 90 "${hearth[@]}" bench replay --model "$engine_model" \
        --scenario voice-under-background --levels 1 --modes continuous --llama-server "$bin/llama-server" \
        --gpu-layers "$gl" --threads "$threads" --ctx 8192 --parallel 8 --json "$results/voice.json"
    if (( ! cpu_only )); then
        [[ -f "$models/llama-3.1-8b.gguf" ]] || step model_llama-3.1-8b 90 \
            "${hearth[@]}" models random llama-3.1-8b "$models/llama-3.1-8b.gguf"
        [[ -f "$models/llama-3.1-8b.gguf" ]] && step engine_8b 150 "${hearth[@]}" bench engine \
            --model "$models/llama-3.1-8b.gguf" --reference "$bin/llama-batched-bench" --levels "$levels" \
            --modes continuous --gpu-layers "$gl" --threads "$threads" --ctx "$ctx" --parallel 64 \
            --pressure-ctx 0 --json "$results/engine_8b.json"
    fi
    "$python_bin" -m app.devtools.gpu.gpu_report "$results" "$budget_s" "$(( $(date +%s) - t_start ))" >/dev/null \
        || die "could not write $results/gpu_check.json"
    # At most 8 files come back from a device call: these are they.
    cp "$results"/gpu_check.json "$results"/steps.jsonl "$out/"
    for f in engine_1b engine_8b vram served_1b voice; do
        [[ -f "$results/$f.json" ]] && cp "$results/$f.json" "$out/"
    done
    tail -c 4000000 "$log_file" > "$out/run.log"
    say "done in $(( $(date +%s) - t_start )) s: $out/gpu_check.json"
}

verb="${1:-}"; shift || true
while (( $# )); do
    case "$1" in
        --cpu) cpu_only=1 ;;
        --carry) carry="$(cd "$2" && pwd)"; shift ;;
        --out) out="$2"; shift ;;
        --work) work="$2"; shift ;;
        --budget-s) budget_s="$2"; shift ;;
        *) die "unknown option $1" ;;
    esac
    shift
done
case "$verb" in
    prepare) prepare ;;
    run) run_checks ;;
    _build) mkdir -p "$work"; build_llama ;;
    *) die "usage: $0 prepare [--carry DIR] | run [--cpu] [--carry DIR] [--out DIR] [--work DIR] [--budget-s N]" ;;
esac
