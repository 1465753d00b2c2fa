"""Reading Prometheus text exposition: a runner's, a remote server's or `hearth serve`'s /metrics.

One parser for every reader (the telemetry sampler, the remote-node load probe, the bench replay,
the soak), built on prometheus_client's own. Series are looked up by sample name as the parser
gives it: counters carry `_total` (`llamacpp:tokens_predicted_total`, `hearth:preemptions_total`),
and a counter exported without it (llama-server's `llamacpp:n_tokens_max`) gains it, as in
OpenMetrics. Histograms come as their `_bucket`, `_count` and `_sum` series.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

# Latency histogram buckets in seconds, the same on a runner's /metrics and on `hearth serve`'s: voice wants a
# first token within a few hundred ms; documents may take many seconds.
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Scrape:
    """The samples of one exposition, by sample name; labelled series of a name add up unless labels narrow them."""

    def __init__(self, samples: Iterable[tuple[str, Mapping[str, str], float]] = ()):
        self._series: dict[str, list[tuple[Mapping[str, str], float]]] = {}
        for name, labels, value in samples:
            self._series.setdefault(name, []).append((labels, float(value)))

    def __contains__(self, name: object) -> bool:
        return name in self._series

    def names(self) -> set[str]:
        """Every sample name present."""
        return set(self._series)

    def series(self, name: str) -> list[tuple[Mapping[str, str], float]]:
        """(labels, value) of every series called `name`."""
        return list(self._series.get(name, ()))

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The sum of the series called `name` whose labels include `labels`; None when none matches."""
        want = (labels or {}).items()
        matching = [v for have, v in self._series.get(name, ()) if want <= have.items()]
        return sum(matching) if matching else None

    def first(self, *names: str) -> float | None:
        """The value of the first of `names` present: servers of different families name one figure differently."""
        for name in names:
            value = self.value(name)
            if value is not None:
                return value
        return None


def parse_exposition(text: str) -> Scrape:
    """Parse Prometheus text exposition; ValueError when the text is not one (an HTML error page, a truncated body)."""
    try:
        samples = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, IndexError) as error:
        # prometheus_client raises ValueErrors, some without a message, and rarely an IndexError.
        raise ValueError(f"not Prometheus text exposition: {str(error) or 'malformed line'}") from error
    return Scrape(samples)
