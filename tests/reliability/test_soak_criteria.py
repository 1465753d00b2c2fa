"""The soak's descriptor check on hand-made figures: bounded pools may grow, anything else may not; its idle
state read from /metrics and /slots."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from app.devtools.serving.soak import MAX_FDS_GROWTH, MAX_STORE_FDS, SoakReport, _criteria, _idle_state, _is_idle


def _figures(fds, pooled=0, **kinds):
    return {"threads": 40, "fds": fds, "rss_mib": 150.0, "pooled": pooled, "fd_kinds": kinds}


def _fds_ok(before, after) -> bool:
    report = SoakReport(url="http://x", streams=1, seconds=1.0, disconnect_share=0.0,
                        baseline={"serve": before, "runner": _figures(20)},
                        after={"serve": after, "runner": _figures(20)})
    return _criteria(report, [], {"gateway_in_flight": 0, "gateway_waiting": 0})["serve fds back to baseline"]


def test_store_connections_opened_by_more_threads_are_not_a_leak():
    before = _figures(36, pooled=10, socket=16, **{"hearth.db": 2, "hearth.db-wal": 2})
    after = _figures(60, pooled=27, socket=33, **{"hearth.db": 6, "hearth.db-wal": 5})
    assert _fds_ok(before, after)


def test_other_descriptors_that_grow_are_a_leak():
    before = _figures(36, pooled=10, socket=16, pipe=4)
    after = _figures(36 + MAX_FDS_GROWTH + 1, pooled=10, socket=16, pipe=4 + MAX_FDS_GROWTH + 1)
    assert not _fds_ok(before, after)


def test_store_descriptors_beyond_the_pool_bound_are_a_leak():
    before = _figures(36, **{"hearth.db": 2})
    after = _figures(36 + MAX_STORE_FDS, **{"hearth.db": 2 + MAX_STORE_FDS})
    assert not _fds_ok(before, after)


GATEWAY_METRICS = """# TYPE hearth:class_in_flight gauge
hearth:class_in_flight{class="chat"} 2.0
hearth:class_in_flight{class="voice"} 1.0
# TYPE hearth:class_waiting gauge
hearth:class_waiting{class="chat"} 0.0
# TYPE hearth:model_in_flight gauge
hearth:model_in_flight{model="gemma"} 3.0
"""
RUNNER_METRICS = """# TYPE hearth:kv_cells_used gauge
hearth:kv_cells_used 0.0
# TYPE hearth:requests_running gauge
hearth:requests_running 0.0
# TYPE hearth:requests_finished counter
hearth:requests_finished_total{reason="cancelled"} 4.0
hearth:requests_finished_total{reason="stop"} 9.0
"""


class Fixed(BaseHTTPRequestHandler):
    """Serves the server's `pages` by path."""

    def do_GET(self):
        body = self.server.pages[self.path].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_idle_state_sums_labelled_series_and_reads_one_label():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    server.pages = {"/metrics": GATEWAY_METRICS, "/runner/metrics": RUNNER_METRICS,
                    "/runner/slots": '[{"id": 0, "is_processing": false}]'}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with httpx.Client() as client:
            state = _idle_state(client, url, url + "/runner")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert state["gateway_in_flight"] == 6 and state["gateway_waiting"] == 0
    assert state["runner_cancelled"] == 4 and state["kv_cells_used"] == 0 and state["slots_busy"] == 0
    assert not _is_idle(state)
