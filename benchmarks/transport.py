"""Part 1: shmask against the peer transports, three real processes.

scheduler --PUSH/PULL--> detokenizer --PUSH/PULL--> tokenizer, over zmq
ipc:// in a temporary directory; the tokenizer acks each emission back to the
scheduler so one emission is in flight at a time (clean per-stage numbers on a
2-core machine). Four transports carry the same rows:

  lists   nested Python lists (one list per row), pickled at every hop
  arrays  one (lengths, ids, logprobs) numpy chunk per request, pickled as bytes at every hop
  oob     the same chunks, pickle protocol 5 with out-of-band buffers as zmq frames, copy=False
  shmask  rows staged in the shared-memory ring; only a RefBatch crosses the sockets

What each stage's time includes (median over the measured emissions):
  append/step   the scheduler's per-step bookkeeping: one [B, W] host buffer into per-request staging
  scheduler     one emission: build the message from the staging + send_multipart returning
  detokenizer   recv (after poll says a message is there) + decode + re-encode + send returning
  tokenizer     recv + decode until the tokenizer holds the rows (lists or numpy views), plus
                giving them back (shmask: release the chunks)
  build         response lists from the held rows (lists: none, the rows arrived as lists)
  latency       scheduler's emission start -> tokenizer holding the rows (one CLOCK_MONOTONIC)
  CPU           CPU time of all three processes, every thread included (zmq's I/O threads),
                between a mark message sent after warmup and the stop message, per emission.
                The harness's own work is not in it (the tokenizer's checksums are taken out
                with its thread CPU clock; the scheduler's run after the stop). "no build"
                also takes out building and freeing the response lists (thread CPU clock)
  bytes         payload frames sent on both hops
`python benchmarks/transport.py --sglang` runs SGLang 0.5.23 as released
(`sglang`: its SamplingMaskRows/SamplingMaskChunk through its own msgpack
encoder, responses by to_lists + orjson) beside shmask.adapters.sglang
(`sglang-shm`: the patched SGLang's per-request appends; `sglang-shm-step`:
the vectorised per-step path; responses by response_meta_info) at 256 x 50 x
1000 support, then response bytes from the same rows both ways.
Every emission is verified: the tokenizer's CRC of the rows it holds must equal
the CRC of the pool rows the scheduler emitted.

Workloads: 256 requests x 50-token emissions x support {20, 1000, 8192} (rows
of W-3..W entries), support and selected modes. `lists` is not run at 8192:
one emission is ~105 M Python ints and as many floats per copy (minutes and
over 10 GB per hop on this machine). Warmup emissions are not measured (3 for
shmask, so its ring, sized for two emissions, has been lapped once, as in a
long-running server); then 10 (support 20), 5 (1000; lists 3) or 2 (8192).
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zmq
from _common import (
    BATCH,
    EMIT_TOKENS,
    MODES,
    SEGMENT_PREFIX,
    TRANSPORTS,
    cpu_seconds,
    csr_to_lists,
    launch,
    lists_crc,
    make_pool,
    median_ms,
    now,
    print_table,
    read_result,
    ring_mb_for,
    rows_crc,
    thread_cpu,
    wait_children,
    write_result,
)

import shmask

SCRIPT = Path(__file__).resolve()
HEADER = struct.Struct("<qd")  # emission index (or MARK/STOP), scheduler's emission start time
MARK, STOP = -1, -2
POLL_TIMEOUT_MS = 600_000  # a stage waiting this long means a peer died; the parent kills all
LINGER_MS = 2_000


# --------------------------------------------------------------- transports

class Transport:
    """One transport's three roles. The scheduler calls append() every step
    and emit() every emission; the detokenizer forward(); the tokenizer
    hold(), build(), crc(), release()."""

    name = ""
    copy = True  # pyzmq copy flag for send and recv

    def __init__(self, spec: dict[str, Any]) -> None:
        self.batch = spec["batch"]
        self.tokens = spec["tokens"]
        self.width = spec["width"]
        self.support = spec["mode"] == "support"
        self.spec = spec

    def setup(self, role: str) -> None:
        """Role-specific state (staging, ring, reader)."""

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        raise NotImplementedError

    def emit(self, final: bool = False) -> list[Any]:
        raise NotImplementedError

    def forward(self, frames: list[Any]) -> list[Any]:
        raise NotImplementedError

    def hold(self, frames: list[Any]) -> Any:
        raise NotImplementedError

    def build(self, rows: Any) -> Any:
        raise NotImplementedError

    def crc(self, rows: Any) -> int:
        crc = 0
        for lengths, ids, logprobs in rows:
            crc = rows_crc(lengths, ids, logprobs, crc)
        return crc

    def release(self, rows: Any) -> None:
        """Give the held rows back (only shmask has something to do)."""

    def close(self) -> None:
        """Role-specific teardown."""

    def stats(self) -> dict[str, Any]:
        return {}


class Off(Transport):
    """Masks off (decode loop only): emissions carry no rows."""

    name = "off"

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        pass

    def emit(self, final: bool = False) -> list[Any]:
        return []

    def forward(self, frames: list[Any]) -> list[Any]:
        return frames

    def hold(self, frames: list[Any]) -> Any:
        return []

    def build(self, rows: Any) -> Any:
        return rows


class Floor(Off):
    """The floor of any design that copies the rows out of the engine's host
    buffer on the scheduler's thread (decode loop only): one numpy copy of
    the step's ids and logprobs into staging, nothing sent."""

    name = "floor"

    def setup(self, role: str) -> None:
        if role == "scheduler":
            per_row_logprobs = (self.width,) if self.support else ()
            self.ids = np.ones((self.tokens, self.batch, self.width), np.int32)
            self.logprobs = np.ones((self.tokens, self.batch, *per_row_logprobs), np.float32)
            self.rows = 0

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        np.copyto(self.ids[self.rows % self.tokens], ids)
        np.copyto(self.logprobs[self.rows % self.tokens], logprobs)
        self.rows += 1


