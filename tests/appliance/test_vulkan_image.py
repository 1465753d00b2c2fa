"""The Intel/AMD (Vulkan) variant: its compose overlay, its Dockerfile stages and the render group kept."""

import os
import re

from app import entrypoint
from tests.appliance.test_dockerfile import global_args, one, stage_env, stages
from tests.appliance.test_manifests import IMAGE, REFERENCE, REPO, VERSION, compose, from_compose_service, load_yaml, merge


def test_the_vulkan_overlay_passes_dev_dri_and_agrees_with_docker_compose():
    merged = merge(compose(), load_yaml(REPO / "compose.vulkan.yaml"))["services"]["hearth"]
    m = from_compose_service("docker-compose.yml + compose.vulkan.yaml", merged)
    assert m.image == f"{IMAGE}:{VERSION}-vulkan" and not m.gpu  # no NVIDIA reservation
    assert m.env == REFERENCE.env and m.volumes == REFERENCE.volumes and m.healthcheck == REFERENCE.healthcheck
    assert "/dev/dri:/dev/dri" in merged["devices"] and merged["group_add"] and merged["build"]["args"]["ACCEL"] == "vulkan"
    assert not re.search(r":latest\b", (REPO / "compose.vulkan.yaml").read_text())


def test_the_vulkan_image_builds_the_vulkan_libraries_and_tells_the_runners():
    assert {"build-vulkan", "runtime-vulkan"} <= set(stages()) and global_args()["ACCEL"] == "cpu"
    env = stage_env("runtime-vulkan")
    assert env["HEARTH_LLAMA_BACKEND"] == "vulkan" and env["HEARTH_LLAMA_LIB_DIR"] == "/opt/hearth/llama-lib"
    apt = one("runtime-vulkan", "RUN")
    assert "mesa-vulkan-drivers" in apt and "libvulkan1" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    toolchain = " ".join(a for k, a in stages()["build-vulkan"] if k == "RUN")
    assert "glslc" in toolchain and "spirv-headers" in toolchain and "libvulkan-dev" in toolchain
    runs = [a for k, a in stages()["build"] if k == "RUN"]
    assert any("vulkan/*) variant=vulkan" in r and "build_llama_tools.sh --$variant" in r for r in runs)
    # The CPU image sets no backend: it is the CPU build (the portable one, tests/appliance/test_dockerfile.py).
    assert "HEARTH_LLAMA_BACKEND" not in stage_env("runtime-cpu")


def test_the_dropped_user_keeps_the_render_nodes_group(tmp_path):
    assert entrypoint.gpu_device_groups(tmp_path / "missing") == []
    (tmp_path / "renderD128").write_text("")
    (tmp_path / "card0").write_text("")
    assert entrypoint.gpu_device_groups(tmp_path) == [os.stat(tmp_path / "renderD128").st_gid]
