"""The replay kernel (issue 38, kernels/replay.py) against the dense-mask
float64 reference: forward and gradient, undefined rows, gradcheck.
In Triton's interpreter on the CPU (small shapes); on the GPU with
SHMASK_TEST_GPU=1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from shmask.kernels.replay import (
    reference_replay_logprobs,
    replay_forward,
    replay_logprobs,
    replay_logprobs_vocab_parallel,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def csr(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    ids = torch.tensor([i for r in rows for i in r], dtype=torch.int32)
    return offsets.to(DEVICE), ids.to(DEVICE)


def supports(vocab: int, gen: torch.Generator) -> list[list[int]]:
    """Sizes 1, a few, many, the whole vocabulary; ascending."""
    sizes = [1, 3, 40, vocab, 150, 2]
    return [sorted(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in sizes]


def targets_in(rows: list[list[int]], gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([r[int(torch.randint(len(r), (1,), generator=gen))] for r in rows],
                        device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradient_match_the_dense_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(38)
    vocab = 300
    rows = supports(vocab, gen)
    n = len(rows)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    logits[2, rows[2][:10]] = logits[2, rows[2][0]].item()  # ties inside a support
    logits = logits.to(DEVICE)
    offsets, ids = csr(rows)
    targets = targets_in(rows, gen)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0], device=DEVICE)
    weights = torch.randn(n, generator=gen, dtype=torch.float64).to(DEVICE)

    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets, offsets, ids, temperature=temperature)
    (got.double() * weights).sum().backward()
    ref_leaf = logits.clone().requires_grad_(True)  # the same bf16 values, in float64
    want = reference_replay_logprobs(ref_leaf, targets, offsets, ids, temperature=temperature)
    (want * weights).sum().backward()

    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # a bf16 gradient holds 8 bits
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad.double(), rtol=tol, atol=tol)
    # zero outside each support, exactly
    outside = torch.ones(n, vocab, dtype=torch.bool)
    for t, r in enumerate(rows):
        outside[t, r] = False
    assert (leaf.grad.cpu()[outside] == 0).all()
    # replay_forward: the same values, and the logsumexp over the support
    plain, logz = replay_forward(logits, targets, offsets, ids, temperature=temperature)
    assert torch.equal(plain, got.detach())
    z = logits.double() / temperature.double()[:, None]
    for t, r in enumerate(rows):
        assert abs(float(logz[t]) - float(torch.logsumexp(z[t, r], 0))) < 1e-4


def test_undefined_rows_are_nan_with_zero_gradient() -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 50
    logits = torch.randn(7, vocab, generator=gen, dtype=torch.float32).to(DEVICE)
    rows = [[1, 4, 9], [2, 3], [0, 60], [5, 5, 6], [7, 8], [10, 11], [12, 13]]
    offsets, ids = csr(rows)
    offsets = offsets.clone()
    targets = torch.tensor([4, 9, 0, 5, 7, 10, 12], device=DEVICE)
    # 0 defined; 1 target outside its support; 2 an id past V; 3 ids not
    # strictly ascending; 4 not valid (status); 5 empty (offsets equal);
    # 6 offsets past the ids
    offsets[6] = offsets[5]  # row 5: empty; row 6 now starts where 5 did
    offsets[7] = ids.numel() + 5
    valid = torch.tensor([True, True, True, True, False, True, True], device=DEVICE)
    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets, offsets, ids, valid=valid)
    want = reference_replay_logprobs(logits, targets, offsets, ids, valid=valid)
    assert torch.isfinite(got[0]) and torch.isnan(got[1:]).all(), got
    assert torch.isnan(want[1:]).all()
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-6)
    got.nan_to_num(0.0).sum().backward()
    grad = leaf.grad.cpu()
    assert (grad[1:] == 0).all() and (grad[0, [1, 4, 9]] != 0).all()
    assert (grad[0].abs().sum() > 0) and (grad[0, [0, 2, 3]] == 0).all()


def test_gradcheck_in_float64() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [[0, 2, 5], [1], [0, 1, 2, 3, 4, 5, 6], [3, 6]]
    offsets, ids = csr(rows)
    targets = torch.tensor([2, 1, 6, 3], device=DEVICE)
    logits = torch.randn(4, 7, generator=gen, dtype=torch.float64).to(DEVICE)
    logits.requires_grad_(True)
    temperature = torch.tensor([1.0, 0.8, 1.5, 0.9], dtype=torch.float64, device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda x: replay_logprobs(x, targets, offsets, ids, temperature=temperature),
        (logits,), eps=1e-6, atol=1e-7)


def test_bad_arguments_are_named() -> None:
    logits = torch.zeros(2, 5, device=DEVICE)
    offsets, ids = csr([[0], [1]])
    targets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="offsets must be a tensor of shape"):
        replay_logprobs(logits, targets, offsets[:2], ids)
    with pytest.raises(ValueError, match="targets must be a tensor of shape"):
        replay_logprobs(logits, targets[:1], offsets, ids)
    with pytest.raises(TypeError, match="ids must hold integers"):
        replay_logprobs(logits, targets, offsets, ids.float())
    with pytest.raises(ValueError, match="temperature=0.0 is out of range"):
        replay_logprobs(logits, targets, offsets, ids, temperature=0.0)
    with pytest.raises(TypeError, match="logits must be"):
        replay_logprobs(logits.to(torch.int32), targets, offsets, ids)
    with pytest.raises(ValueError, match="at least one column"):
        replay_logprobs(logits[:, :0], targets, offsets, ids)
    with pytest.raises(ValueError, match="does not lie in a vocabulary"):
        replay_logprobs_vocab_parallel(logits, targets, offsets, ids, vocab_start=3, vocab=5)


def test_int64_ids_are_read_as_they_are() -> None:
    """int64 ids are not cast: an id past int32 (which a cast would wrap
    onto id 9) leaves its row undefined; in-range int64 ids give int32's
    result. The gradient is not differentiable again, and says so."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 100, generator=gen).to(DEVICE)
    targets = torch.tensor([5, 5], device=DEVICE)
    offsets = torch.tensor([0, 3, 6], device=DEVICE)
    ids = torch.tensor([5, 7, 2**32 + 9, 5, 7, 9], dtype=torch.int64, device=DEVICE)
    got = replay_logprobs(logits, targets, offsets, ids)
    assert torch.isnan(got[0]) and torch.isfinite(got[1])
    as_int32 = replay_logprobs(logits, targets, offsets, ids.clamp(max=99).int())
    assert torch.equal(got[1], as_int32[1])
    leaf = logits[1:].clone().requires_grad_(True)
    out = replay_logprobs(leaf, targets[1:], offsets[1:] - 3, ids[3:])
    (grad,) = torch.autograd.grad(out.sum(), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|twice"):
        grad.sum().backward()


def test_supports_longer_than_a_block() -> None:
    """A support of several blocks (kernels/replay.py BLOCK): the running
    logsumexp rescaled as the max rises block by block, and a first block
    of -inf logits (ids a model masked) before any finite one."""
    vocab = 2500
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, vocab, generator=gen) + torch.linspace(0, 30, vocab)  # max late
    logits[1, :2100] = float("-inf")  # the first 1024 of its ids (even, < 2048)
    logits = logits.to(DEVICE)
    rows = [list(range(vocab)), list(range(0, vocab, 2))]
    offsets, ids = csr(rows)
    targets = torch.tensor([17, 2400], device=DEVICE)
    got = replay_logprobs(logits, targets, offsets, ids)
    want = reference_replay_logprobs(logits, targets, offsets, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def bitmask_words(row: list[int], vocab: int) -> list[int]:
    """A support as ceil(V / 32) int32 words (bit j of word w: id 32 w + j)."""
    words = [0] * ((vocab + 31) // 32)
    for i in row:
        words[i // 32] |= 1 << (i % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32


def test_bitmask_rows_mixed_with_ids_rows() -> None:
    """Rows in the bitmask form (top-p-only supports travel so) beside ids
    rows: the same values and gradients as the dense reference; a bitmask
    row of the wrong word count, with a bit past V, or whose target is
    not set is undefined."""
    gen = torch.Generator().manual_seed(5)
    vocab = 300  # 10 words, the last one holding ids 288-299 and 12 bits past V
    rows = [sorted(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (200, 12, 31, 299)]
    rows.append(list(range(vocab)))
    forms = [1, 0, 1, 1, 1]
    data = [bitmask_words(r, vocab) if f else r for r, f in zip(rows, forms, strict=True)]
    data[3][9] |= 1 << 20  # id 308 >= V: undefined
    n = len(rows)
    offsets, ids = csr(data)
    form = torch.tensor(forms, dtype=torch.int32, device=DEVICE)
    targets = targets_in(rows, gen)
    logits = (torch.randn(n, vocab, generator=gen) * 4).to(DEVICE)
    temperature = torch.tensor([0.9, 1.0, 1.2, 1.0, 0.6], device=DEVICE)
    weights = torch.randn(n, generator=gen, dtype=torch.float64).to(DEVICE)

    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets, offsets, ids, temperature=temperature, forms=form)
    ref_leaf = logits.clone().requires_grad_(True)
    want = reference_replay_logprobs(ref_leaf, targets, offsets, ids, temperature=temperature,
                                     forms=form)
    assert torch.isnan(got[3]) and torch.isnan(want[3])
    defined = torch.tensor([True, True, True, False, True], device=DEVICE)
    torch.testing.assert_close(got[defined].double(), want[defined], rtol=1e-5, atol=1e-5)
    (got.nan_to_num(0.0).double() * weights).sum().backward()
    (want.nan_to_num(0.0) * weights).sum().backward()
    grad, ref_grad = leaf.grad.cpu(), ref_leaf.grad.cpu()
    torch.testing.assert_close(grad[defined.cpu()], ref_grad[defined.cpu()],
                               rtol=1e-5, atol=1e-6)
    assert (grad[3] == 0).all()
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[rows[0]] = False
    assert (grad[0][outside] == 0).all() and (grad[0][~outside] != 0).all()

    # a target outside its bitmask: undefined, the other rows as before
    bad_target = targets.clone()
    bad_target[2] = next(i for i in range(vocab) if i not in rows[2])
    again = replay_logprobs(logits, bad_target, offsets, ids, temperature=temperature, forms=form)
    assert torch.isnan(again[2]) and torch.equal(again[:2], got[:2].detach())
    # a bitmask one word short (or long): undefined
    for words in (9, 11):
        one = replay_logprobs(logits[:1], targets[:1], torch.tensor([0, words], device=DEVICE),
                              ids[:11], forms=form[:1])
        assert torch.isnan(one).all(), words
    whole = replay_logprobs(logits[:1], targets[:1], torch.tensor([0, 10], device=DEVICE),
                            ids[:10], temperature=temperature[:1], forms=form[:1])
    assert torch.equal(whole, got[:1].detach())


@pytest.mark.parametrize("tile", [32, 128])
def test_gradient_blocks_take_their_ids(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward's walk of a row block by block, with small blocks
    (many a row) and small chunks of ids: every id written in its block
    with the logit the forward kept for it: ids on block edges, blocks
    with none, blocks that chunks share, chunks that span many blocks, a
    bitmask row beside them. Then a shard at a column that is no block's or word's edge,
    with ids below and above it: its gradient is the unsharded gradient's
    columns."""
    from shmask.kernels import replay

    monkeypatch.setattr(replay, "ZERO_BLOCK", tile)
    monkeypatch.setattr(replay, "BACKWARD_CHUNK", 8)
    monkeypatch.setattr(replay, "BACKWARD_WORD_BLOCK", 2)
    gen = torch.Generator().manual_seed(tile)
    vocab = 700
    edges = sorted({0, tile - 1, tile, 2 * tile, 3 * tile - 1, vocab - 1})
    rows = [edges, list(range(tile // 2, tile // 2 + 3 * tile)),  # several tiles whole
            sorted(torch.randperm(vocab, generator=gen)[:90].tolist()), [vocab - 1],
            sorted(torch.randperm(vocab, generator=gen)[:400].tolist())]
    forms = [0, 0, 0, 0, 1]
    data = [bitmask_words(r, vocab) if f else r for r, f in zip(rows, forms, strict=True)]
    n = len(rows)
    offsets, ids = csr(data)
    form = torch.tensor(forms, dtype=torch.int32, device=DEVICE)
    targets = targets_in(rows, gen)
    logits = (torch.randn(n, vocab, generator=gen) * 2).to(DEVICE)
    weights = torch.randn(n, generator=gen, dtype=torch.float64).to(DEVICE)

    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets, offsets, ids, forms=form)
    (got.double() * weights).sum().backward()
    ref_leaf = logits.clone().requires_grad_(True)
    want = reference_replay_logprobs(ref_leaf, targets, offsets, ids, forms=form)
    (want * weights).sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6)
    assert ((leaf.grad != 0) == (ref_leaf.grad != 0)).all()

    # a shard of columns [start, start + width): the same columns of the gradient
    start, width = tile + 37, 2 * tile + 5
    shard = logits[:, start:start + width].contiguous()
    _, targets64, offsets64, ids32, temp, ok, form32 = replay._checked(
        shard, targets, offsets, ids, 1.0, None, form)
    outputs = tuple(torch.empty(n, device=DEVICE) for _ in range(4))
    zs = replay._launch_forward(shard, start, vocab, targets64, temp, offsets64, ids32, ok,
                                form32, outputs, False, True, True)
    _, logz = replay_forward(logits, targets, offsets, ids, forms=form)
    grad = replay._backward(shard, start, vocab, targets64, temp, offsets64, ids32, form32, logz,
                            zs, weights)
    torch.testing.assert_close(grad, leaf.grad[:, start:start + width], rtol=1e-6, atol=1e-7)
    # what the forward kept: each held id's scaled logit, -inf for the others
    assert zs is not None
    for t in range(4):
        row = torch.tensor(rows[t])
        held = (row >= start) & (row < start + width)
        kept = zs[int(offsets[t]):int(offsets[t + 1])].cpu()
        assert torch.equal(kept[held], logits[t, row[held]].cpu())
        assert (kept[~held] == float("-inf")).all()


def test_full_vocabulary_logp_and_support_mass_in_the_same_launch() -> None:
    gen = torch.Generator().manual_seed(21)
    vocab = 1500  # a support past one 1024-id block
    rows = [sorted(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (5, 1200, 60)]
    offsets, ids = csr(rows)
    targets = targets_in(rows, gen)
    targets[2] = next(i for i in range(vocab) if i not in rows[2])  # undefined: no mass
    logits = (torch.randn(3, vocab, generator=gen) * 2).to(DEVICE)
    temperature = torch.tensor([1.0, 0.7, 1.1], device=DEVICE)
    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets, offsets, ids, temperature=temperature, full=True)
    z = logits.double() / temperature.double()[:, None]
    want_full = torch.log_softmax(z, 1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got.logp_full.double(), want_full, rtol=1e-5, atol=1e-5)
    for t in (0, 1):
        mass = torch.exp(torch.logsumexp(z[t, rows[t]], 0) - torch.logsumexp(z[t], 0))
        assert abs(float(got.support_mass[t]) - float(mass)) < 1e-5 * float(mass)
    assert torch.isnan(got.support_mass[2]) and torch.isnan(got.logp_support[2])
    assert not (got.logp_full.requires_grad or got.support_mass.requires_grad)
    # the gradient is logp_S's alone, as without full
    got.logp_support.nan_to_num(0.0).sum().backward()
    plain = logits.clone().requires_grad_(True)
    replay_logprobs(plain, targets, offsets, ids, temperature=temperature).nan_to_num(0.0) \
        .sum().backward()
    assert torch.equal(leaf.grad, plain.grad)


# One rank of a vocab-parallel group (gloo, CPU, Triton's interpreter):
# argv: rank world port out_dir. Every rank builds the same batch, takes
# its contiguous vocabulary range and saves its result and gradient shard.
RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[5])
    from test_kernel_replay import parallel_batch
    from shmask.kernels.replay import replay_logprobs_vocab_parallel
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    device = sys.argv[6]  # cuda on a GPU run (gloo reduces CUDA tensors too)
    logits, targets, offsets, ids, forms, temperature, vocab = (
        x.to(device) if isinstance(x, torch.Tensor) else x for x in parallel_batch())
    bounds = [vocab * r // world for r in range(world + 1)]
    shard = logits[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_(True)
    got = replay_logprobs_vocab_parallel(shard, targets, offsets, ids, vocab_start=bounds[rank],
                                         vocab=vocab, temperature=temperature, forms=forms)
    got.nan_to_num(0.0).sum().backward()
    torch.save({"logp": got.detach(), "grad": shard.grad, "start": bounds[rank]},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
""")


def parallel_batch():
    """The batch every rank builds: ids and bitmask rows, one undefined
    row (its target outside its support), per-token temperatures."""
    gen = torch.Generator().manual_seed(40)
    vocab = 203  # ranges that split words and leave a partial last word
    rows = [sorted(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (3, 150, 40, 90, 1)]
    rows.append([0, 49, 50, 51, 100, 101, 102, 151, 152, 202])  # both sides of every range's edge
    forms = [0, 1, 0, 1, 0, 0]
    data = [bitmask_words(r, vocab) if f else r for r, f in zip(rows, forms, strict=True)]
    offsets = torch.tensor([0] + [len(d) for d in data]).cumsum(0)
    ids = torch.tensor([x for d in data for x in d], dtype=torch.int32)
    targets = torch.tensor([r[len(r) // 2] for r in rows])
    targets[2] = next(i for i in range(vocab) if i not in rows[2])
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.3, 0.5, 1.0])
    return (logits, targets, offsets, ids, torch.tensor(forms, dtype=torch.int32), temperature,
            vocab)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_the_unsharded_call(world: int, tmp_path) -> None:
    """Ranks of a gloo group, each holding a contiguous vocabulary range:
    every rank's result is the unsharded call's, and their gradient shards
    put together are its gradient."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    # The ranks run where the test does: CPU tensors in the interpreter, or
    # CUDA (Triton 3.6's interpreter, the H200's, cannot run the kernels)
    env = {**os.environ, "TRITON_INTERPRET": "0" if DEVICE == "cuda" else "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(world), str(port),
                               str(tmp_path), tests_dir, DEVICE], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:  # each rank's group: itself if it hangs
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert all(p.returncode == 0 for p in procs), outputs
    logits, targets, offsets, ids, forms, temperature, vocab = (
        x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in parallel_batch())
    leaf = logits.clone().requires_grad_(True)
    want = replay_logprobs(leaf, targets, offsets, ids, temperature=temperature, forms=forms)
    want.nan_to_num(0.0).sum().backward()
    assert torch.isnan(want[2]) and torch.isfinite(want[[0, 1, 3, 4, 5]]).all()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for result in results:
        torch.testing.assert_close(result["logp"], want, rtol=1e-5, atol=1e-6, equal_nan=True)
    grad = torch.cat([r["grad"] for r in sorted(results, key=lambda r: r["start"])], dim=1)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-6)


# Every configuration the launchers use, compiled for the H200 (sm_90) on
# this machine, in a process of its own (Triton's mode is the process's):
# what the interpreter accepts, the compiler may not (a loop variable of
# two types, once).
COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from shmask.kernels import replay
    common = {"logits_ptr": None, "stride_row": "i32", "col_start": "i32", "n_cols": "i32",
              "vocab": "i32", "target_ptr": "*i64", "temp_ptr": None, "offsets_ptr": "*i64",
              "ids_ptr": "*i32"}
    compiled = 0
    for dtype, acc in (("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
        typed = {**common, "logits_ptr": "*" + dtype, "temp_ptr": "*" + acc}
        forward = {**typed, "nnz": "i32", "ok_ptr": "*i8", "form_ptr": "*i32",
                   **{name: "*" + acc for name in ("out_ptr", "logz_ptr", "full_ptr", "mass_ptr")},
                   "zs_ptr": "*" + acc,
                   **{name: "constexpr" for name in ("BLOCK", "WORD_BLOCK", "ROW_BLOCK", "FULL",
                                                     "PARTIAL", "F64", "SAVE")}}
        backward = {**typed, "zs_ptr": "*" + acc, "form_ptr": "*i32", "logz_ptr": "*" + acc,
                    "grad_out_ptr": "*" + acc, "grad_ptr": "*" + dtype,
                    "WORD_BLOCK": "constexpr", "ZERO_BLOCK": "constexpr", "CHUNK": "constexpr",
                    "F64": "constexpr"}
        sizes = {"BLOCK": replay.BLOCK, "WORD_BLOCK": replay.WORD_BLOCK, "F64": dtype == "fp64",
                 "ROW_BLOCK": replay.FULL_BLOCK}
        sources = []
        # int64 ids (read as they are) beside int32, for one dtype; with
        # save (a gradient wanted) the kept logits, else the first output
        # in their place (never written)
        for ids_type in ("*i32", "*i64") if dtype == "bf16" else ("*i32",):
            sources += [ASTSource(replay._replay_forward_kernel, {**forward, "ids_ptr": ids_type},
                                  {**sizes, "FULL": full, "PARTIAL": partial, "SAVE": save})
                        for full, partial, save in ((False, False, False), (True, False, False),
                                                    (False, True, False), (False, False, True),
                                                    (False, True, True))]
            sources.append(ASTSource(replay._replay_backward_kernel,
                                     {**backward, "ids_ptr": ids_type},
                                     {"WORD_BLOCK": replay.BACKWARD_WORD_BLOCK,
                                      "ZERO_BLOCK": replay.ZERO_BLOCK,
                                      "CHUNK": replay.BACKWARD_CHUNK, "F64": dtype == "fp64"}))
        for source in sources:
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            assert "cubin" in kernel.asm
            if source.fn is replay._replay_backward_kernel:
                # an ids row's values land on their block's zeros only after
                # the barrier between them (the interpreter runs a program's
                # threads in order, so only the compiled kernel can lack it)
                assert "ttg.barrier" in kernel.asm["ttir"]
            compiled += 1
    print("compiled", compiled)
""")


def test_kernels_compile_for_the_h200(tmp_path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=300)[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0 and "compiled 30" in output, output[-3000:]


@pytest.mark.skipif(DEVICE != "cuda", reason="full sizes need the GPU (make test-gpu)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_sizes_on_the_gpu(dtype: torch.dtype) -> None:
    """The issue's shapes on the GPU: V = 151,936, ids rows of 1, 1,000,
    4,096 ids and the whole vocabulary beside top-p-like bitmask rows, logit
    scales from flat to peaked, per-token temperatures; values and gradients
    against the float64 dense reference on the same input values."""
    gen = torch.Generator(device=DEVICE).manual_seed(151936)
    vocab, n = 151936, 512
    scale = torch.tensor([0.5, 1.0, 3.0, 8.0], device=DEVICE).repeat(n // 4)[:, None]
    logits = (torch.randn(n, vocab, generator=gen, device=DEVICE) * scale).to(dtype)
    forms = (torch.arange(n, device=DEVICE) % 3 == 2).int()  # every third row a bitmask
    words = (vocab + 31) // 32
    data, targets = [], []
    for t in range(n):
        if forms[t]:
            keep = torch.rand(vocab, generator=gen, device=DEVICE) < (0.05 + 0.9 * (t % 7) / 6)
            keep[int(torch.randint(vocab, (1,), generator=gen, device=DEVICE))] = True
            padded = torch.zeros(words * 32, dtype=torch.int64, device=DEVICE)
            padded[:vocab] = keep.long()
            packed = (padded.view(words, 32) << torch.arange(32, device=DEVICE)).sum(1)
            data.append(torch.where(packed >= 1 << 31, packed - (1 << 32), packed).int())
            kept = keep.nonzero()[:, 0]
        else:
            k = (1, 1000, 4096, vocab)[t % 4]
            kept = torch.rand(vocab, generator=gen, device=DEVICE).topk(k).indices.sort().values
            data.append(kept.int())
        targets.append(kept[int(torch.randint(kept.numel(), (1,), generator=gen,
                                              device=DEVICE))])
    offsets = torch.tensor([0] + [d.numel() for d in data], device=DEVICE).cumsum(0)
    ids = torch.cat(data)
    targets_t = torch.stack(targets)
    temperature = 0.5 + torch.rand(n, generator=gen, device=DEVICE)
    weights = torch.randn(n, generator=gen, device=DEVICE, dtype=torch.float64)

    leaf = logits.clone().requires_grad_(True)
    got = replay_logprobs(leaf, targets_t, offsets, ids, temperature=temperature, forms=forms)
    (got.double() * weights).sum().backward()
    ref_leaf = logits.clone().requires_grad_(True)
    want = reference_replay_logprobs(ref_leaf, targets_t, offsets, ids, temperature=temperature,
                                     forms=forms)
    (want * weights).sum().backward()
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad.double(), rtol=tol, atol=tol)
    assert (leaf.grad[ref_leaf.grad == 0] == 0).all()  # nothing outside the supports
