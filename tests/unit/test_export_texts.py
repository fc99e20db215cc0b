"""The csv export's float texts: ``repr``'s and Arrow's (with pyarrow installed) both read back bit for
bit, NaN and Infinity as the contract's strings, whichever path writes them."""

from __future__ import annotations

import math
import struct
from array import array

import pytest

from instantml import limits
from instantml.commands import export

SPECIAL = [math.nan, math.inf, -math.inf, 5e-324, -0.0, 0.1 + 0.2, 1.7976931348623157e308, 100.0, 1e-7, 2.5]


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.parametrize("path", ["repr", "arrow"])
def test_float_texts_read_back_bit_for_bit(path: str) -> None:
    texts = export._texts if path == "repr" else export._fast_texts()
    if texts is None:
        pytest.skip("pyarrow is not installed here")
    numbers = array("d", SPECIAL)
    written = texts(numbers)
    assert written[:3] == ["NaN", "Infinity", "-Infinity"]
    back = [limits.NONFINITE_STRINGS.get(t, None) or float(t) for t in written]
    assert [bits(x) for x in back[3:]] == [bits(x) for x in SPECIAL[3:]]
    assert math.isnan(back[0]) and back[1:3] == [math.inf, -math.inf]
