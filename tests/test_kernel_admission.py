"""Admission: bounded sampling settings pass, the rest get a 400 text that
names the field and the accepted range."""

from __future__ import annotations

import pytest
from shmask.kernels import check_admission


@pytest.mark.parametrize(
    "top_k, top_p",
    [(1, None), (50, 1.0), (8192, 0.9), (None, 0.95), (-1, 0.5), (0, 0.999), (20, 0.01)],
)
def test_bounded_settings_are_admitted(top_k, top_p) -> None:
    assert check_admission(top_k=top_k, top_p=top_p, max_tokens=8192) is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(top_k=None, top_p=None), ["unbounded", "top_k", "1..8192", "top_p", "(0, 1)"]),
        (dict(top_k=-1, top_p=1.0), ["unbounded", "top_p=1.0", "1..8192"]),
        (dict(top_k=10000, top_p=0.9), ["top_k=10000", "1..8192"]),
        (dict(top_k=-5, top_p=0.9), ["top_k=-5", "1..8192"]),
        (dict(top_k=2.5, top_p=0.9), ["top_k", "integer"]),
        (dict(top_k=True, top_p=0.9), ["top_k", "integer"]),
        (dict(top_k=10, top_p=1.5), ["top_p=1.5", "(0, 1]"]),
        (dict(top_k=10, top_p=0.0), ["top_p=0.0", "(0, 1]"]),
        (dict(top_k=10, top_p=float("nan")), ["top_p=nan", "(0, 1]"]),
        (dict(top_k=10, top_p=0.5, min_p=-0.1), ["min_p=-0.1", "[0, 1]"]),
        (dict(top_k=10, top_p="0.5"), ["top_p", "number"]),
    ],
)
def test_unbounded_or_bad_settings_name_field_and_range(kwargs, words) -> None:
    error = check_admission(max_tokens=8192, **kwargs)
    assert isinstance(error, str)
    for word in words:
        assert word in error, (word, error)


def test_max_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        check_admission(top_k=5, top_p=0.5, max_tokens=0)
