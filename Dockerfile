# Hearth appliance image. No `# syntax=` line: BuildKit would fetch that frontend image from the hub, which an offline
# box (or a NAS behind a strict firewall) cannot reach; the built-in frontend has every feature used here. Every base image is pinned to an exact tag (tests/appliance checks it).
#
#   CPU (any x86-64, arm64):        docker build -t ghcr.io/hearth-llm/hearth:0.1.0 .
#                                   every CPU variant of llama.cpp (14 on x86-64), the best loaded at start: a Celeron
#                                   without AVX2 and a Xeon with AVX-512 or AMX each get their own code (a long compile)
#   NVIDIA GPU (CUDA llama.cpp):    docker build --build-arg ACCEL=cuda -t ghcr.io/hearth-llm/hearth:0.1.0-cuda .
#   Intel/AMD GPU (Vulkan):         docker build --build-arg ACCEL=vulkan -t ghcr.io/hearth-llm/hearth:0.1.0-vulkan .
#   CPU, the shorter build:         docker build --build-arg CPU_VARIANTS=wheel ...  (llama.cpp once, for AVX2 CPUs)
#   Other llama.cpp options:        --build-arg CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=86"
#
#   Behind a TLS-inspecting proxy (pip and npm need its CA): --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt
#   The CA reaches the RUN steps that download as a secret mount: it is in no layer of the image.
#
# Stages: `assets` (npm ci), `build-cpu` | `build-cuda` | `build-vulkan` (toolchain, chosen by ACCEL) → `build`
# (venv with llama-cpp-python compiled from source, then Hearth), `runtime-cpu` | `runtime-cuda` |
# `runtime-vulkan` → `runtime` (no compiler, no npm). BuildKit builds only the stages the chosen ACCEL reaches.

ARG ACCEL=cpu
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG NODE_IMAGE=node:22.17.0-bookworm-slim
# Ubuntu 24.04's Python is 3.12, which Hearth supports (requires-python >= 3.11).
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

# ---- front-end libraries, at the versions package-lock.json pins --------------------------------
FROM ${NODE_IMAGE} AS assets
WORKDIR /src
COPY package.json package-lock.json ./
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export NODE_EXTRA_CA_CERTS=/run/secrets/ca; fi \
 && npm ci --omit=dev --ignore-scripts --no-audit --no-fund

