"""One result on every path (issue 35): a row's bits (ids or bitmask
words, logprob bits, status, form, selected logprob) do not depend on how
it was made or sent. capture(), capture(into=), kernels.publish of device
Rows (GPU-direct), the CPU path (HostStaging + publish) and sample(into=)
(against capture() of the tokens it drew) over one step that holds every
row kind: window rows (top-p only, a support past WINDOW_MIN: bracketed,
written by the window write; sample's drawn in resolve), narrow
rows (ids form), bitmask rows (past max_tokens, and dense), INVALID (a
NaN row; a token outside its support), SKIPPED (not opted in) and greedy
rows.

Without a GPU the kernels run in Triton's interpreter (WINDOW_MIN lowered
so that a small vocabulary has window rows); with SHMASK_TEST_GPU=1 on
CUDA at the full vocabulary, where the window write's values come from its
own fast log and a path that skipped it would differ in the last bits."""

from __future__ import annotations

import importlib
import os
import threading

import numpy as np
import pytest
import torch
from row_bits import bits  # tests/row_bits.py
from shmask.kernels import HostStaging, Status, capture, compact, publish, sample, tuning
from shmask.kernels.capture_workspace import release_scratch
from shmask.kernels.direct import reference_direct

import shmask

capture_module = importlib.import_module("shmask.kernels.capture")
compact_module = importlib.import_module("shmask.kernels.compact")
fixed_rows_module = importlib.import_module("shmask.kernels.fixed_rows")

GPU = os.environ.get("SHMASK_TEST_GPU") == "1"
DEVICE = "cuda" if GPU else "cpu"
VOCAB = 151936 if GPU else 3000
BATCH = 12
MAX_TOKENS = 64
# fixed_rows' capacity: on the GPU the window rows pass its middle block
# and sort in parts
FIXED_CAP = 4096 if GPU else 256


def step_inputs(seed: int) -> dict:
    """One step's probabilities and per-row settings, a row of each kind:
    rows 0-3 top-p only (0 and 1 flat: window rows; 2 peaked; 3 with
    min-p), 4 top-k 5, 5 top-k past max_tokens (bitmask), 6 a NaN row, 7 a
    token outside its support, 8 not opted in, 9 greedy, 10 top-k 300
    (bitmask), 11 top-k 50 + top-p 0.8."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.5, 1.0, 6.0, 1.5] + [3.0] * 8)
    probs = torch.softmax(torch.randn(BATCH, VOCAB, generator=gen) * scales[:, None], -1)
    probs[6, 17] = float("nan")
    inf = VOCAB  # top-k off
    top_k = torch.tensor([inf, inf, inf, inf, 5, 200, inf, 5, 40, inf, 300, 50], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.6, 0.9, 0.95, 1, 1, 0.9, 1, 1, 1, 1, 0.8])
    min_p = torch.tensor([0, 0, 0, 0.02, 0, 0, 0, 0, 0, 0, 0, 0])
    sampled = torch.nan_to_num(probs, nan=0.0).argmax(1)
    sampled[7] = torch.nan_to_num(probs[7], nan=1.0).argmin()  # outside top-5
    rows = torch.ones(BATCH, dtype=torch.bool)
    rows[8] = False
    greedy = torch.zeros(BATCH, dtype=torch.bool)
    greedy[9] = True
    on = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "rows": rows, "greedy": greedy}
    return {"probs": probs.to(DEVICE), "sampled": sampled.to(DEVICE),
            **{name: value.to(DEVICE) for name, value in on.items()}}


def ring_rows(reader: shmask.Reader, writer: shmask.Writer, queues: list) -> list:
    """Each queue's one row as stored: (flags, length, id data, logprob bits)."""
    out = []
    for ref in writer.take_batch(queues):
        chunk = reader.open(ref)
        if chunk.rows == 0:
            out.append(None)
        else:
            flags = int(chunk.flags[0]) if chunk.flags is not None else 0
            out.append((flags, int(chunk.lengths[0]), chunk.ids.tolist(),
                        np.asarray(chunk.logprobs, np.float32).view(np.uint32).tolist()))
        chunk.release()
    return out


def expected(rows, mode: str) -> list:
    """What ring_rows reads for `rows` (SKIPPED rows: nothing stored)."""
    return [None if row is None else
            (row[0], row[1], row[2], np.asarray(row[3], np.float32).view(np.uint32).tolist())
            for row in reference_direct(rows, mode)]


