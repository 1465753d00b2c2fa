"""Developers' checks of the offload path and the devices: Vulkan, VRAM against the estimate, placement, the fit, and one GPU check's report."""
