"""Admission: does a request's sampling configuration give a bounded support?

A support that the transport must carry has at most ``max_tokens`` ids. A
request is admitted when its support is bounded:

* a finite top_k: ``1 <= top_k <= max_tokens`` (ties at the k-th value can
  still push a row over; that row then reports OVERFLOW at run time), or
* ``top_k`` off (``None``, 0 or -1) and ``0 < top_p < 1``: the nucleus is
  bounded by its mass; rows whose nucleus exceeds ``max_tokens`` report
  OVERFLOW at run time.

Anything else (no top_k and top_p = 1, a top_k above max_tokens, values out
of range) is refused with the text a server sends as an HTTP 400 body: it
names the field, the value and the accepted range.
"""

from __future__ import annotations

import math

__all__ = ["check_admission"]


def check_admission(
    *,
    top_k: int | None,
    top_p: float | None,
    max_tokens: int,
    min_p: float | None = None,
) -> str | None:
    """None when the settings give a bounded support, else the 400 error text."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        return f"top_k must be an integer, got {top_k!r}; accepted: -1 (off) or 1..{max_tokens}"
    for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{name} must be a number, got {value!r}"
        low_ok = value > 0 if low_open else value >= 0
        if not (math.isfinite(value) and low_ok and value <= 1):
            accepted = "(0, 1]" if low_open else "[0, 1]"
            return f"{name}={value!r} is out of range; accepted: {accepted}"
    k_off = top_k is None or top_k in (0, -1)
    if not k_off:
        assert top_k is not None
        if top_k < 1 or top_k > max_tokens:
            return (
                f"top_k={top_k} is out of range; accepted: 1..{max_tokens} "
                f"(the support capacity max_tokens), or -1 (off) with top_p in (0, 1)"
            )
        return None
    if top_p is not None and top_p < 1:
        return None
    return (
        f"unbounded sampling support: top_k is off and top_p={1.0 if top_p is None else top_p}; "
        f"set top_k to 1..{max_tokens} or top_p to a value in (0, 1)"
    )
