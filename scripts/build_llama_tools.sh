#!/usr/bin/env bash
# Builds llama.cpp's `llama-batched-bench` and `llama-server` from the llama.cpp tree vendored in
# the pinned llama-cpp-python sdist, so the C++ reference runs the very code the engine links.
#
# Usage: scripts/build_llama_tools.sh [--vulkan | --cpu-all]
#   --vulkan            the Vulkan variant (Intel/AMD GPUs, Mesa's lavapipe in CI), cached apart in
#                       <root>/<version>-vulkan: llama-server plus the shared libraries (libllama,
#                       libggml*, libmtmd) that Hearth's runner loads through LLAMA_CPP_LIB_PATH, all
#                       from one build of the vendored tree, so the runner and the oracle run the same
#                       code. Needs glslc and the Vulkan headers/loader (Debian: glslc libvulkan-dev).
#   --cpu-all           the portable CPU build the image ships, cached apart in <root>/<version>-cpu-all:
#                       shared libraries with every x86-64 (or arm64) CPU variant as a module
#                       (GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS, libggml-cpu-<variant>.so), the best one
#                       for the CPU picked when Hearth loads them (app.llama_load), as llama.cpp's own
#                       images do. A Celeron without AVX and a Xeon with AMX run the same image.
#   HEARTH_TOOLS_CACHE  cache root (default: ~/.cache/hearth/llama-tools); binaries land in
#                       <root>/<version>/bin
#   CMAKE_ARGS          extra cmake arguments, e.g. "-DGGML_CUDA=ON" for a CUDA build
#   PYTHON              interpreter whose pip fetches the sdist (default: python3)
# A second run with the same version and CMAKE_ARGS only prints the two binary paths.
set -euo pipefail

variant=cpu
case "${1:-}" in
    "") ;;
    --vulkan) variant=vulkan ;;
    --cpu-all) variant=cpu-all ;;
    *) echo "usage: $0 [--vulkan | --cpu-all]" >&2; exit 2 ;;
esac

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python3}"

