"""The numbers every kernel shares (float32 where they meet float32 arithmetic), and
the 8-bit float formats' bit dtypes."""
from __future__ import annotations

import math

import numpy as np
from numba import float32

from ...config import DTYPES, FP8_DTYPES

#: threads of a warp
WARP = 32
#: a masked score, and the log-sum-exp of a row over no key
NEG_INF = float32(-math.inf)
#: log2(e): scores scaled by it go through exp2 as natural exponentials
LOG2E = float32(math.log2(math.e))
#: ln(2): a base-2 log-sum-exp times it is the natural one
LN2 = float32(math.log(2.0))
#: 8-bit float storage: the name of the bits' dtype -> the format they hold, as PTX names
#: it ("e4m3", "e5m2"), from the configuration's storage dtypes (Numba has no 8-bit
#: float types; each format has its own integer type, so the element type tells a
#: kernel which)
FP8_FORMATS = {np.dtype(DTYPES[name]).name: name.removeprefix("float8_")
               for name in FP8_DTYPES}
