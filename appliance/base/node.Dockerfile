# A stand-in for node:…-bookworm-slim where the image hub cannot be reached: Debian's nodejs and npm, enough for the
# Dockerfile's `assets` stage (npm ci at the versions package-lock.json pins).
ARG DEBIAN_IMAGE=hearth-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
# As Debian's official images do (their /etc/apt/apt.conf.d/docker-clean): apt keeps no package caches in a layer
# (pkgcache.bin and srcpkgcache.bin are 78 MB after an update) here nor in any image built on this one.
RUN printf '%s\n' 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
        'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";' > /etc/apt/apt.conf.d/docker-clean \
 && apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm ca-certificates \
 && rm -rf /var/lib/apt/lists/*
