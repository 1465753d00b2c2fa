"""Order statistics used by every benchmark summary."""

import statistics

import pytest

from app.telemetry.stats import median, quantile


def test_quantile_interpolates_between_ranks_like_the_inclusive_method():
    values = [7.0, 1.0, 3.0, 10.0, 4.0]
    assert quantile(values, 0.0) == 1.0 and quantile(values, 1.0) == 10.0
    assert quantile(values, 0.5) == 4.0
    inclusive = statistics.quantiles(values, n=100, method="inclusive")
    assert quantile(values, 0.95) == pytest.approx(inclusive[94])
    assert quantile([5.0], 0.95) == 5.0 and quantile([], 0.5) is None


def test_median_skips_missing_values():
    assert median([None, 3.0, 1.0, None, 2.0]) == 2.0
    assert median([None]) is None and median([]) is None
