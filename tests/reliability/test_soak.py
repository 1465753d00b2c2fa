"""A shortened `hearth soak` against the real serve: 6 clients for 20 s, a fifth hanging up mid-stream."""

from app.devtools.serving.soak import format_report, run_soak


def test_short_soak_comes_back_to_baseline(serve):
    report = run_soak(serve.url, serve.tokens["alice"], streams=6, minutes=20 / 60, disconnect=0.2,
                      serve_pid=serve.proc.pid, seed=7)
    text = format_report(report)
    print(text)
    assert report.requests >= 6, text
    assert report.hung_up >= 1, text
    assert report.baseline and report.after, text
    assert report.passed, text