# The pin is the single source of truth: the reference must match the bindings' llama.cpp.
version="$(sed -n 's/^[[:space:]]*"llama-cpp-python==\([^"]*\)".*$/\1/p' "$repo_root/pyproject.toml" \
    | head -n 1)"
if [[ -z "$version" ]]; then
    echo "error: no exact 'llama-cpp-python==X' pin found in $repo_root/pyproject.toml" >&2
    exit 1
fi

cache_root="${HEARTH_TOOLS_CACHE:-$HOME/.cache/hearth/llama-tools}"
dest="$cache_root/$version"
if [[ "$variant" != cpu ]]; then
    dest="$cache_root/$version-$variant"
fi
bin_dir="$dest/bin"
src_dir="$dest/src/llama_cpp_python-$version"
build_dir="$dest/build"
stamp="$dest/build.stamp"
targets=(llama-batched-bench llama-server)
extra_cmake_args="${CMAKE_ARGS:-}"

mkdir -p "$dest"

# Two concurrent runs would fight over one build tree; the second waits and then hits the cache.
exec 9>"$dest/.lock"
flock 9

print_paths() {
    for target in llama-batched-bench llama-server; do
        echo "$bin_dir/$target"
    done
}

# Why each option:
# - LLAMA_CURL is deprecated and ignored in this llama.cpp; its HTTP client is cpp-httplib, and
#   LLAMA_OPENSSL=OFF keeps it from linking TLS: these tools never fetch models.
# - LLAMA_USE_PREBUILT_UI=OFF / LLAMA_BUILD_UI=OFF: otherwise llama-server's web UI is downloaded
#   from Hugging Face (or built with npm) at build time; the server then runs without a UI.
# - FETCHCONTENT_FULLY_DISCONNECTED=ON: an option pulled in through CMAKE_ARGS that would fetch
#   sources from git (BoringSSL, CCCL, KleidiAI) fails loudly instead of downloading.
# - BUILD_SHARED_LIBS=OFF: self-contained binaries that don't depend on the build tree's rpath.
# - GGML_NATIVE stays at its default (ON), as in the pip build of llama-cpp-python on this machine,
#   so both sides run the same CPU kernels.
fixed_args=(
    -DCMAKE_BUILD_TYPE=Release
    -DLLAMA_BUILD_COMMON=ON
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON
)
# The Vulkan variant is built shared: its libllama/libggml*/libmtmd are what the runner loads
# (LLAMA_CPP_LIB_PATH), so the ctypes bindings meet the very build llama-server runs. Build rpaths
# relative to $ORIGIN and every library lands in bin/ beside llama-server, so bin/ can be copied whole.
if [[ "$variant" == vulkan ]]; then
    fixed_args+=(-DBUILD_SHARED_LIBS=ON -DGGML_VULKAN=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON)
    targets+=(llama mtmd)
elif [[ "$variant" == cpu-all ]]; then
    # GGML_NATIVE=OFF: no code for the build machine's CPU alone; each variant module carries its own
    # instruction set, and ggml scores them against the CPU at load time.
    fixed_args+=(-DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF
                 -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON)
    targets+=(llama mtmd)
else
    fixed_args+=(-DBUILD_SHARED_LIBS=OFF)
fi

# The stamp records what the binaries were built from, so changing the options rebuilds them.
stamp_text="version=$version
cmake_args=${fixed_args[*]}
extra_cmake_args=$extra_cmake_args"

binaries_present() {
    for target in llama-batched-bench llama-server; do
        [[ -x "$bin_dir/$target" ]] || return 1
    done
}

if binaries_present && [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$stamp_text" ]]; then
    print_paths
    exit 0
fi

start_s=$(date +%s)

if [[ ! -f "$src_dir/vendor/llama.cpp/CMakeLists.txt" ]]; then
    sdist_dir="$dest/sdist"
    mkdir -p "$sdist_dir"
    sdist="$sdist_dir/llama_cpp_python-$version.tar.gz"
    # The CPU variant may have fetched the same sdist already.
    if [[ ! -f "$sdist" ]] && [[ -f "$cache_root/$version/sdist/$(basename "$sdist")" ]]; then
        cp "$cache_root/$version/sdist/$(basename "$sdist")" "$sdist"
    fi
    if [[ ! -f "$sdist" ]]; then
        echo "fetching llama-cpp-python==$version sdist from the package index" >&2
        # --no-binary for this package alone: with :all: pip would also build the sdist's build
        # dependencies (CMake among them) from source just to read its metadata, many minutes in an image build.
        "$python_bin" -m pip download --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$version" -d "$sdist_dir" >&2
    fi
    # Unpack beside the target and rename, so an interrupted extraction never looks complete.
    unpack_dir="$(mktemp -d "$dest/src.XXXXXX")"
    tar -xzf "$sdist" -C "$unpack_dir"
    mkdir -p "$dest/src"
    rm -rf "$src_dir"
    mv "$unpack_dir/llama_cpp_python-$version" "$src_dir"
    rmdir "$unpack_dir"
fi

# The pinned llama.cpp builds its instance with VK_EXT_layer_settings (Vulkan headers >= 1.3.272)
# for validation builds only; Debian 12 ships 1.3.239. Guarding that block keeps the distro's
# headers (no download, the same headers the loader was built with) and changes nothing at run
# time: without the extension the instance is created as before, with no layer settings chained.
if [[ "$variant" == vulkan ]]; then
    "$python_bin" - "$src_dir/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PATCH'
import sys
path = sys.argv[1]
text = open(path, encoding="utf-8").read()
start = "    VkBool32 enable_best_practice = layer_settings;\n"
end = ("    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, "
       "extensions, &layer_setting_info);\n")
if "#ifdef VK_EXT_layer_settings" not in text:
    if start not in text or end not in text:
        sys.exit("error: ggml-vulkan.cpp no longer has the expected layer-settings block; update the guard")
    plain = ("    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, "
             "extensions);\n")
    text = text.replace(start, "#ifdef VK_EXT_layer_settings\n" + start, 1)
    text = text.replace(end, end + "#else\n" + plain + "#endif\n", 1)
    open(path, "w", encoding="utf-8").write(text)
PATCH
fi

# A build tree configured with other CMAKE_ARGS (say CPU, now CUDA) keeps stale cache entries,
# so it starts afresh; the fixed options are passed every time and need no such care.
configured="$dest/configured-extra-args"
if [[ -d "$build_dir" ]] \
    && { [[ ! -f "$configured" ]] || [[ "$(cat "$configured")" != "$extra_cmake_args" ]]; }; then
    rm -rf "$build_dir"
fi
rm -f "$stamp"
printf '%s' "$extra_cmake_args" > "$configured"

generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi

# Word-split on purpose, as llama-cpp-python's own build does with CMAKE_ARGS.
read -r -a extra_args <<< "$extra_cmake_args"

cmake -S "$src_dir/vendor/llama.cpp" -B "$build_dir" "${generator[@]}" "${fixed_args[@]}" \
    "${extra_args[@]}" >&2

cmake --build "$build_dir" --config Release --target "${targets[@]}" -j "$(nproc)" >&2

mkdir -p "$bin_dir"
installed=(llama-batched-bench llama-server)
if [[ "$variant" != cpu ]]; then
    # The shared libraries under the names the ctypes loader opens (libllama.so, libmtmd.so) and
    # the sonames the binaries and libraries ask for (libggml.so.0, ...), links kept as links: one
    # file per library, so a second open by another name finds the copy already loaded.
    for lib in "$build_dir"/bin/lib*.so*; do
        installed+=("$(basename "$lib")")
    done
fi
for target in "${installed[@]}"; do
    built="$build_dir/bin/$target"
    if [[ ! -e "$built" ]] && [[ ! -L "$built" ]]; then
        echo "error: build finished but $built is missing" >&2
        exit 1
    fi
    # Copy then rename: a reader never sees a half-written binary.
    cp -P "$built" "$bin_dir/.$target.tmp"
    mv -f "$bin_dir/.$target.tmp" "$bin_dir/$target"
done
printf '%s' "$stamp_text" > "$stamp"

echo "built llama.cpp tools for llama-cpp-python $version in $(( $(date +%s) - start_s )) s" >&2
print_paths
