import random

import numpy as np
import pytest

from gouache.stats import percentile


def test_percentile_interpolates_between_the_nearest_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert percentile([10.0, 20.0], 95) == 19.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_percentile_is_numpys_default_to_the_last_bit():
    rng = random.Random(0)
    for _ in range(500):
        values = [rng.lognormvariate(0, 2) for _ in range(rng.randint(1, 60))]
        q = rng.choice([50, 90, 95, 99, rng.uniform(0, 100)])
        assert percentile(values, q) == float(np.percentile(values, q))


def test_percentile_refuses_no_values_and_q_out_of_range():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)
