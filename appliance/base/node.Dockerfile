# A stand-in for node:…-bookworm-slim where the image hub cannot be reached: Debian's nodejs and npm, enough for the
# Dockerfile's `assets` stage (npm ci at the versions package-lock.json pins).
ARG DEBIAN_IMAGE=hearth-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm ca-certificates \
 && rm -rf /var/lib/apt/lists/*
