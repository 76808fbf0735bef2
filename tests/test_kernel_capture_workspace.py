"""Capture's workspace (kernels/capture_workspace.py): the scratch arrays a
call's stages share, carved by name from a few allocations. No kernel runs
here: the layout itself is checked, which the stages' tests only see
through their results."""

from __future__ import annotations

import pytest
import torch
from shmask.kernels import tuning
from shmask.kernels.capture_workspace import BRACKET, CaptureSettings, CaptureWorkspace


def extents(ws: CaptureWorkspace) -> dict[str, tuple[int, int, int]]:
    """name -> (allocation, first byte, end byte) of each tensor field."""
    return {name: (value.untyped_storage().data_ptr(), value.data_ptr(),
                   value.data_ptr() + value.numel() * value.element_size())
            for name, value in vars(ws).items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("batch", [1, 5, 256])
def test_arrays_have_their_sizes_and_never_overlap(batch: int, window: bool) -> None:
    vocab = 2 * tuning.CHUNK + 77
    ws = CaptureWorkspace.allocate(batch, vocab, torch.device("cpu"), window)
    n_chunks = 3
    assert ws.n_chunks == n_chunks
    cells = batch * n_chunks
    w = 1 if window else 0  # a call without window rows gets empty window arrays
    sizes = {
        "lo": batch, "window": batch, "pivots": w * tuning.WINDOW_PIVOTS * batch,
        "wide_count": 1, "bracket": w * BRACKET.value * batch,
        "refine_keys": w * tuning.WINDOW_REFINE * batch, "wide_rows": w * batch, "done": w * batch,
        "bits": cells * tuning.CHUNK // 32, "counts": cells, "sums": cells, "maxes": cells,
        "pivot_mass": w * tuning.WINDOW_PIVOTS * cells,
        "refine_mass": w * tuning.WINDOW_REFINE * cells, "above_count": w * cells,
        "above_mass": w * cells, "cand_ids": batch * vocab, "cand_vals": batch * vocab,
        "before": w * cells, "cutoff": batch, "n_cand": batch, "window_ok": batch,
        "logz": batch,
    }
    floats = {"sums", "maxes", "pivot_mass", "refine_mass", "above_mass", "cand_vals", "logz"}
    spans = extents(ws)
    assert set(spans) == set(sizes)
    for name, size in sizes.items():
        array = getattr(ws, name)
        assert array.shape == (size,), name
        want = torch.float32 if name in floats else torch.int32
        assert array.dtype == want, name
        assert array.is_contiguous(), name
        assert array.data_ptr() % 16 == 0, name  # what Triton specializes pointers on
    filled = sorted(span for name, span in spans.items() if sizes[name])
    for (alloc_a, _, end_a), (alloc_b, start_b, _) in zip(filled, filled[1:], strict=False):
        assert alloc_a != alloc_b or end_a <= start_b, "two arrays share bytes"
    # the small arrays: one allocation
    shared = {name: alloc for name, (alloc, _, _) in spans.items()
              if name not in ("bits", "cand_ids", "cand_vals")}
    assert len(set(shared.values())) == 1


def test_workspaces_are_kept_per_thread_and_grow() -> None:
    """An eager call allocates nothing for its workspace: the same batch
    gets the same arrays again, a smaller one views the same scratch, a
    larger one replaces it (and calls the callbacks that drop what viewed
    the old one), and another thread gets scratch of its own."""
    import threading

    from shmask.kernels import capture_workspace

    vocab, cpu = tuning.CHUNK + 5, torch.device("cpu")
    capture_workspace.release_scratch()
    grown: list[int] = []
    capture_workspace.on_scratch_grown(lambda: grown.append(1))
    try:
        first = CaptureWorkspace.allocate(20, vocab, cpu, True)
        assert CaptureWorkspace.allocate(20, vocab, cpu, True) is first
        smaller = CaptureWorkspace.allocate(3, vocab, cpu, False)
        assert smaller.cand_ids.untyped_storage().data_ptr() == (
            first.cand_ids.untyped_storage().data_ptr())
        assert not grown
        larger = CaptureWorkspace.allocate(40, vocab, cpu, True)  # past 32 rows: grown
        assert grown and larger.cand_ids.numel() == 40 * vocab
        assert larger.cand_ids.untyped_storage().nbytes() == 64 * vocab * 4  # a power of two
        other: list[CaptureWorkspace] = []
        thread = threading.Thread(target=lambda: other.append(
            CaptureWorkspace.allocate(40, vocab, cpu, True)))
        thread.start()
        thread.join()
        assert other[0].lo.untyped_storage().data_ptr() != larger.lo.untyped_storage().data_ptr()
        # at most SCRATCH_KEPT scratches: the oldest goes (and what viewed it)
        grown.clear()
        for extra in range(capture_workspace.SCRATCH_KEPT):
            CaptureWorkspace.allocate(2, vocab + 1 + extra, cpu, False)
        assert len(capture_workspace._KEPT) == capture_workspace.SCRATCH_KEPT and grown
        assert CaptureWorkspace.allocate(40, vocab, cpu, True) is not larger  # it was dropped
    finally:
        capture_workspace._GROWN.pop()
        capture_workspace.release_scratch()


def test_settings_say_what_the_arguments_allow() -> None:
    """Which sums and whether window rows may occur, from the arguments
    alone: a [B] tensor may turn anything on, a scalar says."""
    def settings(**kwargs) -> CaptureSettings:
        args = {"top_k": None, "top_p": None, "min_p": None, "greedy": None, "rows": None,
                "sequential": False, **kwargs}
        return CaptureSettings.of(4, 1000, torch.device("cpu"), **args)

    plain = settings(top_k=50)
    assert not (plain.need_mass or plain.need_max or plain.window)
    assert settings(top_p=0.9).window and settings(top_p=0.9).need_mass
    assert not settings(top_p=0.9, top_k=50).window  # top-k on in every row
    assert settings(top_p=0.9, top_k=torch.full((4,), 50)).window  # maybe off in some row
    assert settings(min_p=0.1).need_max and settings(greedy=True).need_max
    # a min-p-only row can keep every id of a flat row: a window row
    assert settings(min_p=0.1).window and settings(min_p=0.1, top_p=1.0).window
    assert not (settings(min_p=0.1, top_k=50).window or settings(min_p=0.0).window)
    assert settings(min_p=0.1, top_p=torch.full((4,), 0.9)).window  # maybe off in some row
    assert not settings(greedy=False).need_max
    assert settings(top_k=7).top_k.tolist() == [7] * 4
    with pytest.raises(ValueError, match=r"top_p=1.5 is out of range; accepted: <= 1.0"):
        settings(top_p=1.5)
