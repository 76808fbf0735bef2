"""shmask.adapters.sglang against the released SGLang 0.5.23 modules.

At import this module applies shmask/integrations/sglang.patch to a copy of
the installed package (a symlink tree; only the patched files are real
copies) and imports SGLang from that copy, so every test here runs against
the code a maintainer would ship. SGLang's *released* chunk and rows classes
(which the patch rebinds) are loaded straight from the installed
sampling_mask.py, which imports nothing of SGLang.

Rows go through a real shmask Writer/Reader over real shared memory.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path
from types import SimpleNamespace

import msgspec.inspect as mi
import numpy as np
import orjson
import pytest
import torch

import shmask
from shmask.adapters import sglang as adapter

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "shmask" / "integrations" / "sglang.patch"
SITE = Path(importlib.util.find_spec("sglang").origin).parents[1]  # site-packages, not imported
PATCHED_FILES = re.findall(r"^\+\+\+ b/(\S+)", PATCH.read_text(), re.MULTILINE)


def _patched_copy() -> Path:
    root = Path(tempfile.mkdtemp(prefix="shmask-sglang-"))
    subprocess.run(["cp", "-rs", str(SITE / "sglang"), str(root / "sglang")], check=True)
    for name in PATCHED_FILES:  # real files, so patching never writes through a link
        (root / name).unlink()
        shutil.copy(SITE / name, root / name)
    subprocess.run(["patch", "-s", "-p1", "-d", str(root), "-i", str(PATCH)], check=True)
    return root


# Import SGLang from the patched copy (nothing in tests/compat imports sglang
# before this module; drop it anyway so the patched files are the ones used).
for _name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
    del sys.modules[_name]
PATCHED_ROOT = _patched_copy()
sys.path.insert(0, str(PATCHED_ROOT))

from sglang.srt.managers import io_struct, multi_tokenizer_mixin, tokenizer_manager  # noqa: E402
from sglang.srt.managers.scheduler_components import output_streamer  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.sampling import sampling_mask  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "sglang_released_sampling_mask", SITE / "sglang/srt/sampling/sampling_mask.py")
released = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(released)


# Removed when the process ends, not when this module's tests do: SGLang
# imports many of its modules lazily, and later tests in the same process
# import them from the copy that sys.modules already points at.
atexit.register(shutil.rmtree, PATCHED_ROOT, True)


@pytest.fixture(autouse=True)
def ends(writer, reader, monkeypatch):
    monkeypatch.setitem(adapter._ends, "writer", writer)
    monkeypatch.setitem(adapter._ends, "reader", reader)
    return writer, reader


# ------------------------------------------------------------------ patch
def test_patch_applies_to_the_installed_package_and_stays_small():
    done = subprocess.run(["patch", "--dry-run", "-p1", "-d", str(SITE), "-i", str(PATCH)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout and "fuzz" not in done.stdout.lower(), done.stdout
    changed = [line for line in PATCH.read_text().splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    # 66: nine files; the sampler (3 hunks), admission, rows past the cap,
    # arrays-mode responses (dumps_json, chat's model_json_response,
    # coalescing), the PD cap check
    assert 0 < len(changed) < 75, len(changed)


def test_patched_modules_are_the_ones_imported_and_use_the_adapter():
    for module in (io_struct, output_streamer, tokenizer_manager, sampling_mask):
        assert str(PATCHED_ROOT) in module.__file__
    assert sampling_mask.SamplingMaskChunk is adapter.SamplingMaskChunk
    assert sampling_mask.SamplingMaskRows is adapter.SamplingMaskRows
    assert io_struct.SamplingMaskChunk is adapter.SamplingMaskChunk
    assert output_streamer.take_all is adapter.take_all
    # Released classes are still SGLang's own (the comparison below needs them).
    assert released.SamplingMaskChunk is not adapter.SamplingMaskChunk


# ------------------------------------------------------- one seeded stream
B, W, STEPS, EMISSIONS = 6, 9, 4, 3
MODES = ["selected", None, "support", "support", "selected", "support"]  # None: no masks


def _sampler_output(rng, step: int):
    """A SamplingMaskOutput as the sampler hands it over (torch tensors), for
    the opted-in requests: supports with distinct ids that hold the sampled
    token, as test_sampling_mask.py requires of real responses."""
    opted = [i for i, m in enumerate(MODES) if m is not None]
    n = len(opted)
    lengths = rng.integers(0, W + 1, n)
    lengths[0] = W  # a full-width row (ties past top_k keep rows long)
    token_ids = np.zeros((n, W), np.int32)
    for r in range(n):
        token_ids[r, :lengths[r]] = rng.choice(151_936, lengths[r], replace=False)
    support_rows = [r for r, i in enumerate(opted) if MODES[i] == "support"]
    support = (rng.standard_normal((len(support_rows), W)) - 3).astype(np.float32)
    if step == 1:
        support[0, :3] = [-np.inf, np.float32(1e-45), -0.0]  # floats JSON writes specially
    statuses = np.zeros(n, np.int64)
    if step == 2:
        statuses[1] = 1  # OVERFLOW: SGLang aborts this request's token; no row
    return SimpleNamespace(
        token_ids=torch.from_numpy(token_ids), lengths=torch.from_numpy(lengths),
        selected_logprobs=torch.from_numpy((rng.standard_normal(n) - 1).astype(np.float32)),
        support_logprobs=torch.from_numpy(support), statuses=torch.from_numpy(statuses),
        num_accept_tokens=None)


def _run_stream(seed: int, rows_factory):
    """Steps through SGLang's real batch result processor (materialize, then
    add_sampling_mask_return_values for committed rows, as its decode loop
    does); one take per request and emission. Returns chunks per emission."""
    rng = np.random.default_rng(seed)
    reqs = [SimpleNamespace(return_sampling_mask=m is not None, sampling_logprobs_mode=m,
                            sampling_mask_rows=rows_factory(m) if m else None,
                            output_ids=[], finished_len=None) for m in MODES]
    processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
    emissions = []
    for _ in range(EMISSIONS):
        for step in range(STEPS):
            host = SimpleNamespace(sampling_mask_output=_sampler_output(rng, step))
            SchedulerBatchResultProcessor.materialize_sampling_mask_output(reqs, host)
            for i, req in enumerate(reqs):
                if req.return_sampling_mask and host.next_token_sampling_mask_status[i] == 0:
                    processor.add_sampling_mask_return_values(i, req, host)
        emissions.append([req.sampling_mask_rows for req in reqs])
        if rows_factory is adapter.SamplingMaskRows:
            emissions[-1] = adapter.take_all(emissions[-1])  # what the patched streamer does
        else:
            emissions[-1] = [r.take() if r is not None else None for r in emissions[-1]]
    return emissions


def _released_rows(mode):
    return released.SamplingMaskRows()


def test_to_lists_byte_identical_to_sglang_chunks():
    ours, theirs = _run_stream(11, adapter.SamplingMaskRows), _run_stream(11, _released_rows)
    rows_seen = 0
    for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
        for mode, mine, sglang_chunk in zip(MODES, ours_batch, theirs_batch, strict=True):
            if mode is None:
                assert mine is None and sglang_chunk is None
                continue
            np.testing.assert_array_equal(mine.lengths, sglang_chunk.lengths)
            np.testing.assert_array_equal(mine.token_ids, sglang_chunk.token_ids)
            np.testing.assert_array_equal(mine.logprobs.view(np.uint32),
                                          sglang_chunk.logprobs.view(np.uint32))
            expected = sglang_chunk.to_lists(support_logprobs=mode == "support")
            got = mine.to_lists(support_logprobs=mode == "support")
            assert got == expected
            assert orjson.dumps(got) == orjson.dumps(expected)
            rows_seen += len(got[0])
    assert rows_seen > 50


def new_state():
    return tokenizer_manager.ReqState(out_list=[], finished=False, event=None, obj=None,
                                      time_stats=None)


def _sglang_meta(state, chunk, support, kind, rid="r"):
    """meta_info as TokenizerManager._handle_batch_output builds it for one
    emission (its ReqState lists, extend, len) and, for incremental
    streaming, its real _slice_streaming_output_meta_info."""
    meta = {"id": rid, "finish_reason": None, "prompt_tokens": 5}
    masks, logprobs = chunk.to_lists(support_logprobs=support)
    state.output_token_sampling_mask.extend(masks)
    state.output_token_sampling_logprobs.extend(logprobs)
    meta["output_token_sampling_mask"] = state.output_token_sampling_mask
    meta["output_token_sampling_logprobs"] = state.output_token_sampling_logprobs
    meta["output_token_sampling_mask_length"] = len(state.output_token_sampling_mask)
    meta["completion_tokens"] = len(state.output_token_sampling_mask)
    if kind == "incremental":
        tokenizer_manager._slice_streaming_output_meta_info(meta, state.last_output_offset)
        state.last_output_offset = len(state.output_token_sampling_mask)
    return meta


@pytest.mark.parametrize("kind", ["non-streaming", "streaming", "incremental"])
def test_meta_info_orjson_byte_identical(kind):
    ours, theirs = _run_stream(12, adapter.SamplingMaskRows), _run_stream(12, _released_rows)
    for i, mode in enumerate(MODES):
        if mode is None:
            continue
        support = mode == "support"
        state = new_state()
        accumulated = adapter.SamplingMaskJSON(support)
        offset = 0
        for e in range(EMISSIONS):
            expected = orjson.dumps(_sglang_meta(state, theirs[e][i], support, kind))
            meta = {"id": "r", "finish_reason": None, "prompt_tokens": 5}
            accumulated.extend(ours[e][i])
            meta.update(adapter.response_meta_info(
                accumulated, start=offset if kind == "incremental" else 0))
            meta["completion_tokens"] = len(accumulated)
            offset = len(accumulated)
            if kind != "non-streaming" or e == EMISSIONS - 1:  # non-streaming: only the end
                assert orjson.dumps(meta) == expected, (kind, mode, e)
        # test_sampling_mask.py: the count equals the tokens, one support per token
        assert json_len(orjson.dumps(meta)) == len(accumulated) == len(
            state.output_token_sampling_mask)


def json_len(data: bytes) -> int:
    return orjson.loads(data)["output_token_sampling_mask_length"]


def test_coalesced_incremental_chunks_match():
    """Two queued incremental outputs coalesced by SGLang's own helper equal
    one response built from the offset of the first."""
    ours, theirs = _run_stream(13, adapter.SamplingMaskRows), _run_stream(13, _released_rows)
    i, support = 2, True
    state = new_state()
    outs = [{"meta_info": _sglang_meta(state, theirs[e][i], support, "incremental")}
            for e in range(EMISSIONS)]
    coalesced = tokenizer_manager.TokenizerManager._coalesce_streaming_chunks(
        None, outs[1:], "r", set())
    accumulated = adapter.SamplingMaskJSON(support)
    accumulated.extend(ours[0][i])
    start = len(accumulated)
    for e in range(1, EMISSIONS):
        accumulated.extend(ours[e][i])
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 5,
            **adapter.response_meta_info(accumulated, start=start),
            "completion_tokens": len(accumulated)}
    assert orjson.dumps(meta) == orjson.dumps(coalesced["meta_info"])


# ------------------------------------------------------------- IPC structs
def _filler(t, count: int):
    if isinstance(t, mi.UnionType) and any(isinstance(x, mi.NoneType) for x in t.types):
        return None
    if isinstance(t, mi.ListType):
        return [_filler(t.item_type, 1) for _ in range(count)]
    if isinstance(t, mi.StrType):
        return "x"
    if isinstance(t, mi.IntType):
        return 3
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.CustomType) and t.cls is array:
        return array("i", [1, 2])
    if isinstance(t, mi.DictType):
        return {}
    raise AssertionError(f"no filler for {t}")


def _batch(cls, rids, masks):
    values = {f.name: _filler(f.type, len(rids)) for f in mi.type_info(cls).fields if f.required}
    values.update(rids=rids, output_token_sampling_mask=masks)
    if "output_ids" in values:
        values["output_ids"] = [array("i", [i]) for i in range(len(rids))]
    return cls(**values)


def _emission(rng, modes):
    rows = [adapter.SamplingMaskRows(m) if m else None for m in modes]
    expected = []
    for r in rows:
        masks, values = [], []
        for _ in range(3):
            if r is None:
                continue
            n = int(rng.integers(1, 8))
            ids = rng.choice(1000, n, replace=False).astype(np.int32)
            lp = (rng.standard_normal(n if r.support else 1) - 2).astype(np.float32)
            r.append(ids, lp)
            masks.append(ids.tolist())
            values.append(lp.tolist() if r.support else lp.tolist()[0])
        expected.append((masks, values) if r is not None else None)
    return rows, adapter.take_all(rows), expected


def _check(chunks, expected, modes):
    for chunk, exp, mode in zip(chunks, expected, modes, strict=True):
        if mode is None:
            assert chunk is None
        else:
            assert isinstance(chunk, adapter.SamplingMaskChunk)
            assert chunk.to_lists(support_logprobs=mode == "support") == exp


@pytest.mark.parametrize("cls", ["BatchTokenIDOutput", "BatchStrOutput"])
@pytest.mark.parametrize("carrier", ["msgpack", "pickle"])
def test_io_structs_round_trip_and_multi_tokenizer_split(cls, carrier):
    cls = getattr(io_struct, cls)
    modes = ["support", None, "selected", "support", "selected"]
    rows, chunks, expected = _emission(np.random.default_rng(21), modes)
    batch = _batch(cls, [f"rid{i}" for i in range(len(modes))], chunks)

    def hop(obj):
        if carrier == "msgpack":
            return io_struct._msgpack_decoder.decode(io_struct._msgpack_encoder.encode(obj))
        return pickle.loads(pickle.dumps(obj, protocol=5))

    wire = io_struct._msgpack_encoder.encode(batch)
    assert len(wire) < 2000, "references only: rows stay in shared memory"
    forwarded = hop(hop(batch))  # scheduler -> detokenizer -> tokenizer router
    assert type(forwarded) is cls
    carried = forwarded.output_token_sampling_mask
    assert not any(gc.is_tracked(c) for c in carried if c is not None)
    # Multi-tokenizer routing: one output per request, then a subset.
    singles = [hop(multi_tokenizer_mixin._handle_output_by_index(forwarded, i))
               for i in range(len(modes))]
    for i, single in enumerate(singles):
        assert single.rids == [f"rid{i}"]
        assert len(single.output_token_sampling_mask) == 1
    subset = hop(multi_tokenizer_mixin._handle_output_by_indices(forwarded, [3, 0]))
    assert subset.rids == ["rid3", "rid0"]
    # Each tokenizer reads (and releases) its requests' rows.
    _check([s.output_token_sampling_mask[0] for s in singles], expected, modes)
    for r in rows:
        if r is not None:
            r.close()


def test_deleted_state_chunk_is_released(writer, monkeypatch):
    """The patched tokenizer manager releases the chunk of a request whose
    state is gone (aborted); the ring gets the record back at once."""
    rows, chunks, _ = _emission(np.random.default_rng(22), ["support"])
    out = hop_msgpack(_batch(io_struct.BatchTokenIDOutput, ["gone"], chunks))
    manager = tokenizer_manager.TokenizerManager.__new__(tokenizer_manager.TokenizerManager)
    manager.rid_to_state = {}
    # The one runtime setting the method reads before its loop (a launched
    # server publishes it; this test builds no server).
    monkeypatch.setattr(tokenizer_manager, "get_serving",
                        lambda: SimpleNamespace(batch_notify_size=16))
    asyncio.run(manager._handle_batch_output(out))
    rows[0].close()
    writer.reclaim()
    assert writer.ring_usage()[0] == 0
    with pytest.raises(shmask.StaleChunkError):
        shmask.Reader().open(shmask.ChunkRef.from_bytes(chunks[0].ref))


@pytest.mark.parametrize("carrier", ["pickle", "msgpack"])  # SGLANG_USE_PICKLE_IPC 1 (default), 0
def test_stale_chunk_fails_only_its_request_in_sglang_tokenizer_manager(prefix, carrier):
    """A chunk read after SHMASK_LEASE_S and a garbled reference, in one
    message with two good requests, through the patched TokenizerManager's
    real handle_loop under SGLang's own print_exception_wrapper (which
    SIGKILLs the process on any exception), in a child process standing in
    for the server (tests/compat/_sglang_tokenizer_child.py says what is real
    and what is not run). The failed requests finish with SGLang's abort
    finish reason (the caller gets HTTPException 500 naming the error) and
    are aborted in the scheduler; the others get their exact rows, the loop
    serves the next message, the process lives."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "SGLANG_USE_PICKLE_IPC": "1" if carrier == "pickle" else "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("_sglang_tokenizer_child.py")),
             str(PATCHED_ROOT), f"{prefix}tm{carrier[0]}"],
            env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"tokenizer child hung: {exc.stderr!s:.3000}")
    assert done.returncode == 0, (f"the tokenizer process died (rc {done.returncode}): "
                                  f"{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("result "))
    result = json.loads(line[len("result "):])
    outcomes = result["outcomes"]
    for rid, error in (("late", "StaleChunkError"), ("garbled", "InvalidRefError")):
        got = outcomes[rid]
        assert got.get("error") == "HTTPException" and got["status_code"] == 500, got
        assert error in got["detail"] and "sampling masks" in got["detail"], got
    for rid in ("ok-selected", "ok-support"):
        assert outcomes[rid]["finish_reason"] == {"type": "length", "length": 2}, outcomes[rid]
        assert outcomes[rid]["masks"] == result["expected"][rid]
        assert outcomes[rid]["mask_length"] == 2
    assert sorted(result["aborts"]) == [["AbortReq", "garbled"], ["AbortReq", "late"]]
    assert result["loop_alive"]


def hop_msgpack(obj):
    return io_struct._msgpack_decoder.decode(io_struct._msgpack_encoder.encode(obj))


# ---------------------------------- ported from SGLang's sampling-mask tests
def test_materialize_only_requested_rows_and_statuses():
    """test_spec_sampling_mask.test_materialize_one_support_per_position /
    test_sampling_mask.test_*_only_materializes_requested_rows: requests not
    opted in carry None, a non-OK status carries no row, through the
    adapter's rows and the IPC struct."""
    output = SimpleNamespace(
        token_ids=torch.tensor([[5, 6], [7, 0], [8, 0]], dtype=torch.int32),
        lengths=torch.tensor([2, 1, 1]),
        selected_logprobs=torch.tensor([-0.5, 0.0, -0.25]),
        support_logprobs=None,
        statuses=torch.tensor([0, 0, 1]),  # the third: OVERFLOW
        num_accept_tokens=None)
    modes = ["selected", None, "selected", "selected"]
    reqs = [SimpleNamespace(return_sampling_mask=m is not None, sampling_logprobs_mode=m,
                            sampling_mask_rows=adapter.SamplingMaskRows(m) if m else None)
            for m in modes]
    host = SimpleNamespace(sampling_mask_output=output)
    SchedulerBatchResultProcessor.materialize_sampling_mask_output(reqs, host)
    processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
    for i, req in enumerate(reqs):
        if req.return_sampling_mask and host.next_token_sampling_mask_status[i] == 0:
            processor.add_sampling_mask_return_values(i, req, host)
    chunks = hop_msgpack(_batch(io_struct.BatchStrOutput, ["a", "b", "c", "d"],
                                adapter.take_all([r.sampling_mask_rows for r in reqs])))
    masks = chunks.output_token_sampling_mask
    assert masks[1] is None
    assert masks[0].to_lists(False) == ([[5, 6]], [-0.5])
    assert masks[2].to_lists(False) == ([[7]], [0.0])
    assert masks[3].to_lists(False) == ([], [])  # OVERFLOW: never materialised


def test_speculative_rows_follow_accepted_tokens():
    """test_spec_sampling_mask.test_mixed_selected_and_support_modes_follow_verify_positions:
    one row per accepted draft token, mixed modes in one batch."""
    output = SimpleNamespace(
        token_ids=torch.tensor([[[0, 1], [1, 0]], [[0, 1], [0, 0]]], dtype=torch.int32),
        lengths=torch.tensor([[2, 1], [2, 0]]),
        selected_logprobs=torch.tensor([[np.log(0.75), 0.0], [np.log(0.75), 0.0]]),
        support_logprobs=torch.tensor([[[np.log(0.75), np.log(0.25)], [0.0, 0.0]]]),
        statuses=torch.tensor([[0, 0], [0, 0]]),
        num_accept_tokens=torch.tensor([2, 1]))
    modes = ["selected", None, "support"]
    reqs = [SimpleNamespace(return_sampling_mask=m is not None, sampling_logprobs_mode=m,
                            sampling_mask_rows=adapter.SamplingMaskRows(m) if m else None,
                            output_ids=[0, 1] if m == "selected" else [0], finished_len=None)
            for m in modes]
    host = SimpleNamespace(sampling_mask_output=output)
    SchedulerBatchResultProcessor.materialize_sampling_mask_output(reqs, host)
    processor = SchedulerBatchResultProcessor.__new__(SchedulerBatchResultProcessor)
    processor.add_sampling_mask_return_values(0, reqs[0], host, accept_len=2)
    processor.add_sampling_mask_return_values(2, reqs[2], host, accept_len=1)
    masks, logprobs = reqs[0].sampling_mask_rows.take().to_lists(False)
    assert masks == [[0, 1], [1]]
    assert logprobs == [float(np.float32(np.log(0.75))), 0.0]
    masks, logprobs = reqs[2].sampling_mask_rows.take().to_lists(True)
    assert masks == [[0, 1]]
    assert logprobs == [[float(np.float32(np.log(0.75))), float(np.float32(np.log(0.25)))]]


# ----------------------------------------- arrays for in-process consumers
def _stream_with_drops(writer, seed: int, modes, emissions: int = 3, steps: int = 3):
    """Chunks per emission; rows of mixed lengths, some OVERFLOW / INVALID
    (sent with their status and no ids, as an engine aborting such requests
    may send them)."""
    rng = np.random.default_rng(seed)
    rows = [adapter.SamplingMaskRows(m) for m in modes]
    out = []
    for _ in range(emissions):
        for _ in range(steps):
            for r in rows:
                status = int(rng.choice([0, 0, 0, 1, 2]))
                n = 0 if status else int(rng.integers(0, 9))
                ids = np.sort(rng.choice(151_936, n, replace=False)).astype(np.int32)
                values = (rng.standard_normal(n) - 3).astype(np.float32)
                writer.append_step(np.array([r.handle], np.int64), np.array([n], np.int32), ids,
                                   values if r.support else np.zeros(n, np.float32),
                                   (rng.standard_normal(1) - 1).astype(np.float32),
                                   status=np.array([status], np.uint8))
        out.append(adapter.take_all(rows))
    return rows, out


def _tokenizer_outputs(monkeypatch, emissions, modes, stream: bool, incremental: bool):
    """The emissions through the patched TokenizerManager._handle_batch_output
    (BatchTokenIDOutput via SGLang's msgpack codec, the last one finishing
    the requests); what each request's out_list holds, as Engine.generate's
    caller receives it from _wait_one_response."""
    manager = tokenizer_manager.TokenizerManager.__new__(tokenizer_manager.TokenizerManager)
    manager.rid_to_state = {}
    manager.enable_metrics = manager.enable_lora = False
    manager.incremental_streaming_output = incremental
    manager.dump_requests_folder = manager.crash_dump_folder = ""  # no request dumps
    # Runtime settings a launched server publishes (this test builds none).
    monkeypatch.setattr(tokenizer_manager, "get_serving",
                        lambda: SimpleNamespace(batch_notify_size=16))
    monkeypatch.setattr(tokenizer_manager, "get_spec",
                        lambda: SimpleNamespace(speculative_algorithm=None))
    monkeypatch.setattr(manager, "config_value", lambda name: None, raising=False)
    rids = [f"req{i}" for i in range(len(modes))]
    states = {}
    for rid, mode in zip(rids, modes, strict=True):
        obj = io_struct.GenerateReqInput(rid=rid, input_ids=[1, 2], return_sampling_mask=True,
                                         sampling_logprobs_mode=mode, stream=stream)
        states[rid] = manager.rid_to_state[rid] = tokenizer_manager.ReqState(
            [], False, asyncio.Event(), obj, tokenizer_manager.APIServerReqTimeStats())
    for e, chunks in enumerate(emissions):
        last = e == len(emissions) - 1
        batch = _batch(io_struct.BatchTokenIDOutput, rids, chunks)
        batch.finished_reasons = [{"type": "length", "length": 9} if last else None] * len(rids)
        batch.output_ids = [array("i", [7] * 3) for _ in rids]
        batch.retraction_counts = [0] * len(rids)
        batch.time_stats = None
        asyncio.run(manager._handle_batch_output(hop_msgpack(batch)))
    return manager, {rid: state.out_list for rid, state in states.items()}


def _both_formats(writer, monkeypatch, seed: int, modes, stream: bool, incremental: bool):
    """The same seeded emissions through the patched tokenizer manager twice,
    lists mode (the default) and then arrays mode: (lists outputs, arrays
    outputs, the arrays-mode manager). Every rows queue is closed after."""
    rows_a, lists_emissions = _stream_with_drops(writer, seed, modes)
    _, lists_outs = _tokenizer_outputs(monkeypatch, lists_emissions, modes, stream, incremental)
    rows_b, arrays_emissions = _stream_with_drops(writer, seed, modes)
    monkeypatch.setitem(adapter._ends, "mask_format", "arrays")
    manager, arrays_outs = _tokenizer_outputs(monkeypatch, arrays_emissions, modes, stream,
                                              incremental)
    for r in rows_a + rows_b:
        r.close()
    return lists_outs, arrays_outs, manager


def _assert_rows_equal(ids_field, logprobs_field, masks, values, support):
    """The arrays-mode fields hold the lists-mode fields' rows, row for row."""
    if isinstance(ids_field, list):  # SGLang coalesced queued chunks: one item per row
        assert len(ids_field) == len(masks) == len(logprobs_field)
        for got, want in zip(ids_field, masks, strict=True):
            assert (got is None and want is None) or got.tolist() == want
        for got, want in zip(logprobs_field, values, strict=True):
            assert (got is None and want is None) or (
                (got.tolist() if support else got) == want)
        return
    assert isinstance(ids_field, adapter.SamplingMaskCSR)
    assert isinstance(logprobs_field, adapter.SamplingLogprobsCSR)
    assert len(ids_field) == len(masks) == len(logprobs_field) == len(values)
    offsets = ids_field.offsets
    for i, want in enumerate(masks):
        if want is None:
            assert values[i] is None and ids_field.status[i] != 0
            assert ids_field.lengths[i] == 0
            continue
        assert ids_field.status[i] == 0
        assert ids_field.token_ids[offsets[i]:offsets[i + 1]].tolist() == want
        got = (logprobs_field.values[offsets[i]:offsets[i + 1]].tolist() if support
               else float(logprobs_field.values[i]))
        assert got == values[i]
    assert ids_field.to_lists() == (masks, values)


@pytest.mark.parametrize("kind", ["non-streaming", "streaming", "incremental"])
def test_arrays_mode_in_the_tokenizer_managers_outputs(writer, monkeypatch, kind):
    """SHMASK_MASK_FORMAT=arrays through the patched tokenizer manager's own
    _handle_batch_output (and its incremental slicing, and its coalescing of
    queued chunks): each output's meta_info holds CSR arrays equal to the
    lists the default gives, row for row, dropped rows included; the
    default is SGLang's lists; every ring record is back after the copy."""
    modes = ["support", "selected", "support"]
    stream, incremental = kind != "non-streaming", kind == "incremental"
    lists_outs, arrays_outs, manager = _both_formats(writer, monkeypatch, 31, modes, stream,
                                                     incremental)
    writer.reclaim()
    assert writer.ring_usage()[0] == 0, "every record must be back once copied"
    dropped = 0
    for (rid, want_outs), mode in zip(lists_outs.items(), modes, strict=True):
        got_outs = arrays_outs[rid]
        assert len(got_outs) == len(want_outs) == (3 if stream else 1)
        for want, got in zip(want_outs, got_outs, strict=True):
            wm, gm = want["meta_info"], got["meta_info"]
            assert isinstance(wm["output_token_sampling_mask"], list)  # the default
            assert gm["output_token_sampling_mask_length"] == wm["output_token_sampling_mask_length"]
            _assert_rows_equal(gm["output_token_sampling_mask"],
                               gm["output_token_sampling_logprobs"],
                               wm["output_token_sampling_mask"],
                               wm["output_token_sampling_logprobs"], mode == "support")
            dropped += sum(m is None for m in wm["output_token_sampling_mask"])
        if incremental:  # a caller that fell behind: SGLang joins the queued chunks
            joined = [manager._coalesce_streaming_chunks(outs[1:], rid)["meta_info"]
                      for outs in (want_outs, got_outs)]
            _assert_rows_equal(joined[1]["output_token_sampling_mask"],
                               joined[1]["output_token_sampling_logprobs"],
                               joined[0]["output_token_sampling_mask"],
                               joined[0]["output_token_sampling_logprobs"], mode == "support")
    assert dropped > 0


# ---------------------------------------- arrays-mode responses as JSON
MASK_KEYS = {"output_token_sampling_mask", "output_token_sampling_logprobs",
             "output_token_sampling_mask_length"}


def _same_clock(got: dict, want: dict) -> dict:
    """``got`` with every meta_info value but the mask fields taken from
    ``want`` (the two runs differ in their timings: e2e_latency and such),
    in got's key order, which must be want's."""
    assert list(got["meta_info"]) == list(want["meta_info"])
    meta = {key: value if key in MASK_KEYS else want["meta_info"][key]
            for key, value in got["meta_info"].items()}
    return {**got, "meta_info": meta}


@pytest.mark.parametrize("kind", ["non-streaming", "streaming", "incremental"])
def test_arrays_mode_responses_are_the_released_json(writer, monkeypatch, kind):
    """SHMASK_MASK_FORMAT=arrays through the patched tokenizer manager, then
    the patched dumps_json (what /generate writes, whole or as each SSE
    event): byte for byte the JSON of the lists the default (and released
    SGLang) gives, every output, dropped rows included; so is SGLang's join
    of queued incremental chunks. The rows' JSON comes from shmask's native
    writer: no list is built (meta_info holds the CSR rows)."""
    from sglang.srt.utils import json_response

    assert str(PATCHED_ROOT) in json_response.__file__
    modes = ["support", "selected", "support"]
    stream, incremental = kind != "non-streaming", kind == "incremental"
    lists_outs, arrays_outs, manager = _both_formats(writer, monkeypatch, 47, modes, stream,
                                                     incremental)
    compared = 0
    for rid, want_outs in lists_outs.items():
        got_outs = arrays_outs[rid]
        for want, got in zip(want_outs, got_outs, strict=True):
            assert isinstance(got["meta_info"]["output_token_sampling_mask"],
                              adapter.SamplingMaskCSR)
            got = _same_clock(got, want)
            assert json_response.dumps_json(got) == json_response.dumps_json(want)
            assert json_response.dumps_json(want) == orjson.dumps(
                want, option=json_response.ORJSON_RESPONSE_OPTIONS)  # released bytes
            compared += 1
        if incremental:
            joined = [manager._coalesce_streaming_chunks(outs, rid) for outs in (want_outs, got_outs)]
            joined[1] = _same_clock(joined[1], joined[0])
            assert isinstance(joined[1]["meta_info"]["output_token_sampling_mask"],
                              adapter.SamplingMaskCSR)
            assert json_response.dumps_json(joined[1]) == json_response.dumps_json(joined[0])
    assert compared == len(modes) * (3 if stream else 1)
    with pytest.raises(TypeError, match="not JSON serializable"):
        adapter.json_default(object())


def test_chat_responses_are_written_natively_byte_identical(writer, monkeypatch):
    """/v1/chat/completions: a choice's meta_info keeps the arrays-mode rows,
    and the patched model_json_response writes the response with the native
    writer (adapter.model_json), byte-identical to what released SGLang's
    pydantic writes for the lists; a response without rows is pydantic's."""
    from sglang.srt.entrypoints.openai.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        UsageInfo,
    )
    from sglang.srt.utils import json_response

    assert str(PATCHED_ROOT) in json_response.__file__
    modes = ["support", "selected"]
    lists_outs, arrays_outs, _ = _both_formats(writer, monkeypatch, 5, modes, False, False)
    compared = 0
    for rid, (want,) in lists_outs.items():
        (got,) = arrays_outs[rid]
        got = _same_clock(got, want)
        responses = [ChatCompletionResponse(
            id=rid, created=1_796_000_000, model="m", usage=UsageInfo(prompt_tokens=3, total_tokens=8,
                                                                      completion_tokens=5),
            choices=[ChatCompletionResponseChoice(
                index=0, message={"role": "assistant", "content": "h\u00e9llo \u2028 \"q\""},
                finish_reason="stop", matched_stop=2, meta_info=out["meta_info"])])
            for out in (got, want)]
        assert isinstance(responses[0].choices[0].meta_info["output_token_sampling_mask"],
                          adapter.SamplingMaskCSR)
        released = responses[1].model_dump_json(by_alias=True).encode()
        assert json_response.model_json_response(responses[0]).body == released
        assert adapter.model_json(responses[1]) is None  # lists: pydantic writes them
        assert json_response.model_json_response(responses[1]).body == released
        compared += 1
    assert compared >= len(modes)

