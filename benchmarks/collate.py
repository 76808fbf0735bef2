"""Collation (issue 38): from the responses a trainer receives to the tensors
its loss needs, for one micro-batch of S sequences x T tokens x L-id rows
(the issue's size: 64 x 2,048 x 1,000, V = 151,936).

    python benchmarks/collate.py [--sequences 64] [--tokens 256] [--length 1000]
                                 [--mode selected] [--repeats 5] [--json PATH]
    python benchmarks/collate.py --smoke --json PATH     # a tiny size, seconds

The rows are random ascending distinct ids (one per stride of the
vocabulary), published through a real shmask ring (a Writer and a Reader;
ring names from SHMASK_NAME_PREFIX, else "shmaskbench") and turned into each
sequence's response body by the project's own writers, once, outside the
timing: ``encode_meta_info`` for the binary rows (``"sampling_mask_format":
"base64"``), ``meta_info_rows`` + ``response_json.dumps`` for the JSON lists
(byte-identical to SGLang's). A body is ``{"text": "", "meta_info": ...}``.
Every path starts from the S bodies (bytes) and ends with the tensors:

  a         shmask, binary rows: orjson.loads of each body, then
            shmask.train.from_binary -> ReplayBatch (then .to(device),
            through pinned memory, where CUDA exists)
  a-loads   the same bodies parsed by shmask.binary_rows.loads (the compiled
            parser, base64 decoded in the parse), then from_binary
  b         shmask, JSON lists (SGLang's default): orjson.loads, then
            shmask.train.from_json -> ReplayBatch
  c         the baseline a trainer writes by hand: orjson.loads, the rows
            concatenated into one id array (np.fromiter over the lists) and
            a token index (repeat_interleave), then one vectorised scatter
            into torch.zeros(N, V, dtype=torch.bool) (mask[token, ids] =
            True), plus the rollout logprobs as a tensor in selected mode
  c-loop    the same dense mask filled per token (mask[t, tensor(ids)] =
            True, one index_put per token): the form most RL code has

Before anything is timed, each path's result is checked against the rows as
generated: every token's data of a and b (all of it, vectorised, and a
sample of tokens decoded one by one to their ids), the dense masks' set bits
exactly (their count and every original (token, id) pair), the rollout
logprobs bit for bit. That first run also gives the path's peak RSS growth
(VmHWM reset through /proc/self/clear_refs, malloc_trim first). Then
--repeats interleaved repetitions; the median is reported, and baseline c's
median over each path's (c / path > 1: the path is faster). Freeing a
path's result is not timed; Python's GC stays on, as in a trainer.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from _common import SEGMENT_PREFIX, VOCAB, print_table, ring_mb_for

import shmask
from shmask import response_json, train
from shmask.adapters.sglang import meta_info_rows
from shmask.binary_rows import LENGTH_FIELD, MASK_FIELD, encode_meta_info, loads

LOGPROBS_FIELD = train.LOGPROBS_FIELD
ISSUE_SIZE = (64, 2048, 1000)  # sequences x tokens x ids per row
SMOKE_SIZE = (2, 8, 50)
DEFAULT_SIZE = (64, 256, 1000)  # N = 16,384: a 2.5 GB dense mask, fits a 24 GB host
GROUP_IDS = 4_000_000  # ids published through the ring at a time (bounds its size)
SAMPLED_TOKENS = 64  # tokens decoded one by one per check (besides the first and last)
BASELINE = "c"
PATHS = ("a", "a-loads", "b", "c", "c-loop")
DESCRIPTIONS = {
    "a": "binary rows: orjson.loads + from_binary",
    "a-loads": "binary rows: binary_rows.loads + from_binary",
    "b": "JSON lists: orjson.loads + from_json",
    "c": "JSON lists: orjson.loads + dense mask, vectorised scatter (baseline)",
    "c-loop": "JSON lists: orjson.loads + dense mask, per-token index_put",
}


# ---------------------------------------------------------------- machine
def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_growth(call: Callable[[], Any]) -> tuple[Any, float]:
    """(call(), the peak RSS above the RSS before it, in bytes; NaN where
    the peak cannot be reset)."""
    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _status_bytes("VmRSS")
    except OSError:
        return call(), float("nan")
    result = call()
    return result, float(_status_bytes("VmHWM") - before)


# --------------------------------------------------------------- workload
def generate(sequences: int, tokens: int, length: int, vocab: int, mode: str,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [S, T, L]: each row ascending distinct ids, one per stride
    of the vocabulary; logprobs float32: [S, T] the sampled token's in
    selected mode, [S, T, L] per id in support mode)."""
    rng = np.random.default_rng(seed)
    stride = vocab // length
    ids = np.empty((sequences, tokens, length), np.int32)
    base = np.arange(length, dtype=np.int64) * stride
    for t in range(tokens):
        ids[:, t, :] = base + rng.integers(0, stride, (sequences, length))
    shape = (sequences, tokens) if mode == "selected" else (sequences, tokens, length)
    logprobs = (-np.abs(rng.standard_normal(shape)) - 0.01).astype(np.float32)
    return ids, logprobs


