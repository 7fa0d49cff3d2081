"""The benchmark harness's own reporting: a verdict row never prints a miss as its target, and the CPU that
measured the figures is named."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _harness as H  # noqa: E402


@pytest.mark.parametrize(
    "value, target, digits, measured, ok",
    [
        (0.30019, 0.30, 2, "0.3002x", False),  # rounds to the target: printed until it does not
        (0.29994, 0.30, 2, "0.2999x", True),
        (0.30, 0.30, 2, "0.30x", True),  # on the line passes
        (0.66, 0.60, 2, "0.66x", False),
        (0.575, 0.60, 2, "0.57x", True),  # Python rounds half to even: 0.575 is 0.57499... in binary
        (0.015, 0.10, 3, "0.015x", True),
        (1.0004, 1.0, 3, "1.0004x", False),
    ],
)
def test_a_ratio_row_shows_enough_digits_to_tell_a_miss_from_its_target(value, target, digits, measured, ok):
    row = H.at_most("row", value, target, digits)
    assert (row.measured, row.ok) == (measured, ok)
    assert row.target == f"<= {target:.{digits}f}x"
    assert H.verdict(row.ok) == ("pass" if ok else "MISS")


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads /proc/cpuinfo (Linux)")
def test_the_environment_line_names_the_cpu_and_its_vector_extension():
    with open("/proc/cpuinfo") as f:
        first = f.read().split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    name = fields.get("model name") or fields.get("CPU part") or "unknown CPU"
    flags = fields.get("flags", "").split()
    cpu = H.cpu_model()
    assert cpu.startswith(name)
    if "avx512f" in flags:
        assert cpu.endswith(", avx512f")
    elif "avx2" in flags:
        assert cpu.endswith(", avx2")
    assert f"cpus ({cpu})" in H.env_line()
