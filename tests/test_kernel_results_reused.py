"""A kernel call's result kept for the next call of its shape
(kernels/rows.py, ``empty_rows(..., reuse=)``): handed out again only when
nothing else holds any part of it. Most cases call empty_rows directly (on
the CPU the kernels never pass a reuse key: only a call a plan may serve
does); the last runs capture itself on CUDA (SHMASK_TEST_GPU=1)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from shmask.kernels import rows as rows_module
from shmask.kernels.rows import bitmask_words, empty_rows

VOCAB, MAX_TOKENS = 3000, 64
KEY = ("test", threading.get_ident())
GPU = os.environ.get("SHMASK_TEST_GPU") == "1"


@pytest.fixture(autouse=True)
def _fresh_cache():
    rows_module._results.clear()
    yield
    rows_module._results.clear()


def result(batch: int = 8, *, key=KEY, tokens: bool = True, overflow: str = "status"):
    rows, _ = empty_rows(batch, VOCAB, MAX_TOKENS, overflow, torch.device("cpu"), selected=True,
                         tokens=tokens, reuse=key)
    return rows


def addresses(rows) -> tuple[int, int, int]:
    return rows.offsets.data_ptr(), rows.ids.data_ptr(), rows.values.data_ptr()


def test_a_dropped_result_is_handed_out_again_as_a_new_rows() -> None:
    first = result()
    where = addresses(first)
    first.values[:3] = 1.5  # a caller that changes its Rows object does not change the next one
    first.max_tokens = None
    del first
    again = result()
    assert addresses(again) == where
    assert again.max_tokens == MAX_TOKENS


@pytest.mark.parametrize("held", ["rows", "ids", "values", "lengths", "tokens", "selected",
                                  "a view of values", "a view of the per-row arrays",
                                  "a dtype view of ids", "the values' storage",
                                  "the per-row arrays' storage"])
def test_any_part_held_keeps_the_result_out_of_the_next_call(held: str) -> None:
    first = result()
    first.values.fill_(7.0)
    first.ids.fill_(7)
    keep = {"rows": lambda r: r, "ids": lambda r: r.ids, "values": lambda r: r.values,
            "lengths": lambda r: r.lengths, "tokens": lambda r: r.tokens,
            "selected": lambda r: r.selected_logprob,
            "a view of values": lambda r: r.values[:5],
            "a view of the per-row arrays": lambda r: r.sizes[1:3],
            "a dtype view of ids": lambda r: r.ids.view(torch.float32),
            "the values' storage": lambda r: r.values.untyped_storage(),
            "the per-row arrays' storage": lambda r: r.lengths.untyped_storage()}[held](first)
    where = addresses(first)
    del first
    second = result()
    assert addresses(second) != where
    second.values.fill_(-1.0)  # the next call's kernels write its result...
    second.ids.fill_(-1)
    assert keep is not None
    del keep
    third = result()  # ...and once dropped, the first result serves again
    assert addresses(third) == where
    assert float(third.values[0]) == 7.0 and int(third.ids[0]) == 7


def test_at_most_two_kept_per_shape() -> None:
    held = [result() for _ in range(3)]
    places = [addresses(r) for r in held]
    assert len(set(places)) == 3
    del held
    again = [result() for _ in range(3)]
    assert [addresses(r) for r in again][:2] == places[:2]
    assert addresses(again[2]) not in places[:2]


def test_a_smaller_batch_is_cut_from_the_kept_buffers_a_larger_one_replaces_them() -> None:
    first = result(5)
    buffers_of_8 = addresses(first)  # kept for a power of two: 8 rows
    del first
    smaller = result(3)
    assert smaller.offsets.data_ptr() == buffers_of_8[0]
    assert smaller.lengths.shape == (3,) and smaller.offsets.shape == (4,)
    assert smaller.ids.shape == (3 * bitmask_words(VOCAB),)
    assert smaller.values.shape == (3 * MAX_TOKENS,)
    spans = [(t.data_ptr(), t.data_ptr() + 4 * t.numel())
             for t in (smaller.offsets, smaller.id_offsets, smaller.lengths, smaller.status,
                       smaller.sizes, smaller.forms, smaller.selected_logprob, smaller.tokens)]
    assert all(start % 16 == 0 for start, _ in spans)
    ordered = sorted(spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:], strict=False))
    del smaller
    larger = result(12)
    assert larger.lengths.shape == (12,) and larger.values.shape == (12 * MAX_TOKENS,)
    assert larger.offsets.data_ptr() != buffers_of_8[0]
    del larger
    assert result(8).offsets.data_ptr() != buffers_of_8[0]  # the 16-row buffers now


def test_each_shape_and_each_key_has_its_own() -> None:
    first = result()
    where = addresses(first)
    del first
    assert addresses(result(key=("another stream", 1))) != where
    assert addresses(result(tokens=False)) != where
    assert addresses(result(overflow="exact")) != where
    assert addresses(result()) == where


def test_without_a_key_or_switched_off_every_call_allocates(monkeypatch) -> None:
    del_me = result(key=None)
    del del_me
    assert rows_module._results == {}
    monkeypatch.setattr(rows_module, "REUSE_RESULTS", False)
    result()
    assert rows_module._results == {}


@pytest.mark.skipif(not GPU, reason="capture's reuse key comes from a CUDA stream: make test-gpu")
def test_capture_on_cuda_reuses_a_dropped_result_and_never_a_held_one() -> None:
    from shmask import kernels

    gen = torch.Generator(device="cuda").manual_seed(3)
    probs = torch.softmax(torch.randn(64, 4096, device="cuda", generator=gen) * 3, -1)
    tokens = probs.argmax(1)
    other = torch.softmax(torch.randn(64, 4096, device="cuda", generator=gen), -1)
    for _ in range(3):  # past the plan's recording
        kernels.capture(probs, tokens, top_k=50, max_tokens=256)
    held = kernels.capture(probs, tokens, top_k=50, max_tokens=256)
    snapshot = [t.clone() for t in (held.offsets, held.ids, held.values, held.lengths)]
    where = held.values.data_ptr()
    fresh = kernels.capture(other, other.argmax(1), top_k=50, max_tokens=256)
    torch.cuda.synchronize()
    assert fresh.values.data_ptr() != where
    for kept, was in zip((held.offsets, held.ids, held.values, held.lengths), snapshot,
                         strict=True):
        assert torch.equal(kept, was)
    del held, kept  # the loop's last `kept` is held's lengths: a part still held
    again = kernels.capture(probs, tokens, top_k=50, max_tokens=256)
    assert again.values.data_ptr() == where
    torch.cuda.synchronize()
    assert torch.equal(again.values[: int(again.offsets[-1])],
                       snapshot[2][: int(snapshot[0][-1])])
