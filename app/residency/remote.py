"""Remote nodes: OpenAI-compatible servers elsewhere, probed over HTTP(S) for health and load."""

from __future__ import annotations

import logging
import os
import ssl
from functools import lru_cache

import httpx

from app.exposition import parse_exposition
from app.residency.supervisor import runner_headers

log = logging.getLogger(__name__)

# Requests running + waiting, by the names each server family exports.
LOAD_METRICS = (
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
)


def parse_load(metrics_text: str) -> float | None:
    """Running + waiting requests from Prometheus text (llama-server or vLLM names); None if absent.

    Labelled series (vLLM labels by model and engine) add up; text that is no exposition raises ValueError.
    """
    scrape = parse_exposition(metrics_text)
    for names in LOAD_METRICS:
        values = [scrape.value(n) for n in names]
        if any(v is not None for v in values):
            return sum(v or 0.0 for v in values)
    return None


# A PEM file of the certificate authorities that sign the household's own https:// nodes (a
# self-signed certificate is its own CA). Trusted on top of the system's store; certificates and
# host names are always verified.
NODE_CA_ENV = "HEARTH_NODE_CA_FILE"


@lru_cache(maxsize=4)
def _tls_context(ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    return context


def node_tls_context() -> ssl.SSLContext:
    """The TLS settings for https:// nodes, one for probes and relay alike: system CAs plus $HEARTH_NODE_CA_FILE."""
    return _tls_context(os.environ.get(NODE_CA_ENV) or None)


class RemoteNode:
    """An OpenAI-compatible server elsewhere (llama-server, vLLM, another Hearth runner): no process."""

    def __init__(self, url: str, label: str | None = None, timeout_s: float = 2.0):
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.timeout_s = timeout_s
        # Set by the last health check: the node answered 503 (loading its model, or full).
        self.busy = False
        # Routing asks for the load on every request: an unreadable /metrics is logged once per streak.
        self._metrics_unreadable = False

    def __repr__(self) -> str:
        return f"<RemoteNode {self.label} {self.url}>"

    def _get(self, path: str) -> httpx.Response:
        # Plain http uses no TLS: verify=False spares httpx building (and loading certifi into) a fresh SSL context
        # per probe, 17 ms of serve's CPU each time, every 5 s per runner (py-spy showed it under load).
        verify = node_tls_context() if self.url.startswith("https://") else False
        # A local runner's probe carries its key; a remote node gets none it was not given.
        return httpx.get(f"{self.url}{path}", timeout=self.timeout_s, verify=verify, headers=runner_headers(self.url))

    def healthy(self) -> bool:
        """GET /health is 200, or 503: up but loading or busy, which is no failure (`busy` says which).
        Servers without /health (404) count when /v1/models answers 200."""
        try:
            r = self._get("/health")
            if r.status_code == 404:
                r = self._get("/v1/models")
        except httpx.HTTPError:
            return False
        self.busy = r.status_code == 503
        return r.status_code in (200, 503)

    def load(self) -> float | None:
        """Requests running + waiting from /metrics; None when unknown."""
        try:
            r = self._get("/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            load = parse_load(r.text)
        except ValueError as error:
            if not self._metrics_unreadable:
                log.warning("remote node %s: /metrics is unreadable, routing ignores its load: %s", self.label, error)
            self._metrics_unreadable = True
            return None
        self._metrics_unreadable = False
        return load
