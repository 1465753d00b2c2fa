"""The soak's descriptor check on hand-made figures: bounded pools may grow, anything else may not."""

from app.devtools.soak import MAX_FDS_GROWTH, MAX_STORE_FDS, SoakReport, _criteria


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
