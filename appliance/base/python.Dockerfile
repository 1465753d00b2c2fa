# A stand-in for python:3.11-slim-bookworm where the image hub cannot be reached (app/devtools/container.py makes it
# from a debootstrapped minbase bookworm): Debian's own Python 3.11 with venv, as `python` like the official image.
ARG DEBIAN_IMAGE=hearth-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
# As Debian's official images do (their /etc/apt/apt.conf.d/docker-clean): apt keeps no package caches in a layer
# (pkgcache.bin and srcpkgcache.bin are 78 MB after an update) here nor in any image built on this one.
RUN printf '%s\n' 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
        'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";' > /etc/apt/apt.conf.d/docker-clean \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python
