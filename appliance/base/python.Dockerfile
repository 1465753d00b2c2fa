# A stand-in for python:3.11-slim-bookworm where the image hub cannot be reached (app/devtools/container.py makes it
# from a debootstrapped minbase bookworm): Debian's own Python 3.11 with venv, as `python` like the official image.
ARG DEBIAN_IMAGE=hearth-base/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python