@pytest.mark.parametrize("mode", ["support", "selected"])
def test_rows_identical_on_every_path(prefix: str, mode: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if not GPU:
        monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
        # a count floor under the rows' length, as a vocabulary of 151,936
        # has: window rows' brackets narrow, the mass above them apart
        monkeypatch.setattr(tuning, "P_KEEP", 1024)
    inputs = step_inputs(seed=3)
    probs, sampled = inputs.pop("probs"), inputs.pop("sampled")
    kw = {**inputs, "max_tokens": MAX_TOKENS}
    own = capture(probs, sampled, **kw)
    want = bits(own)
    status = want["status"]
    # every row kind is here
    assert status[6] == status[7] == Status.INVALID and status[8] == Status.SKIPPED
    assert status[10] == Status.OK and want["forms"][10] == 1 and want["forms"][4] == 0
    assert want["lengths"][0] > MAX_TOKENS and want["lengths"][2] < MAX_TOKENS
    config = shmask.Config(ring_mb=4, name_prefix=prefix, max_tokens=MAX_TOKENS)
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        queues = [writer.open_queue(mode) for _ in range(BATCH)]
        handles = np.array([q.handle for q in queues], np.int64)
        into = (writer, handles, mode)

        # capture(into=): the rows it returns and the rows it stored
        fused = capture(probs, sampled, **kw, into=into)
        assert bits(fused) == want
        assert ring_rows(reader, writer, queues) == expected(own, mode)
        # publish of the device rows (GPU-direct where CUDA is), then the CPU path
        publish(writer, handles, own, mode)
        assert ring_rows(reader, writer, queues) == expected(own, mode)
        publish(writer, handles, HostStaging().fetch(own, values=mode == "support"), mode)
        assert ring_rows(reader, writer, queues) == expected(own, mode)

        # sample(into=): the rows of the tokens it drew are capture()'s rows of them
        drawn = sample(probs, torch.arange(BATCH, device=DEVICE) * 7 + 1, **kw, into=into)
        tokens = drawn.tokens.long()
        again = capture(probs, torch.where(tokens < 0, sampled, tokens), **kw)
        assert tokens[6] == -1 and (tokens[:6] >= 0).all() and (tokens[7:] >= 0).all()
        assert bits(drawn) == bits(again)
        assert ring_rows(reader, writer, queues) == expected(drawn, mode)


def test_planned_calls_match_tritons_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls of one shape, each on new inputs: the rows (capture, sample,
    compact, and fixed_rows of the captured rows) are the bits of Triton's
    path with a fresh workspace every call, when the workspace is kept
    from call to call and (compiled, on the GPU) from the third call on
    the launches replay from a plan (kernels/launch_plan.py)."""
    if not GPU:
        monkeypatch.setattr(tuning, "WINDOW_MIN", 64)
        # a count floor under the rows' length, as a vocabulary of 151,936
        # has: window rows' brackets narrow, the mass above them apart
        monkeypatch.setattr(tuning, "P_KEEP", 1024)
    steps = [step_inputs(seed) for seed in (3, 4, 5, 6)]
    seeds = torch.arange(BATCH, device=DEVICE) * 5 + 2
    batch_rows = torch.arange(BATCH, device=DEVICE)

    def calls(step: dict) -> dict:
        kw = {k: v for k, v in step.items() if k not in ("probs", "sampled")}
        probs = step["probs"]
        captured = capture(probs, step["sampled"], **kw, max_tokens=MAX_TOKENS)
        fixed = fixed_rows_module.fixed_rows(captured, probs, batch_rows, FIXED_CAP)
        return {"capture": bits(captured),
                "sample": bits(sample(probs, seeds, **kw, max_tokens=MAX_TOKENS)),
                "compact": bits(compact(torch.log(probs), MAX_TOKENS)),
                "fixed_rows": [t.cpu().view(torch.int32).tolist() for t in fixed]}

    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    want = []
    for step in steps:
        release_scratch()
        want.append(calls(step))
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "1")
    replayed = (capture_module._PLANS.replayed, compact_module._PLANS.replayed,
                fixed_rows_module._PLANS.replayed)
    got = [calls(step) for step in steps]
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in w:
            assert g[name] == w[name], f"call {n}: {name}"
    if GPU:  # capture and sample: 2 replays each; compact and fixed_rows: 2
        assert capture_module._PLANS.replayed - replayed[0] == 4
        assert compact_module._PLANS.replayed - replayed[1] == 2
        assert fixed_rows_module._PLANS.replayed - replayed[2] == 2
        lengths = got[-1]["fixed_rows"][2]
        assert max(lengths) > 2 * fixed_rows_module.SMALL_SORT  # rows sorted in parts


def graphs_launched(thread: int | None = None) -> int:
    """Calls served by a plan's CUDA graph so far (kernels/launch_plan.py),
    of one thread's plans if given (a plan's key starts with the call's
    device, stream and thread)."""
    return sum(state.graphs.launched for module in (capture_module, compact_module)
               for key, state in list(module._PLANS._states.items())
               if getattr(state, "graphs", None) is not None
               and (thread is None or key[2] == thread))


def refilled_step(held: dict, step: dict, seeds: torch.Tensor, late_cycles: int) -> dict:
    """An engine's step on buffers that stay put: ``step``'s contents
    copied into ``held`` on the current stream (behind a sleep kernel of
    ``late_cycles`` if any, so they land late), then capture, sample and
    compact of them, as bits."""
    if late_cycles:
        torch.cuda._sleep(late_cycles)
    for name, value in step.items():
        held[name].copy_(value)
    kw = {k: v for k, v in held.items() if k not in ("probs", "sampled")}
    drawn = sample(held["probs"], seeds, **kw, max_tokens=MAX_TOKENS)
    return {"capture": bits(capture(held["probs"], held["sampled"], **kw, max_tokens=MAX_TOKENS)),
            "sample": {**bits(drawn), "tokens": drawn.tokens.cpu().tolist()},
            "compact": bits(compact(torch.log(held["probs"]), MAX_TOKENS))}


@pytest.mark.skipif(not GPU, reason="plans' CUDA graphs need the GPU (SHMASK_TEST_GPU=1)")
@pytest.mark.parametrize("stream", ["default", "side"])
def test_buffers_that_stay_put_replay_as_graphs(stream: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's buffers stay put from step to step, their contents new
    each step: from an address set's second replay on a plan launches it
    as one CUDA graph, and each step's rows (and sample's tokens) are still
    the bits of Triton's path on that step's contents. "side": the calls
    run on a stream of their own, each step's new contents written there
    behind a slow kernel, so a graph launched anywhere but on the caller's
    stream would read the step before's."""
    steps = [step_inputs(seed) for seed in (21, 22, 23, 24, 25, 26)]
    held = {name: value.clone() for name, value in steps[0].items()}
    seeds = torch.arange(BATCH, device=DEVICE) * 3 + 1
    side = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    side.wait_stream(torch.cuda.current_stream())

    def calls(step: dict) -> dict:
        with torch.cuda.stream(side):  # "side": the copies land late on this stream
            return refilled_step(held, step, seeds, 20_000_000 if stream == "side" else 0)

    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    want = [calls(step) for step in steps]
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "1")
    before = graphs_launched()
    got = [calls(step) for step in steps]
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in w:
            assert g[name] == w[name], f"step {n}: {name}"
    # calls 1-2 record, 3 replays one by one, 4 on as graphs where the
    # addresses held (the converted settings and log-probs are the
    # allocator's: most calls get the same blocks again)
    assert graphs_launched() - before >= 3