# ---- the dependency pins alone, out of pyproject.toml ---------------------------------------------
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml /tmp/
# The image speaks too: the tts extra (Piper, GPL-3.0; README "Speech out") is installed after the dependencies, in a
# layer of its own, so a voice's pin changing does not recompile llama.cpp.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /requirements.txt \
 && python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['optional-dependencies']['tts']))" \
        > /requirements-tts.txt \
 && grep -o '"llama-cpp-python==[^"]*"' /tmp/pyproject.toml > /llama-pin.toml

# ---- toolchains ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
# GGML_NATIVE=OFF: code for the CPU family, not for the build machine's CPU (a NAS Celeron would
# die on an illegal instruction from an image built on a desktop); GGML_NATIVE=OFF's default set still needs AVX2.
# With CPU_VARIANTS=all (the default) the runners load the portable build below instead (every CPU variant, the
# best at run time); the wheel's libraries then serve only as the bindings' fallback.
ENV DEFAULT_CMAKE_ARGS="-DGGML_NATIVE=OFF"
RUN python -m venv /opt/hearth/venv

FROM ${CUDA_DEVEL_IMAGE} AS build-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
# Pascal (GTX 10xx) to Hopper; fewer architectures build faster (override with CMAKE_ARGS).
ENV DEFAULT_CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=61;70;75;80;86;89;90"
RUN python3 -m venv /opt/hearth/venv

# Vulkan: the wheel stays the CPU build; scripts/build_llama_tools.sh --vulkan builds the same vendored llama.cpp
# shared with GGML_VULKAN (Debian's headers, its one incompatible block guarded) into /opt/hearth/llama-lib, which
# the runners load (HEARTH_LLAMA_BACKEND=vulkan in runtime-vulkan).
FROM ${PYTHON_IMAGE} AS build-vulkan
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake ninja-build glslc libvulkan-dev spirv-headers \
 && rm -rf /var/lib/apt/lists/*
ENV DEFAULT_CMAKE_ARGS="-DGGML_NATIVE=OFF"
RUN python -m venv /opt/hearth/venv

# ---- Hearth and its dependencies in one venv -----------------------------------------------------
FROM build-${ACCEL} AS build
ARG CMAKE_ARGS=""
ENV PATH=/opt/hearth/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/hearth/src
# Dependencies first (the `requirements` stage reads pyproject.toml's one list of pins), so the long llama.cpp compile
# stays cached while only Hearth's own code or pyproject's other tables change: the COPY below is keyed on the list's
# content, not on pyproject.toml's. llama-cpp-python is an sdist: always compiled.
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}" pip install -r /tmp/requirements.txt
COPY --from=requirements /requirements-tts.txt /tmp/requirements-tts.txt
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install -r /tmp/requirements-tts.txt
# The llama.cpp build the runners load, from the same pinned sdist, keyed on the pin and the build script alone (not
# on Hearth's code). CPU with CPU_VARIANTS=all: every x86-64/arm64 variant as a module, the best for the CPU loaded
# at run time (build_llama_tools.sh --cpu-all: a Celeron without AVX and a Xeon with AMX run one image); otherwise
# the wheel's GGML_NATIVE=OFF libraries (AVX2 needed). Vulkan: its shared build (--vulkan). CUDA: the wheel's.
ARG ACCEL
ARG CPU_VARIANTS=all
COPY scripts/build_llama_tools.sh /opt/hearth/llama-build/scripts/
COPY --from=requirements /llama-pin.toml /opt/hearth/llama-build/pyproject.toml
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && mkdir -p /opt/hearth/llama-lib \
 && case "$ACCEL/$CPU_VARIANTS" in cpu/all) variant=cpu-all ;; vulkan/*) variant=vulkan ;; *) variant= ;; esac \
 && if [ -n "$variant" ]; then \
        HEARTH_TOOLS_CACHE=/tmp/llama-tools PYTHON=python CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}" \
            /opt/hearth/llama-build/scripts/build_llama_tools.sh --$variant >/dev/null \
        && cp -a /tmp/llama-tools/*-$variant/bin/. /opt/hearth/llama-lib/ \
        && rm -f /opt/hearth/llama-lib/llama-batched-bench /opt/hearth/llama-lib/libllama-batched-bench-impl.so \
        && rm -rf /tmp/llama-tools; \
    fi \
 && rm -rf /opt/hearth/llama-build
COPY . ./
COPY --from=assets /src/node_modules ./node_modules
# Editable: templates/, static/, node_modules/ and migrations/ are found beside app/ exactly as in
# a checkout (app.web.ROOT, app.store.db.migrations_dir). Then what the image need not carry twice: llama.cpp's own
# install rules put a second copy of its libraries (and CMake files) in site-packages/lib, which nothing loads
# (llama_cpp loads llama_cpp/lib), and the wheel holds each library three times under its three names (36 + 16 MB).
RUN --mount=type=secret,id=ca,required=false \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && pip install --no-deps -e . \
 && python -m compileall -q app \
 && site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
 && rm -rf "$site/lib" "$site/include" \
 && cd "$site/llama_cpp/lib" \
 && for full in lib*.so.*.*.*; do \
        stem=${full%%.so.*}; \
        for short in "$stem.so" "$stem.so.0"; do \
            if [ -f "$short" ] && [ ! -L "$short" ] && cmp -s "$short" "$full"; then ln -sf "$full" "$short"; fi; \
        done; \
    done

# ---- runtimes ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-cpu
# tini: PID 1 that forwards SIGTERM to gunicorn and reaps orphans; libgomp1: llama.cpp's OpenMP;
# tzdata: TZ takes effect in the log and the dashboard's times; lame, flac: /v1/audio/speech's mp3 (OpenAI's default
# format) and flac, libsndfile1 its opus (app.speech.encode), a few MB.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini libgomp1 tzdata lame flac libsndfile1 \
 && rm -rf /var/lib/apt/lists/*
# The portable llama.cpp build when built (CPU_VARIANTS=all; app.llama_tools.load_backends loads the best variant for
# this CPU); an empty folder means the wheel's own libraries.
ENV HEARTH_LLAMA_LIB_DIR=/opt/hearth/llama-lib

FROM ${CUDA_RUNTIME_IMAGE} AS runtime-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tini libgomp1 tzdata python3 lame flac libsndfile1 \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true)
# What the NVIDIA container toolkit mounts into the container: the GPUs and the compute libraries.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM ${PYTHON_IMAGE} AS runtime-vulkan
# libvulkan1 (the loader) and mesa-vulkan-drivers (Intel's ANV, AMD's RADV); the host's /dev/dri is passed in by
# compose.vulkan.yaml, and the entrypoint keeps its render nodes' group for the dropped user.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini libgomp1 tzdata lame flac libsndfile1 libvulkan1 mesa-vulkan-drivers \
 && rm -rf /var/lib/apt/lists/*
ENV HEARTH_LLAMA_BACKEND=vulkan \
    HEARTH_LLAMA_LIB_DIR=/opt/hearth/llama-lib

FROM runtime-${ACCEL} AS runtime
ARG HEARTH_VERSION=0.1.0
LABEL org.opencontainers.image.title="Hearth" \
      org.opencontainers.image.description="The household's shared local LLM server" \
      org.opencontainers.image.version="${HEARTH_VERSION}" \
      org.opencontainers.image.source="https://github.com/hearth-llm/hearth"
# The image's own user, 1000:1000, is what runs when PUID/PGID are not given. The container
# starts as root only so the entrypoint can hand /data to PUID:PGID; it then drops to that user
# for good (app/entrypoint.py) before anything else runs. Platforms that start it unprivileged
# (TrueNAS 568, Umbrel 1000) skip that step.
RUN groupadd --gid 1000 hearth \
 && useradd --uid 1000 --gid 1000 --home-dir /home/hearth --create-home --shell /usr/sbin/nologin hearth \
 && mkdir -p /data /models \
 && chown hearth:hearth /data /models
COPY --from=build /opt/hearth /opt/hearth
ENV PATH=/opt/hearth/venv/bin:$PATH \
    HEARTH_DATA=/data \
    HEARTH_MODELS_DIR=/models \
    HEARTH_BIND=0.0.0.0:8080 \
    PUID=1000 \
    PGID=1000 \
    TZ=Etc/UTC \
    HOME=/home/hearth \
    HEARTH_REPACK_CACHE=/data/cache/repack \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
VOLUME ["/data", "/models"]
EXPOSE 8080
WORKDIR /opt/hearth/src
STOPSIGNAL SIGTERM
# start-period covers the first run (migrations, default model assembled from the image's chunks).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "app.entrypoint", "healthcheck"]
ENTRYPOINT ["/usr/bin/tini", "--", "python", "-m", "app.entrypoint"]
CMD ["hearth", "serve"]