class Lists(Transport):
    """Peer: nested Python lists, one list per row, pickled at every hop."""

    name = "lists"

    def setup(self, role: str) -> None:
        self._reset()

    def _reset(self) -> None:
        self.ids: list[list[list[int]]] = [[] for _ in range(self.batch)]
        self.logprobs: list[list[Any]] = [[] for _ in range(self.batch)]

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        for r in range(self.batch):
            n = int(lengths[r])
            self.ids[r].append(ids[r, :n].tolist())
            self.logprobs[r].append(logprobs[r, :n].tolist() if self.support else float(logprobs[r]))

    def emit(self, final: bool = False) -> list[Any]:
        payload = pickle.dumps(list(zip(self.ids, self.logprobs, strict=True)))
        self._reset()
        return [payload]

    def forward(self, frames: list[Any]) -> list[Any]:
        return [pickle.dumps(pickle.loads(frames[0]))]

    def hold(self, frames: list[Any]) -> Any:
        return pickle.loads(frames[0])

    def build(self, rows: Any) -> Any:
        return rows  # the rows arrived as the response lists

    def crc(self, rows: Any) -> int:
        crc = 0
        for ids_rows, logprobs_rows in rows:
            crc = lists_crc(ids_rows, logprobs_rows, crc)
        return crc