def test_coalesced_rows_join_slices_without_a_copy_and_anything_else_by_copy():
    """Consecutive slices of one request's rows (queued incremental chunks)
    join as one slice of them; rows of different origins are copied; lists
    join as SGLang joins them."""
    def csr(rows):
        out = adapter.SamplingMaskCSR(True)
        lengths = np.array([len(r) for r in rows], np.int32)
        ids = np.array([i for r in rows for i in r], np.int32)
        out._append(lengths, np.zeros(len(rows), np.uint8), ids, -ids.astype(np.float32) / 8)
        return out

    root = csr([[1, 2], [3], [4, 5, 6], [7]])
    parts = [{"m": root[0:1]}, {"m": root[1:3]}, {"m": root[3:4]}]
    joined = adapter.coalesced_rows(parts, "m")
    assert joined._origin == (root, 0, 4) and joined.to_lists() == root.to_lists()
    faces = [{"m": part["m"].logprob_rows} for part in parts]
    assert adapter.coalesced_rows(faces, "m").rows._origin == (root, 0, 4)
    other = csr([[9]])
    copied = adapter.coalesced_rows([{"m": root[0:2]}, {"m": other}], "m")
    assert copied._origin is None
    assert copied.to_lists()[0] == [[1, 2], [3], [9]]
    assert adapter.coalesced_rows([{"m": [[1]]}, {}, {"m": [[2]]}], "m") == [[1], [2]]


def test_outputs_leave_host_reads_sglangs_own_multi_node_arguments():
    """The three ServerArgs fields start_scheduler reads to tell a scheduler
    of --node-rank 1+ (its outputs go to node 0's tokenizer) exist under
    these names in the released package, and mean what the adapter takes
    them to mean."""
    from sglang.srt.server_args import ServerArgs

    single = ServerArgs(model_path="dummy")
    assert all(hasattr(single, name) for name in ("nnodes", "node_rank", "dist_init_addr"))
    assert adapter.outputs_leave_host(single) is None
    node_1 = ServerArgs(model_path="dummy", nnodes=2, node_rank=1,
                        dist_init_addr="10.1.2.3:5000")
    assert adapter.outputs_leave_host(node_1) == "10.1.2.3:5000"
    node_0 = ServerArgs(model_path="dummy", nnodes=2, node_rank=0,
                        dist_init_addr="10.1.2.3:5000")
    assert adapter.outputs_leave_host(node_0) is None
