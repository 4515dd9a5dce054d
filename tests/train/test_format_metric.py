"""Progress-line numbers as a person reads them: throughputs as grouped whole numbers, anything else to 4
significant digits."""

from __future__ import annotations

import math

import pytest

from jaxrl.train._logging import format_metric


@pytest.mark.parametrize("name, value, text", [
    ("tok/s", 378.2797, "378"),
    ("tok_s/rollout", 29809.5522, "29,810"),
    ("tok_s/train", 1234567.8, "1,234,568"),
    ("loss", 2.0, "2.000"),
    ("loss", 1.234567, "1.235"),
    ("loss", 0.0123456, "0.01235"),
    ("kl", 0.0012345, "0.001234"),  # banker's-free: 0.0012345 is 0.00123449... in binary
    ("kl", 0.00012345, "1.234e-04"),
    ("response/length_mean", 1234.5678, "1235"),
    ("response/length_mean", 98765.4, "9.877e+04"),
    ("lr", 1e-05, "1.000e-05"),
    ("reward/mean", -0.5, "-0.5000"),
    ("loss", 0.0, "0"),
    ("loss", math.nan, "nan"),
    ("tok/s", math.inf, "inf"),
    ("step", 3, "3"),
])
def test_format_metric(name, value, text):
  assert format_metric(name, value) == text


def test_four_significant_digits_across_magnitudes():
  for exp in range(-3, 4):
    v = 1.23456789 * 10.0**exp
    digits = format_metric("loss", v).replace("-", "").replace(".", "").lstrip("0")
    assert len(digits) == 4 and math.isclose(float(format_metric("loss", v)), v, rel_tol=1e-3), (v, digits)