class Arrays(Transport):
    """Peer: one numpy chunk per request, filled row by row (a Python loop
    over the batch every step), pickled as bytes at every hop."""

    name = "arrays"

    def setup(self, role: str) -> None:
        if role == "scheduler":
            self._reset()

    def _reset(self) -> None:
        # Fresh buffers per emission: the previous ones may still be in flight (oob).
        per_row_logprobs = self.width if self.support else 1
        self.lengths = [np.empty(self.tokens, np.int32) for _ in range(self.batch)]
        self.ids = [np.empty(self.tokens * self.width, np.int32) for _ in range(self.batch)]
        self.logprobs = [np.empty(self.tokens * per_row_logprobs, np.float32)
                         for _ in range(self.batch)]
        self.rows = 0
        self.nnz = [0] * self.batch

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        row = self.rows
        for r in range(self.batch):
            n = int(lengths[r])
            start = self.nnz[r]
            self.lengths[r][row] = n
            self.ids[r][start:start + n] = ids[r, :n]
            if self.support:
                self.logprobs[r][start:start + n] = logprobs[r, :n]
            else:
                self.logprobs[r][row] = logprobs[r]
            self.nnz[r] = start + n
        self.rows = row + 1

    def _chunks(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        chunks = []
        for r in range(self.batch):
            n_logprobs = self.nnz[r] if self.support else self.rows
            chunks.append((self.lengths[r][:self.rows], self.ids[r][:self.nnz[r]],
                           self.logprobs[r][:n_logprobs]))
        return chunks

    def emit(self, final: bool = False) -> list[Any]:
        payload = pickle.dumps([tuple(a.tobytes() for a in chunk) for chunk in self._chunks()])
        self._reset()
        return [payload]

    def forward(self, frames: list[Any]) -> list[Any]:
        return [pickle.dumps(pickle.loads(frames[0]))]

    def hold(self, frames: list[Any]) -> Any:
        return [(np.frombuffer(lengths, np.int32), np.frombuffer(ids, np.int32),
                 np.frombuffer(logprobs, np.float32))
                for lengths, ids, logprobs in pickle.loads(frames[0])]

    def build(self, rows: Any) -> Any:
        return [csr_to_lists(lengths, ids, logprobs, self.support) for lengths, ids, logprobs in rows]


class Oob(Arrays):
    """Peer: the same per-request chunks, pickle protocol 5 with the array
    buffers out of band as zmq frames, sent and received with copy=False."""

    name = "oob"
    copy = False

    def emit(self, final: bool = False) -> list[Any]:
        buffers: list[Any] = []
        payload = pickle.dumps(self._chunks(), protocol=5, buffer_callback=buffers.append)
        self._reset()  # zmq keeps the old buffers alive until sent
        return [payload, *buffers]

    def forward(self, frames: list[Any]) -> list[Any]:
        buffers: list[Any] = []
        payload = pickle.dumps(self._load(frames), protocol=5, buffer_callback=buffers.append)
        return [payload, *buffers]

    def hold(self, frames: list[Any]) -> Any:
        return self._load(frames)

    @staticmethod
    def _load(frames: list[Any]) -> Any:
        return pickle.loads(frames[0].buffer, buffers=[frame.buffer for frame in frames[1:]])


class Shmask(Transport):
    """shmask: append_step into RowQueues staged in the ring, take_batch
    publishes them in place, one RefBatch frame crosses each hop."""

    name = "shmask"

    def config(self) -> shmask.Config:
        return shmask.Config(ring_mb=self.spec["ring_mb"], name_prefix=SEGMENT_PREFIX,
                             full_wait_ms=50, lease_s=600)

    def setup(self, role: str) -> None:
        if role == "scheduler":
            self.writer = shmask.Writer(self.config())
            mode = "support" if self.support else "selected"
            self.queues = [self.writer.open_queue(mode) for _ in range(self.batch)]
            self.slots = np.array([q.handle for q in self.queues], np.int64)
        elif role == "tokenizer":
            self.reader = shmask.Reader(self.config())

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        self.writer.append_step(self.slots, lengths, ids, logprobs)

    def emit(self, final: bool = False) -> list[Any]:
        return [self.writer.take_batch(self.queues, final).to_bytes()]

    def forward(self, frames: list[Any]) -> list[Any]:
        # Parse (validates the batch, as a routing detokenizer must) and pass on.
        return [shmask.RefBatch.from_bytes(frames[0]).to_bytes()]

    def hold(self, frames: list[Any]) -> Any:
        return [self.reader.open(ref) for ref in shmask.RefBatch.from_bytes(frames[0])]

    def build(self, rows: Any) -> Any:
        if self.spec.get("build") == "json":  # response bytes, no Python object per row
            return [chunk.to_json() for chunk in rows]
        return [chunk.to_lists() for chunk in rows]

    def crc(self, rows: Any) -> int:
        crc = 0
        for chunk in rows:
            crc = rows_crc(chunk.lengths, chunk.ids, chunk.logprobs, crc)
        return crc

    def release(self, rows: Any) -> None:
        for chunk in rows:
            chunk.release()

    def stats(self) -> dict[str, Any]:
        if not hasattr(self, "writer"):
            return {}
        stats = self.writer.stats
        return {"inline_chunks": stats.inline_chunks, "full_waits": stats.full_waits,
                "staging_moves": stats.staging_moves, "expired": stats.expired}

    def close(self) -> None:
        if hasattr(self, "writer"):
            self.writer.close()
        if hasattr(self, "reader"):
            self.reader.close()


class SglangReleased(Transport):
    """Peer: SGLang 0.5.23 as released. Its SamplingMaskRows per request,
    appended per step as its batch result processor does (one call per
    request), one SamplingMaskChunk per request taken per emission, the list
    sent through SGLang's real msgpack encoder/decoder (its default IPC;
    msgpack_utils.enc_hook/ext_hook carry every array as an ext), and the
    response built as its tokenizer manager does: to_lists, then orjson."""

    name = "sglang"

    def setup(self, role: str) -> None:
        import msgspec
        from sglang.srt.sampling.sampling_mask import SamplingMaskChunk, SamplingMaskRows
        from sglang.srt.utils import msgpack_utils

        self.encoder = msgspec.msgpack.Encoder(enc_hook=msgpack_utils.enc_hook)
        self.decoder = msgspec.msgpack.Decoder(list[SamplingMaskChunk | None],
                                               dec_hook=msgpack_utils.dec_hook,
                                               ext_hook=msgpack_utils.ext_hook)
        if role == "scheduler":
            self.rows = [SamplingMaskRows() for _ in range(self.batch)]

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        support = self.support
        for r, rows in enumerate(self.rows):
            n = int(lengths[r])
            rows.append(ids[r, :n], logprobs[r, :n] if support else logprobs[r:r + 1])

    def emit(self, final: bool = False) -> list[Any]:
        return [self.encoder.encode([rows.take() for rows in self.rows])]

    def forward(self, frames: list[Any]) -> list[Any]:
        return [self.encoder.encode(self.decoder.decode(frames[0]))]

    def hold(self, frames: list[Any]) -> Any:
        return self.decoder.decode(frames[0])

    def build(self, rows: Any) -> Any:
        return [_sglang_response(chunk.to_lists(support_logprobs=self.support)) for chunk in rows]

    def crc(self, rows: Any) -> int:
        crc = 0
        for chunk in rows:
            crc = rows_crc(chunk.lengths, chunk.token_ids, chunk.logprobs, crc)
        return crc


def _sglang_response(lists: tuple[list[Any], list[Any]]) -> bytes:
    masks, logprobs = lists
    return orjson.dumps({"output_token_sampling_mask": masks,
                         "output_token_sampling_logprobs": logprobs,
                         "output_token_sampling_mask_length": len(masks)})


class SglangShm(Transport):
    """shmask.adapters.sglang, as the patched SGLang runs it: the same
    per-request append calls (staged, then one Writer.append_step), one
    take_all per emission, the list of reference chunks through SGLang's
    real msgpack encoder/decoder, responses from response_meta_info."""

    name = "sglang-shm"
    per_request_append = True

    def setup(self, role: str) -> None:
        import msgspec
        from sglang.srt.utils import msgpack_utils

        from shmask.adapters import sglang as adapter

        self.adapter = adapter
        config = shmask.Config(ring_mb=self.spec["ring_mb"], name_prefix=SEGMENT_PREFIX,
                               full_wait_ms=50, lease_s=600)
        self.encoder = msgspec.msgpack.Encoder(enc_hook=msgpack_utils.enc_hook)
        self.decoder = msgspec.msgpack.Decoder(list[adapter.SamplingMaskChunk | None],
                                               dec_hook=msgpack_utils.dec_hook,
                                               ext_hook=msgpack_utils.ext_hook)
        if role == "scheduler":
            self.writer = shmask.Writer(config)
            adapter.configure(writer=self.writer)
            mode = "support" if self.support else "selected"
            self.rows = [adapter.SamplingMaskRows(mode, self.writer) for _ in range(self.batch)]
            self.handles = np.array([r.handle for r in self.rows], np.int64)
        elif role == "tokenizer":
            self.reader = shmask.Reader(config)
            adapter.configure(reader=self.reader)

    def append(self, lengths: np.ndarray, ids: np.ndarray, logprobs: np.ndarray) -> None:
        if self.per_request_append:
            support = self.support
            for r, rows in enumerate(self.rows):
                n = int(lengths[r])
                rows.append(ids[r, :n], logprobs[r, :n] if support else logprobs[r:r + 1])
        elif self.support:
            self.adapter.append_step(self.rows, lengths, ids, np.zeros(self.batch, np.float32),
                                     logprobs)
        else:
            self.adapter.append_step(self.rows, lengths, ids, logprobs)

    def emit(self, final: bool = False) -> list[Any]:
        return [self.encoder.encode(self.adapter.take_all(self.rows))]

    def forward(self, frames: list[Any]) -> list[Any]:
        return [self.encoder.encode(self.decoder.decode(frames[0]))]

    def hold(self, frames: list[Any]) -> Any:
        chunks = self.decoder.decode(frames[0])
        for chunk in chunks:
            chunk.open()  # the tokenizer holds the rows: numpy views of the ring
        return chunks

    def build(self, rows: Any) -> Any:
        responses = []
        for chunk in rows:
            accumulated = self.adapter.SamplingMaskJSON(self.support)
            accumulated.extend(chunk.open())  # the views; released after the checksum
            responses.append(orjson.dumps(self.adapter.response_meta_info(accumulated)))
        return responses

    def crc(self, rows: Any) -> int:
        crc = 0
        for chunk in rows:
            crc = rows_crc(chunk.lengths, chunk.token_ids, chunk.logprobs, crc)
        return crc

    def release(self, rows: Any) -> None:
        for chunk in rows:
            chunk.release()

    def stats(self) -> dict[str, Any]:
        if not hasattr(self, "writer"):
            return {}
        return {"inline_chunks": self.writer.stats.inline_chunks}

    def close(self) -> None:
        if hasattr(self, "rows"):
            for rows in self.rows:
                rows.close()
        for name in ("writer", "reader"):
            if hasattr(self, name):
                getattr(self, name).close()


class SglangShmStep(SglangShm):
    """The adapter with the vectorised per-step path (adapter.append_step on
    the step's [B, W] host arrays, one native call per step)."""

    name = "sglang-shm-step"
    per_request_append = False


TRANSPORT_CLASSES: dict[str, type[Transport]] = {
    cls.name: cls for cls in (Off, Floor, Lists, Arrays, Oob, Shmask, SglangReleased, SglangShm,
                              SglangShmStep)
}


def make_transport(spec: dict[str, Any], role: str) -> Transport:
    transport = TRANSPORT_CLASSES[spec["transport"]](spec)
    transport.setup(role)
    return transport


# ------------------------------------------------------------- zmq helpers

def socket(context: zmq.Context[Any], kind: int, endpoint: str, bind: bool) -> zmq.Socket[Any]:
    sock = context.socket(kind)
    sock.linger = LINGER_MS
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def wait_readable(sock: zmq.Socket[Any]) -> None:
    if not sock.poll(POLL_TIMEOUT_MS):
        raise TimeoutError("no message for 10 minutes: a peer process died")


def header_of(frame: Any) -> tuple[int, float]:
    index, started = HEADER.unpack(frame if isinstance(frame, bytes) else frame.bytes)
    return index, started


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(frame).nbytes for frame in frames)


