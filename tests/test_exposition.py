"""The one Prometheus text reader: llama-server's, vLLM's and Hearth's expositions, labels, junk."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.exposition import Scrape, parse_exposition

# Verbatim in llama-server's format (tools/server/server-task.cpp of the pinned llama.cpp): HELP, TYPE, value.
LLAMA_SERVER = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1200
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 340
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 812
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3
"""


def test_llama_server_names_are_read_as_exported():
    scrape = parse_exposition(LLAMA_SERVER)
    assert scrape.value("llamacpp:prompt_tokens_total") == 1200
    assert scrape.value("llamacpp:tokens_predicted_total") == 340
    assert scrape.value("llamacpp:requests_processing") == 2 and scrape.value("llamacpp:requests_deferred") == 1
    # A counter exported without `_total` is named as OpenMetrics names counters.
    assert "llamacpp:n_tokens_max" not in scrape and scrape.value("llamacpp:n_tokens_max_total") == 812
    # Labelled series add up; labels narrow them.
    assert scrape.value("llamacpp:spec_decode_num_accepted_tokens_per_pos_total") == 10
    assert scrape.value("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 3
    assert scrape.value("llamacpp:spec_decode_num_accepted_tokens_per_pos_total", {"position": "9"}) is None
    assert scrape.value("llamacpp:kv_cache_tokens") is None


def test_hearth_exposition_round_trips():
    """What prometheus_client writes for Hearth's kinds of metric (colons in names, class labels, histograms)."""
    registry = CollectorRegistry()
    Gauge("hearth:kv_cells_used", "KV cells", registry=registry).set(512)
    finished = Counter("hearth:requests_finished", "by reason", ["reason"], registry=registry)
    finished.labels("stop").inc(4)
    finished.labels("cancelled").inc(2)
    ttft = Histogram("hearth:ttft_seconds", "TTFT", ["class"], buckets=(0.1, 1), registry=registry)
    ttft.labels("voice").observe(0.05)
    ttft.labels("chat").observe(0.5)
    scrape = parse_exposition(generate_latest(registry).decode())
    assert scrape.value("hearth:kv_cells_used") == 512
    assert scrape.value("hearth:requests_finished_total") == 6
    assert scrape.value("hearth:requests_finished_total", {"reason": "cancelled"}) == 2
    assert scrape.value("hearth:ttft_seconds_count") == 2
    assert scrape.value("hearth:ttft_seconds_count", {"class": "voice"}) == 1
    assert scrape.value("hearth:ttft_seconds_bucket", {"class": "chat", "le": "1.0"}) == 1
    assert {"hearth:ttft_seconds_sum", "hearth:ttft_seconds_bucket"} <= scrape.names()


def test_vllm_labels_and_timestamps():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0 1700000000000\n')
    scrape = parse_exposition(text)
    assert scrape.value("vllm:num_requests_running") == 3
    assert scrape.value("vllm:num_requests_running", {"engine": "1"}) == 2
    assert scrape.first("llamacpp:requests_deferred", "vllm:num_requests_waiting") == 4
    assert scrape.first("llamacpp:requests_deferred") is None


@pytest.mark.parametrize("text", ["<html><body>502 Bad Gateway</body></html>", "Not Found", 'x{a="1"', "d x\n",
                                  '{a="b"} 1'])
def test_text_that_is_no_exposition_is_an_error(text):
    with pytest.raises(ValueError, match="not Prometheus text exposition"):
        parse_exposition(text)


def test_empty_exposition_and_empty_scrape_have_no_values():
    assert parse_exposition("").names() == set() == Scrape().names()
    assert parse_exposition("# HELP x\n# just a comment\n").value("x") is None