@pytest.mark.skipif(not GPU, reason="plans' CUDA graphs need the GPU (SHMASK_TEST_GPU=1)")
def test_two_threads_replay_their_own_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads, as two engines' samplers in one process, each with its
    own stream and buffers refilled every step, call in lock step: each
    thread's plans make and launch their own graphs (captures take turns
    on the one capture stream), and every step's rows and tokens are the
    bits of Triton's path on that thread's contents."""
    seeds = torch.arange(BATCH, device=DEVICE) * 3 + 1
    inputs = {t: [step_inputs(seed) for seed in range(40 + 10 * t, 46 + 10 * t)] for t in (0, 1)}
    launched: dict[int, int] = {}  # graph launches by each thread's own plans

    def run(t: int, out: list, barrier: threading.Barrier | None) -> None:
        before = graphs_launched(threading.get_ident())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.default_stream())
        with torch.cuda.stream(side):
            held = {name: value.clone() for name, value in inputs[t][0].items()}
            for step in inputs[t]:
                if barrier is not None:
                    barrier.wait(timeout=120)  # both threads' calls overlap
                out.append(refilled_step(held, step, seeds, 5_000_000))  # contents land late
        launched[t] = graphs_launched(threading.get_ident()) - before

    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "0")
    want: dict[int, list] = {0: [], 1: []}
    for t in (0, 1):
        run(t, want[t], None)
    monkeypatch.setenv("SHMASK_KERNEL_PLANS", "1")
    got: dict[int, list] = {0: [], 1: []}
    errors: list[tuple[int, BaseException]] = []
    barrier = threading.Barrier(2)

    def guarded(t: int) -> None:
        try:
            run(t, got[t], barrier)
        except BaseException as error:  # kept with the thread's number, raised below
            errors.append((t, error))
            barrier.abort()  # the other thread's wait raises instead of hanging

    # daemons: a thread still stuck after its join's timeout fails the test
    # below and does not hold the interpreter at exit
    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish in 300 s"
    first = next((e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)),
                 errors[0] if errors else None)
    if first is not None:
        raise AssertionError(f"thread {first[0]} failed") from first[1]
    for t in (0, 1):
        assert len(got[t]) == len(want[t])
        for n, (g, w) in enumerate(zip(got[t], want[t], strict=True)):
            for name in w:
                assert g[name] == w[name], f"thread {t}, step {n}: {name}"
        # each thread's own plans launched graphs: from each call kind's
        # fourth call on, as with one thread
        assert launched[t] >= 3, launched