def endpoints(directory: str) -> dict[str, str]:
    return {name: f"ipc://{directory}/{name}" for name in ("rows", "forwarded", "acks")}


def scheduler_sockets(spec: dict[str, Any]) -> tuple[zmq.Context[Any], zmq.Socket[Any],
                                                     zmq.Socket[Any]]:
    """The scheduler's end of the pipeline: (context, PUSH to the
    detokenizer, PULL of the tokenizer's acks)."""
    context: zmq.Context[Any] = zmq.Context()
    links = endpoints(spec["dir"])
    return (context, socket(context, zmq.PUSH, links["rows"], bind=True),
            socket(context, zmq.PULL, links["acks"], bind=True))


def round_trip(out: zmq.Socket[Any], acks: zmq.Socket[Any], index: int) -> None:
    """Send a control frame (MARK: every process up and connected, start the
    clocks; STOP) through the pipeline and wait for the tokenizer's ack."""
    out.send(HEADER.pack(index, now()))
    wait_readable(acks)
    acks.recv()


# ------------------------------------------------------------------- roles

def run_scheduler(spec: dict[str, Any]) -> None:
    """Decode steps from the pool into the transport's staging; one emission
    every `tokens` steps; wait for the tokenizer's ack before the next."""
    transport = make_transport(spec, "scheduler")
    pool = make_pool(spec["batch"], spec["width"], spec["mode"], seed=spec["seed"])
    context, out, acks = scheduler_sockets(spec)
    tokens, warmup = spec["tokens"], spec["warmup"]
    result: dict[str, Any] = {"append_s": [], "emit_s": [], "sent_bytes": [], "expected_crc": []}
    step = 0
    try:
        for emission in range(warmup + spec["measured"]):
            if emission == warmup:
                round_trip(out, acks, MARK)
                cpu_start = cpu_seconds()
            measured = emission >= warmup
            for _ in range(tokens):
                started = now()
                transport.append(*pool.step(step))
                if measured:
                    result["append_s"].append(now() - started)
                step += 1
            started = now()
            frames = transport.emit()
            out.send_multipart([HEADER.pack(emission, started), *frames], copy=transport.copy)
            emitted = now()
            wait_readable(acks)
            acks.recv()
            if measured:
                result["emit_s"].append(emitted - started)
                result["sent_bytes"].append(frame_bytes(frames))
            del frames
        round_trip(out, acks, STOP)
        result["cpu_s"] = cpu_seconds() - cpu_start
        result["stats"] = transport.stats()
        # The rows every emission carried, checksummed after the clock stopped.
        result["expected_crc"] = [pool.emission_crc(e * tokens, tokens) for e in range(step // tokens)]
    finally:
        transport.close()
        context.destroy(linger=LINGER_MS)
    write_result(spec["dir"], "scheduler", result)


def run_detokenizer(spec: dict[str, Any]) -> None:
    """Receive each emission and forward it re-encoded, as a detokenizer
    that does not look at the masks does."""
    transport = make_transport(spec, "detokenizer")
    context = zmq.Context()
    links = endpoints(spec["dir"])
    inbox = socket(context, zmq.PULL, links["rows"], bind=False)
    out = socket(context, zmq.PUSH, links["forwarded"], bind=True)
    result: dict[str, Any] = {"forward_s": [], "sent_bytes": []}
    cpu_start = 0.0
    try:
        while True:
            wait_readable(inbox)
            started = now()
            frames = inbox.recv_multipart(copy=transport.copy)
            index, _ = header_of(frames[0])
            if index < 0:
                if index == MARK:
                    cpu_start = cpu_seconds()
                else:
                    result["cpu_s"] = cpu_seconds() - cpu_start
                out.send(frames[0])
                if index == STOP:
                    break
                continue
            forwarded = transport.forward(frames[1:])
            out.send_multipart([frames[0], *forwarded], copy=transport.copy)
            if index >= spec["warmup"]:
                result["forward_s"].append(now() - started)
                result["sent_bytes"].append(frame_bytes(forwarded))
            del frames, forwarded
    finally:
        context.destroy(linger=LINGER_MS)
    write_result(spec["dir"], "detokenizer", result)


def run_tokenizer(spec: dict[str, Any]) -> None:
    """Hold each emission's rows, build the response lists, verify the rows
    against the scheduler's checksum (in the parent), give them back, ack."""
    transport = make_transport(spec, "tokenizer")
    context = zmq.Context()
    links = endpoints(spec["dir"])
    inbox = socket(context, zmq.PULL, links["forwarded"], bind=False)
    acks = socket(context, zmq.PUSH, links["acks"], bind=False)
    ack_every = spec.get("ack", True)  # the decode loop does not pace on acks
    result: dict[str, Any] = {"emitted_at": [], "received_at": [], "held_at": [], "built_at": [],
                              "release_s": [], "crc": []}
    cpu_start = harness_cpu = build_cpu = 0.0
    try:
        while True:
            wait_readable(inbox)
            received = now()
            frames = inbox.recv_multipart(copy=transport.copy)
            index, emitted = header_of(frames[0])
            if index < 0:
                if index == MARK:
                    cpu_start, harness_cpu, build_cpu = cpu_seconds(), 0.0, 0.0
                else:
                    result["cpu_s"] = cpu_seconds() - cpu_start - harness_cpu
                    result["build_cpu_s"] = build_cpu
                acks.send(frames[0])
                if index == STOP:
                    break
                continue
            rows = transport.hold(frames[1:])
            held = now()
            clock = thread_cpu()
            response = transport.build(rows)
            built = now()
            build_cpu += thread_cpu() - clock
            clock = thread_cpu()
            result["crc"].append(transport.crc(rows))
            harness_cpu += thread_cpu() - clock
            started = now()
            transport.release(rows)
            released = now()
            # Freeing the response lists is part of building them.
            clock = thread_cpu()
            del rows, response, frames
            build_cpu += thread_cpu() - clock
            for key, value in (("emitted_at", emitted), ("received_at", received), ("held_at", held),
                               ("built_at", built), ("release_s", released - started)):
                result[key].append(value)
            if ack_every:
                acks.send(HEADER.pack(index, emitted))
    finally:
        transport.close()
        context.destroy(linger=LINGER_MS)
    write_result(spec["dir"], "tokenizer", result)


ROLES = {"scheduler": run_scheduler, "detokenizer": run_detokenizer, "tokenizer": run_tokenizer}


# ------------------------------------------------------------------ parent

def run_pipeline(spec: dict[str, Any], scheduler_script: Path = SCRIPT,
                 timeout_s: float = 600.0) -> dict[str, dict[str, Any]]:
    """Start the three roles as OS processes, wait for them, return their
    results; the temporary directory (sockets, results) is removed."""
    directory = tempfile.mkdtemp(prefix="shmaskbench-")
    spec = {**spec, "dir": directory}
    try:
        children = [launch(SCRIPT, "tokenizer", spec), launch(SCRIPT, "detokenizer", spec),
                    launch(scheduler_script, "scheduler", spec)]
        wait_children(children, timeout_s)
        return {role: read_result(directory, role) for role in ("scheduler", "detokenizer", "tokenizer")}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def samples(spec: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One run's per-emission samples (measured emissions only) and totals."""
    scheduler, detok, tok = results["scheduler"], results["detokenizer"], results["tokenizer"]
    warmup = spec["warmup"]
    held = tok["held_at"][warmup:]
    mismatches = sum(a != b for a, b in zip(scheduler["expected_crc"], tok["crc"], strict=False))
    mismatches += abs(len(scheduler["expected_crc"]) - len(tok["crc"]))
    return {
        "append_s": scheduler["append_s"],
        "emit_s": scheduler["emit_s"],
        "forward_s": detok["forward_s"],
        "tokenizer_s": [h - r + rel for h, r, rel in zip(held, tok["received_at"][warmup:],
                                                        tok["release_s"][warmup:], strict=True)],
        "build_s": [b - h for b, h in zip(tok["built_at"][warmup:], held, strict=True)],
        "latency_s": [h - e for h, e in zip(held, tok["emitted_at"][warmup:], strict=True)],
        "sent_bytes": [a + b for a, b in zip(scheduler["sent_bytes"], detok["sent_bytes"], strict=True)],
        "cpu_s": [scheduler["cpu_s"] + detok["cpu_s"] + tok["cpu_s"]],
        "build_cpu_s": [tok["build_cpu_s"]],
        "measured": [spec["measured"]],
        "mismatches": [int(mismatches)],
        "inline_chunks": [scheduler["stats"].get("inline_chunks", 0)],
    }


def summarize(spec: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the emissions of every run of one workload and transport."""
    pooled = {key: [value for run in runs for value in run[key]] for key in runs[0]}
    emissions = sum(pooled["measured"])
    cpu, build_cpu = sum(pooled["cpu_s"]), sum(pooled["build_cpu_s"])
    return {
        "transport": spec["transport"], "mode": spec["mode"], "width": spec["width"],
        "append_ms": median_ms(pooled["append_s"]),
        "scheduler_ms": median_ms(pooled["emit_s"]),
        "detokenizer_ms": median_ms(pooled["forward_s"]),
        "tokenizer_ms": median_ms(pooled["tokenizer_s"]),
        "build_ms": median_ms(pooled["build_s"]),
        "latency_ms": median_ms(pooled["latency_s"]),
        "cpu_ms": 1000.0 * cpu / emissions,
        "cpu_no_build_ms": 1000.0 * (cpu - build_cpu) / emissions,
        "mb_sent": float(np.median(pooled["sent_bytes"])) / 1e6,
        "mismatches": sum(pooled["mismatches"]),
        "inline_chunks": sum(pooled["inline_chunks"]),
        "emissions": emissions,
        "runs": len(runs),
    }


def workloads(quick: bool) -> list[dict[str, Any]]:
    """The specs part 1 runs, in order (see the module docstring)."""
    if quick:
        batch, tokens, sizes = 64, 10, {20: (1, 3), 200: (1, 2)}
    else:
        batch, tokens, sizes = BATCH, EMIT_TOKENS, {20: (2, 10), 1000: (1, 5), 8192: (1, 2)}
    specs = []
    for width, (warmup, measured) in sizes.items():
        for mode in MODES:
            for name in TRANSPORTS:
                if name == "lists" and width > 1000:
                    continue
                spec = {"transport": name, "mode": mode, "batch": batch, "tokens": tokens,
                        "width": width, "warmup": warmup, "measured": measured, "seed": width,
                        "ring_mb": ring_mb_for(batch, tokens, width, copies=2)}
                if name == "lists" and width >= 1000:
                    spec["measured"] = 3  # ~6 s an emission: three are enough for a median
                if name == "shmask":
                    # Lap the ring once before measuring: a long-running server's ring
                    # pages are mapped already; first touches would be a one-off cost.
                    spec["warmup"] = max(warmup, 3)
                specs.append(spec)
    if not quick:
        # A second round of the cheap runs minutes later, so one noisy spell of the
        # machine cannot decide a ratio; lists is far enough off to need no second look.
        specs += [spec for spec in specs if spec["width"] <= 1000 and spec["transport"] != "lists"]
    return specs


COLUMNS = ("transport", "runs", "emissions", "append ms/step", "scheduler ms", "detok ms", "tokenizer ms",
           "build ms", "latency ms", "CPU ms", "CPU ms no build", "MB sent", "mismatches", "inline")


def print_results(rows: list[dict[str, Any]], batch: int, tokens: int) -> None:
    for width in sorted({r["width"] for r in rows}):
        for mode in MODES:
            selected = [r for r in rows if r["width"] == width and r["mode"] == mode]
            if not selected:
                continue
            print_table(
                f"Part 1 - {batch} requests x {tokens} tokens x support {width}, {mode} mode "
                "(median per emission; CPU = all three processes per emission)",
                COLUMNS,
                [(r["transport"], r["runs"], r["emissions"], r["append_ms"], r["scheduler_ms"],
                  r["detokenizer_ms"], r["tokenizer_ms"], r["build_ms"], r["latency_ms"], r["cpu_ms"],
                  r["cpu_no_build_ms"], r["mb_sent"], r["mismatches"], r["inline_chunks"]) for r in selected],
            )


def run(quick: bool = False) -> list[dict[str, Any]]:
    from _common import console

    console().print(__doc__)
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    specs = workloads(quick)
    for spec in specs:
        key = (spec["transport"], spec["mode"], spec["width"])
        runs.setdefault(key, []).append(samples(spec, run_pipeline(spec)))
        last = summarize(spec, runs[key][-1:])
        console().log(f"part 1: {spec['transport']:>6} {spec['mode']:>8} support {spec['width']:>5}: "
                      f"scheduler {last['scheduler_ms']:.2f} ms, detok {last['detokenizer_ms']:.2f} ms, "
                      f"tokenizer {last['tokenizer_ms']:.2f} ms, mismatches {last['mismatches']}")
    first_spec = {(s["transport"], s["mode"], s["width"]): s for s in reversed(specs)}
    rows = [summarize(first_spec[key], key_runs) for key, key_runs in runs.items()]
    print_results(rows, specs[0]["batch"], specs[0]["tokens"])
    return rows


SGLANG_TRANSPORTS = ("sglang", "sglang-shm", "sglang-shm-step", "shmask")  # shmask: reference


def run_sglang(batch: int = BATCH, tokens: int = EMIT_TOKENS, width: int = 1000,
               warmup: int = 2, measured: int = 3) -> list[dict[str, Any]]:
    """SGLang as released beside shmask's SGLang adapter (support mode), plus
    response bytes built both ways from the same rows. Needs sglang 0.5.23
    installed (make test-compat installs it)."""
    from _common import console

    rows = []
    for name in SGLANG_TRANSPORTS:
        spec = {"transport": name, "mode": "support", "batch": batch, "tokens": tokens,
                "width": width, "warmup": warmup + (1 if name != "sglang" else 0),  # lap the ring
                "measured": measured, "seed": width,
                "ring_mb": ring_mb_for(batch, tokens, width, copies=2)}
        summary = summarize(spec, [samples(spec, run_pipeline(spec))])
        summary["response_ms"] = summary["latency_ms"] + summary["build_ms"]
        rows.append(summary)
        console().log(f"sglang: {name}: scheduler {summary['scheduler_ms']:.2f} ms, "
                      f"detok {summary['detokenizer_ms']:.2f} ms, mismatches {summary['mismatches']}")
    print_table(
        f"SGLang as released vs shmask.adapters.sglang - {batch} requests x {tokens} tokens x "
        f"support {width}, support mode (median per emission)",
        ("transport", "emissions", "append ms/step", "scheduler ms", "detok ms", "tokenizer ms",
         "build ms", "latency ms", "to response bytes ms", "CPU ms", "MB sent", "mismatches"),
        [(r["transport"], r["emissions"], r["append_ms"], r["scheduler_ms"], r["detokenizer_ms"],
          r["tokenizer_ms"], r["build_ms"], r["latency_ms"], r["response_ms"], r["cpu_ms"],
          r["mb_sent"], r["mismatches"]) for r in rows])
    return rows


def response_speed(batch: int = BATCH, tokens: int = EMIT_TOKENS, width: int = 1000,
                   repeats: int = 3) -> dict[str, float]:
    """One emission's response bytes from the same rows (in one process):
    SGLang's chunk.to_lists + orjson of the meta_info fields, against
    response_meta_info (orjson Fragments built natively from the rows)."""
    from sglang.srt.sampling.sampling_mask import SamplingMaskChunk

    from shmask.adapters import sglang as adapter

    pool = make_pool(batch, width, "support", seed=width)
    times: dict[str, list[float]] = {"sglang to_lists + orjson": [], "response_meta_info": []}
    for mode in ("support", "selected"):
        support = mode == "support"
        with shmask.Writer(shmask.Config(ring_mb=ring_mb_for(batch, tokens, width, 2),
                                         name_prefix=SEGMENT_PREFIX)) as writer:
            queues = [writer.open_queue(mode) for _ in range(batch)]
            for step in range(tokens):
                lengths, ids, logprobs = pool.step(step)
                writer.append_step(queues, lengths, ids, logprobs if support else logprobs[:, 0])
            reader = shmask.Reader()
            chunks = [reader.open(ref) for ref in writer.take_batch(queues)]
            theirs = [SamplingMaskChunk(lengths=c.lengths.copy(), token_ids=c.ids.copy(),
                                        logprobs=c.logprobs.copy()) for c in chunks]
            for _ in range(repeats):
                started = now()
                expected = [_sglang_response(c.to_lists(support_logprobs=support)) for c in theirs]
                times["sglang to_lists + orjson"].append(now() - started)
                started = now()
                got = [orjson.dumps(adapter.response_meta_info([c], support_logprobs=support))
                       for c in chunks]
                times["response_meta_info"].append(now() - started)
                assert got == expected, "response bytes differ"
            for c in chunks:
                c.release()
            reader.close()
        result = {name: median_ms(values) for name, values in times.items()}
        print_table(f"Response bytes of one emission ({batch} x {tokens} x {width}, {mode} mode, "
                    "byte-identical, median of " f"{repeats})", ("path", "ms"),
                    [(k, v) for k, v in result.items()]
                    + [("speedup", result["sglang to_lists + orjson"]
                        / result["response_meta_info"])])
        times = {name: [] for name in times}
    return result


def streaming_speed(requests: int = 16, emissions: int = 10, tokens: int = EMIT_TOKENS,
                    width: int = 1000) -> dict[str, float]:
    """Cumulative streaming (SGLang's default for stream=True): every emission
    answers with the whole accumulation. SGLang extends its lists and orjson
    re-writes all of them each time; SamplingMaskJSON writes each emission's
    rows once and joins. Total over `emissions` emissions, support mode."""
    from sglang.srt.sampling.sampling_mask import SamplingMaskChunk

    from shmask.adapters import sglang as adapter

    pool = make_pool(requests, width, "support", seed=width)
    totals = {"sglang lists + orjson": 0.0, "SamplingMaskJSON + response_meta_info": 0.0}
    theirs_state = [([], []) for _ in range(requests)]
    ours_state = [adapter.SamplingMaskJSON(True) for _ in range(requests)]
    with shmask.Writer(shmask.Config(ring_mb=ring_mb_for(requests, tokens, width, 2),
                                     name_prefix=SEGMENT_PREFIX)) as writer:
        queues = [writer.open_queue("support") for _ in range(requests)]
        reader = shmask.Reader()
        for emission in range(emissions):
            for step in range(tokens):
                writer.append_step(queues, *pool.step(emission * tokens + step))
            chunks = [reader.open(ref) for ref in writer.take_batch(queues)]
            theirs = [SamplingMaskChunk(lengths=c.lengths.copy(), token_ids=c.ids.copy(),
                                        logprobs=c.logprobs.copy()) for c in chunks]
            started = now()
            expected = []
            for chunk, (masks, logprobs) in zip(theirs, theirs_state, strict=True):
                new_masks, new_logprobs = chunk.to_lists(support_logprobs=True)
                masks.extend(new_masks)
                logprobs.extend(new_logprobs)
                expected.append(_sglang_response((masks, logprobs)))
            totals["sglang lists + orjson"] += now() - started
            started = now()
            got = []
            for chunk, accumulated in zip(chunks, ours_state, strict=True):
                accumulated.extend(chunk)
                got.append(orjson.dumps(adapter.response_meta_info(accumulated)))
            totals["SamplingMaskJSON + response_meta_info"] += now() - started
            assert got == expected, "response bytes differ"
            for c in chunks:
                c.release()
        reader.close()
    result = {name: 1000.0 * value for name, value in totals.items()}
    print_table(f"Cumulative streaming responses: {requests} requests x {emissions} emissions x "
                f"{tokens} tokens x support {width} (byte-identical, total ms)", ("path", "ms"),
                [*result.items(), ("speedup", result["sglang lists + orjson"]
                                   / result["SamplingMaskJSON + response_meta_info"])])
    return result


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "child":
        ROLES[sys.argv[2]](json.loads(sys.argv[3]))
        return
    if "--sglang" in sys.argv:
        run_sglang()
        response_speed()
        streaming_speed()
        return
    run(quick="--quick" in sys.argv)


if __name__ == "__main__":
    main()