def make_bodies(ids: np.ndarray, logprobs: np.ndarray, mode: str, vocab: int,
                prefix: str) -> tuple[list[bytes], list[bytes]]:
    """Each sequence's response body in both forms (binary rows, JSON
    lists), its rows published through a real ring and read back, a group
    of sequences at a time."""
    sequences, tokens, length = ids.shape
    group = max(1, min(sequences, GROUP_IDS // max(1, tokens * length)))
    config = shmask.Config(ring_mb=ring_mb_for(group, tokens, length, copies=2),
                           name_prefix=prefix, lease_s=600)
    binary: list[bytes] = []
    lists: list[bytes] = []
    with shmask.Writer(config) as writer, shmask.Reader(config) as reader:
        for first in range(0, sequences, group):
            members = range(first, min(sequences, first + group))
            queues = [writer.open_queue(mode) for _ in members]
            lengths = np.full(len(queues), length, np.int32)
            for t in range(tokens):
                step_ids = np.ascontiguousarray(ids[members.start:members.stop, t, :])
                step_logprobs = np.ascontiguousarray(logprobs[members.start:members.stop, t])
                writer.append_step(queues, lengths, step_ids, step_logprobs)
            refs = list(writer.take_batch(queues))
            for queue in queues:
                queue.close()
            for ref in refs:
                with reader.open(ref) as chunk:
                    meta = encode_meta_info(chunk)
                    binary.append(orjson.dumps({"text": "",
                                                "meta_info": orjson.Fragment(meta)}))
                    lists.append(response_json.dumps({"text": "",
                                                      "meta_info": meta_info_rows(chunk)}))
    return binary, lists


# ------------------------------------------------------------------ paths
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def path_a(bodies: list[bytes], vocab: int, device: torch.device) -> train.ReplayBatch:
    batch = train.from_binary([orjson.loads(body)["meta_info"] for body in bodies], vocab)
    if device.type == "cuda":
        batch = batch.to(device)
        sync(device)
    return batch


def path_a_loads(bodies: list[bytes], vocab: int, device: torch.device) -> train.ReplayBatch:
    batch = train.from_binary([loads(body)["meta_info"] for body in bodies], vocab)
    if device.type == "cuda":
        batch = batch.to(device)
        sync(device)
    return batch


def path_b(bodies: list[bytes], vocab: int, device: torch.device) -> train.ReplayBatch:
    batch = train.from_json([orjson.loads(body)["meta_info"] for body in bodies], vocab)
    if device.type == "cuda":
        batch = batch.to(device)
        sync(device)
    return batch


def _rollout_logprobs(metas: list[dict[str, Any]], device: torch.device) -> torch.Tensor | None:
    """Selected mode: the sampled token's logprob per token (None: NaN)."""
    values = [meta.get(LOGPROBS_FIELD) for meta in metas]
    if any(v is None or (v and isinstance(v[0], list)) for v in values):
        return None  # support mode: the per-id logprobs are not what the loss needs here
    flat = [math.nan if x is None else x for v in values for x in v]
    return torch.tensor(flat, dtype=torch.float32, device=device)


def path_c(bodies: list[bytes], vocab: int, device: torch.device) -> dict[str, Any]:
    """The dense mask from one concatenated id array, one scatter."""
    metas = [orjson.loads(body)["meta_info"] for body in bodies]
    rows = [row for meta in metas for row in meta[MASK_FIELD]]
    n = len(rows)
    lengths = np.fromiter((0 if row is None else len(row) for row in rows), np.int64, n)
    flat = np.fromiter(itertools.chain.from_iterable(row for row in rows if row), np.int64,
                       int(lengths.sum()))
    token = torch.repeat_interleave(torch.arange(n), torch.from_numpy(lengths))
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    mask[token.to(device), torch.from_numpy(flat).to(device)] = True
    out = {"mask": mask, "rollout_logprobs": _rollout_logprobs(metas, device)}
    sync(device)
    return out


def path_c_loop(bodies: list[bytes], vocab: int, device: torch.device) -> dict[str, Any]:
    """The dense mask filled token by token."""
    metas = [orjson.loads(body)["meta_info"] for body in bodies]
    n = sum(len(meta[MASK_FIELD]) for meta in metas)
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    t = 0
    for meta in metas:
        for row in meta[MASK_FIELD]:
            if row:
                mask[t, torch.tensor(row, device=device)] = True
            t += 1
    out = {"mask": mask, "rollout_logprobs": _rollout_logprobs(metas, device)}
    sync(device)
    return out


RUNNERS: dict[str, Callable[[list[bytes], int, torch.device], Any]] = {
    "a": path_a, "a-loads": path_a_loads, "b": path_b, "c": path_c, "c-loop": path_c_loop}


def tensor_bytes(result: Any) -> tuple[int, int]:
    """(bytes of every tensor of a path's result, bytes of its dense mask or 0)."""
    if isinstance(result, train.ReplayBatch):
        tensors = [result.seq_offsets, result.offsets, result.ids, result.forms, result.valid,
                   result.rollout_logprobs]
        dense = 0
    else:
        tensors = [result["mask"], result["rollout_logprobs"]]
        dense = result["mask"].numel() * result["mask"].element_size()
    total = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total, dense


# ----------------------------------------------------------------- checks
def _expected_words(rows: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmask words [n, ceil(V / 32)] int32 of rows of ids [n, L]."""
    words = -(-vocab // 32)
    bits = np.zeros((rows.shape[0], words * 32), np.uint8)
    np.put_along_axis(bits, rows.astype(np.int64), 1, axis=1)
    return np.packbits(bits, axis=1, bitorder="little").view("<i4")


def _sample(n: int, rng: np.random.Generator) -> np.ndarray:
    picks = rng.choice(n, size=min(n, SAMPLED_TOKENS), replace=False)
    return np.unique(np.concatenate([[0, n - 1], picks]))


def check_batch(batch: train.ReplayBatch, ids: np.ndarray, logprobs: np.ndarray, mode: str,
                vocab: int, rng: np.random.Generator) -> dict[str, Any]:
    """Every token's data equals its original row's (ids, or bitmask words by
    the producers' rule 32 L >= V); a sample of tokens decoded to its ids."""
    sequences, tokens, length = ids.shape
    n = sequences * tokens
    batch = batch.to("cpu")
    assert batch.vocab == vocab, batch.vocab
    assert batch.num_sequences == sequences and batch.num_tokens == n
    seq_offsets = batch.seq_offsets.numpy()
    assert (seq_offsets == np.arange(sequences + 1) * tokens).all(), "seq_offsets"
    assert bool(batch.valid.all()), "a row is not valid"
    bitmask = 32 * length >= vocab
    forms = batch.forms.numpy()
    assert (forms == (train.FORM_BITMASK if bitmask else train.FORM_IDS)).all(), "forms"
    width = -(-vocab // 32) if bitmask else length
    offsets, data = batch.offsets.numpy(), batch.ids.numpy()
    assert (offsets == np.arange(n + 1, dtype=np.int64) * width).all(), "offsets"
    flat = ids.reshape(n, length)
    if bitmask:
        block = 512
        for first in range(0, n, block):
            got = data[first * width:min(n, first + block) * width].reshape(-1, width)
            assert np.array_equal(got, _expected_words(flat[first:first + block], vocab)), \
                f"bitmask words of tokens {first}.."
    else:
        assert np.array_equal(data, flat.reshape(-1)), "ids"
    sampled = _sample(n, rng)
    for token in sampled:
        s = int(np.searchsorted(seq_offsets, token, side="right")) - 1
        t = int(token - seq_offsets[s])
        row = data[offsets[token]:offsets[token + 1]]
        if bitmask:
            bits = np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")
            assert not bits[vocab:].any(), f"token {token}: a bit past V"
            row = np.flatnonzero(bits)
        assert np.array_equal(row, ids[s, t]), f"sequence {s}, token {t}: support differs"
    if mode == "selected":
        assert batch.rollout_logprobs is not None
        got = batch.rollout_logprobs.numpy()
        assert np.array_equal(got.view(np.uint32), logprobs.reshape(-1).view(np.uint32)), \
            "rollout logprobs"
    else:
        assert batch.rollout_logprobs is None
    return {"ok": True, "tokens_compared": n, "ids_compared": n * length,
            "tokens_sampled": int(sampled.size), "form": "bitmask" if bitmask else "ids"}


def check_dense(result: dict[str, Any], ids: np.ndarray, logprobs: np.ndarray, mode: str,
                vocab: int, rng: np.random.Generator) -> dict[str, Any]:
    """The dense mask has exactly the original rows' bits: as many set bits
    as ids, and every original (token, id) set; a sample of rows read back."""
    sequences, tokens, length = ids.shape
    n = sequences * tokens
    mask = result["mask"].cpu()
    assert mask.dtype == torch.bool and tuple(mask.shape) == (n, vocab), mask.shape
    # counted without an int64 copy of the mask (mask.sum() makes one: 8 bytes
    # a vocabulary entry, 80 GB at 64 x 1,024)
    set_bits = int(torch.count_nonzero(mask))
    assert set_bits == n * length, f"{set_bits} bits set for {n * length} ids"
    flat = torch.from_numpy(ids.reshape(n, length)).long()
    where = (torch.arange(n)[:, None] * vocab + flat).reshape(-1)
    assert bool(mask.view(-1)[where].all()), "an original id is not set"
    del where
    sampled = _sample(n, rng)
    for token in sampled:
        s, t = divmod(int(token), tokens)
        got = torch.nonzero(mask[token]).flatten().numpy()
        assert np.array_equal(got, ids[s, t]), f"sequence {s}, token {t}: mask row differs"
    if mode == "selected":
        got = result["rollout_logprobs"].cpu().numpy()
        assert np.array_equal(got.view(np.uint32), logprobs.reshape(-1).view(np.uint32)), \
            "rollout logprobs"
    else:
        assert result["rollout_logprobs"] is None
    return {"ok": True, "set_bits": set_bits, "tokens_sampled": int(sampled.size)}


# ------------------------------------------------------------------- main
def size_note(sequences: int, tokens: int, length: int, vocab: int) -> str:
    s, t, row = ISSUE_SIZE
    n = s * t
    if (sequences, tokens, length) == ISSUE_SIZE:
        return f"this run is the issue's size ({s} x {t:,} x {row:,})"
    return (f"the issue's {s} x {t:,} x {row:,} (N = {n:,}) needs a larger host: its dense mask "
            f"alone is {n * vocab / 1e9:.1f} GB, its parsed JSON lists ~{n * row * 36 / 1e9:.1f} GB "
            f"more; this host has {meminfo('MemTotal') / 2**30:.1f} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, help=f"S (default {DEFAULT_SIZE[0]})")
    parser.add_argument("--tokens", type=int, help=f"T per sequence (default {DEFAULT_SIZE[1]})")
    parser.add_argument("--length", type=int, help=f"L ids per row (default {DEFAULT_SIZE[2]})")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--mode", choices=("selected", "support"), default="selected",
                        help="the rows' logprobs: the sampled token's (SGLang's default, what "
                             "the trainer's ratio needs) or one per id")
    parser.add_argument("--repeats", type=int, help="timed repetitions per path (default 5)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{' x '.join(map(str, SMOKE_SIZE))} (sizes given still apply), "
                             "2 repeats")
    parser.add_argument("--force", action="store_true",
                        help="run even where the dense mask may not fit in memory")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"which paths to run, comma-separated (default all: "
                             f"{','.join(PATHS)}); without the baseline c no ratio is given, "
                             "and the dense mask's memory is not needed")
    parser.add_argument("--json", help="write every figure here too")
    args = parser.parse_args()
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or any(p not in PATHS for p in paths):
        parser.error(f"--paths takes some of {','.join(PATHS)}")
    sizes = SMOKE_SIZE if args.smoke else DEFAULT_SIZE
    sequences = args.sequences if args.sequences is not None else sizes[0]
    tokens = args.tokens if args.tokens is not None else sizes[1]
    length = args.length if args.length is not None else sizes[2]
    repeats = args.repeats if args.repeats is not None else (2 if args.smoke else 5)
    vocab = args.vocab
    if min(sequences, tokens, length, repeats) < 1 or not 0 < length <= vocab:
        parser.error("sizes and repeats must be >= 1, and --length <= --vocab")
    n, nnz = sequences * tokens, sequences * tokens * length
    dense = BASELINE in paths or "c-loop" in paths
    # the dense mask (only where a dense path runs), the parsed lists, the index arrays
    need = n * vocab * dense + nnz * 60
    available = meminfo("MemAvailable")
    if available and need > 0.8 * available and not args.force:
        print(f"collate: {sequences} x {tokens} x {length} needs ~{need / 1e9:.1f} GB "
              f"(a {n * vocab / 1e9:.1f} GB dense mask) of {available / 1e9:.1f} GB available: "
              "pick smaller sizes, or --force", file=sys.stderr)
        return 2

    load_before = loadavg()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else "none"
    device_note = (f"CUDA: {device_name}; paths a, a-loads and b end with ReplayBatch.to(cuda) "
                   "(pinned memory), c builds its mask on the GPU" if cuda else
                   "no CUDA on this machine: the CPU part only is timed (ReplayBatch in host "
                   "memory; no .to(device), no pin_memory; the dense masks in host memory)")
    prefix = os.environ.get("SHMASK_NAME_PREFIX", SEGMENT_PREFIX)
    print(f"collate: {sequences} x {tokens:,} x {length:,} (S x T x L): N = {n:,} tokens, "
          f"{nnz:,} ids, V = {vocab:,}, {args.mode} mode; {repeats} repeats; torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"  {size_note(sequences, tokens, length, vocab)}")
    print(f"  {device_note}")
    print(f"  machine: nproc {os.cpu_count()}, loadavg {load_before}, "
          f"MemTotal {meminfo('MemTotal') / 2**30:.1f} GiB")

    started = time.perf_counter()
    ids, logprobs = generate(sequences, tokens, length, vocab, args.mode)
    binary, lists = make_bodies(ids, logprobs, args.mode, vocab, prefix)
    bodies = {"a": binary, "a-loads": binary, "b": lists, "c": lists, "c-loop": lists}
    print(f"  responses built in {time.perf_counter() - started:.1f} s (untimed): "
          f"binary rows {sum(map(len, binary)) / 1e6:,.1f} MB, "
          f"JSON lists {sum(map(len, lists)) / 1e6:,.1f} MB")
    for body in (binary[0], lists[0]):  # each response holds its whole sequence
        assert orjson.loads(body)["meta_info"][LENGTH_FIELD] == tokens

    rng = np.random.default_rng(1)
    records: dict[str, dict[str, Any]] = {}
    for key in paths:  # checked (and its memory measured) before any timing
        result, growth = peak_rss_growth(lambda key=key: RUNNERS[key](bodies[key], vocab, device))
        if isinstance(result, train.ReplayBatch):
            check = check_batch(result, ids, logprobs, args.mode, vocab, rng)
        else:
            check = check_dense(result, ids, logprobs, args.mode, vocab, rng)
        total, dense = tensor_bytes(result)
        del result
        records[key] = {"path": key, "description": DESCRIPTIONS[key], "checked": check["ok"],
                        "check": check, "response_bytes": sum(map(len, bodies[key])),
                        "tensor_bytes": total, "dense_mask_bytes": dense,
                        "peak_rss_growth_bytes": growth, "seconds": []}
    form = next(iter(records.values()))["check"].get("form", "dense")
    print(f"  checks: every path's result equals the generated rows ({n:,} tokens each; "
          f"{form} rows)")

    for _ in range(repeats):
        for key in paths:
            gc.collect()
            begun = time.perf_counter()
            result = RUNNERS[key](bodies[key], vocab, device)
            records[key]["seconds"].append(time.perf_counter() - begun)
            del result  # freeing is not timed
    baseline = (statistics.median(records[BASELINE]["seconds"]) if BASELINE in records
                else float("nan"))  # not run: no ratio
    for record in records.values():
        record["median_s"] = statistics.median(record["seconds"])
        record["baseline_over_path"] = baseline / record["median_s"]
    load_after = loadavg()
    own = f"{prefix}-{os.getuid()}-{os.getpid()}-"  # shmask's ring names: ours alone
    left = sorted(name for name in os.listdir("/dev/shm") if name.startswith(own))

    mb = 1e6
    print_table(f"Collation: {sequences} x {tokens:,} x {length:,} (N = {n:,}), V = {vocab:,}, "
                f"{args.mode} mode; medians of {repeats}, interleaved",
                ["path", "median s", "c / path", "responses MB", "tensors MB",
                 "peak RSS +MB", "checked"],
                [[f"{key}: {r['description']}", r["median_s"], r["baseline_over_path"],
                  r["response_bytes"] / mb, r["tensor_bytes"] / mb,
                  r["peak_rss_growth_bytes"] / mb, r["checked"]] for key, r in records.items()],
                note="MB = 10^6 bytes. tensors: the ReplayBatch's (seq_offsets, offsets, ids, "
                     "forms, valid, rollout_logprobs) or the dense bool [N, V] mask (+ rollout "
                     "logprobs). peak RSS +MB: the first (checked) run's peak above its start.")
    print(f"  dense mask: {n:,} x {vocab:,} = {n * vocab:,} bytes; loadavg before {load_before}, "
          f"after {load_after}")
    print(f"segments left in /dev/shm: {len(left)}")

    if args.json:
        out = {"benchmark": "collate", "sequences": sequences, "tokens": tokens, "length": length,
               "vocab": vocab, "mode": args.mode, "num_tokens": n, "nnz": nnz,
               "repeats": repeats, "smoke": args.smoke, "baseline": BASELINE,
               "cuda": cuda, "device": device_name, "device_note": device_note,
               "size_note": size_note(sequences, tokens, length, vocab),
               "issue_size": {"sequences": ISSUE_SIZE[0], "tokens": ISSUE_SIZE[1],
                              "length": ISSUE_SIZE[2],
                              "dense_mask_bytes": ISSUE_SIZE[0] * ISSUE_SIZE[1] * vocab},
               "machine": {"nproc": os.cpu_count(), "loadavg_before": load_before,
                           "loadavg_after": load_after, "mem_total_bytes": meminfo("MemTotal"),
                           "torch_threads": torch.get_num_threads(),
                           "torch": torch.__version__, "python": sys.version.split()[0]},
               "dense_mask_bytes": n * vocab, "segments_left": len(left),
               # (no ratio without the baseline: null, not NaN, in the JSON)
               "paths": [{**r, "baseline_over_path": None if r["baseline_over_path"] != r[
                   "baseline_over_path"] else r["baseline_over_path"]} for r in records.values()]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
