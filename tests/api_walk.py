"""A walk of shmask's public API with values of the wrong type or range
(issue 33): one table of (public call, bad value), each of which must be
refused with a clear error (the exception a caller catches for it, its
message naming the argument or the value), never taken for another value:
a float index cast to an int, True taken for 1, a size of 1.5, a negative
id sent on to a client that refuses it.

One table, two runners: tests/test_api_types.py walks it in-process;
the fault case "wrong-type walk of the public API"
(tests/faults/cases_api.py) walks it in a child process (a crash there is
a finding, not the end of the run) and reports the figure.

Each probe gets a fresh context's objects only where its call could change
them (a queue, a batch); the rest share one Writer, Reader and open chunk.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

import shmask
from shmask import binary_rows, response_json
from shmask.binary_rows import BinaryRowsError, SamplingMaskBase64
from shmask.refs import MODE_SUPPORT


@dataclass(frozen=True)
class Probe:
    call: str  # the public call, as a caller writes it
    value: str  # the bad value, as written
    run: Callable[[Any], object]  # makes the call on a context
    errors: tuple[type[BaseException], ...]  # what a clear refusal raises
    says: str  # text its message must hold (the argument's name, the value, the rule)


@dataclass
class Outcome:
    probe: Probe
    verdict: str  # "refused" (as it must), "silent" (no error: taken), "unclear" (wrong error)
    detail: str = ""


class Context:
    """What the probes call into: a Writer and a Reader of their own prefix,
    a batch of four one-row refs, an open chunk [[3, 5], [7]] and rows to pass."""

    def __init__(self, prefix: str) -> None:
        self.config = shmask.Config(name_prefix=prefix, ring_mb=1)
        self.writer = shmask.Writer(self.config)
        self.reader = shmask.Reader(self.config)
        self.lengths = np.array([2, 1], np.int32)
        self.ids = np.array([3, 5, 7], np.int32)
        self.logprobs = np.array([-0.5, -1.0, -2.0], np.float32)
        self.chunk = self.reader.open(self.writer.publish(self.lengths, self.ids, self.logprobs))
        self.host = shmask.host_id()

    def queue(self) -> shmask.RowQueue:
        return self.writer.open_queue("support")

    def handles(self) -> np.ndarray:
        return np.array([self.queue().handle], np.int64)

    def batch(self) -> shmask.RefBatch:
        refs = [self.writer.publish(np.array([1], np.int32), np.array([i], np.int32),
                                    np.zeros(1, np.float32)) for i in range(4)]
        return shmask.RefBatch.from_refs(refs)

    def negative_chunk(self) -> shmask.Chunk:
        """Rows built in-process (never through a Writer), one id negative."""
        return shmask.Chunk(MODE_SUPPORT, self.lengths, np.array([3, -5, 7], np.int32),
                            self.logprobs, None)

    def close(self) -> None:
        self.chunk.release()
        self.writer.close()
        self.reader.close()


def _step(ctx: Context, **changes: Any) -> None:
    """append_step of one good row [1, 2] with `changes` to its arguments."""
    arguments: dict[str, Any] = {"queues": ctx.handles(), "lengths": np.array([2], np.int32),
                                 "ids": np.array([[1, 2]], np.int32),
                                 "logprobs": np.array([[-0.5, -1.0]], np.float32)}
    arguments.update(changes)
    ctx.writer.append_step(**arguments)


def _publish(ctx: Context, **changes: Any) -> None:
    arguments: dict[str, Any] = {"lengths": ctx.lengths, "ids": ctx.ids, "logprobs": ctx.logprobs}
    arguments.update(changes)
    ctx.writer.publish(**arguments)


_ROWS = (shmask.InvalidRowsError,)
_TYPE_OR_VALUE = (TypeError, ValueError)


def _config_probes() -> Iterator[Probe]:
    bad = {"ring_mb": [1.5, True, "64", None], "max_tokens": [100.5, True],
           "queue_rows": [2.5, False], "json_threads": [2.0, True],
           "offload_threads": [1.5, True], "lease_s": [True, "60", float("nan")],
           "full_wait_ms": ["50", False, float("inf")], "json_simd": [1, "off", None],
           "transport": [1, b"shm"], "name_prefix": [5, b"shm"], "gpu_direct": [True, 0],
           "log_level": [10, "debug"], "mask_format": [None, "LISTS"]}
    for field, values in bad.items():
        for value in values:
            yield Probe(f"Config({field}=...)", repr(value),
                        lambda ctx, f=field, v=value: shmask.Config(**{f: v}),
                        (shmask.ConfigError,), "SHMASK_" + field.upper())
    for raw in ("1.5", "1e3", "true"):
        yield Probe("Config.from_env(SHMASK_RING_MB=...)", repr(raw),
                    lambda ctx, r=raw: shmask.Config.from_env({"SHMASK_RING_MB": r}),
                    (shmask.ConfigError,), "SHMASK_RING_MB")
    for cls in ("Writer", "Reader"):
        for value in (5, "shm", {"ring_mb": 1}):
            yield Probe(f"{cls}(config=...)", repr(value),
                        lambda ctx, c=cls, v=value: getattr(shmask, c)(v), (TypeError,), "Config")


def _writer_probes() -> Iterator[Probe]:
    publish = {
        "lengths": [np.array([2.0, 1.0]), np.array([True, True]), [2, 1.5],
                    np.array([[2, 1]], np.int32)],
        "ids": [np.array([3.0, 5.0, 7.0]), np.array([True, True, True]),
                np.array([3, -5, 7], np.int32), np.array([3, 5, 2**31], np.int64),
                ["3", "5", "7"]],
        "logprobs": [np.array([True, False, True]), ["a", "b", "c"]],
        "mode": [True, 2.0, "supp", None],
    }
    for name, values in publish.items():
        for value in values:
            errors = (shmask.InvalidRefError,) if name == "mode" else _ROWS
            says = "negative" if name == "ids" and isinstance(value, np.ndarray) and \
                value.dtype == np.int32 else name
            yield Probe(f"Writer.publish({name}=...)", _show(value),
                        lambda ctx, n=name, v=value: _publish(ctx, **{n: v}), errors, says)
    for value in (True, 1.0, "both"):
        yield Probe("Writer.open_queue(mode=...)", repr(value),
                    lambda ctx, v=value: ctx.writer.open_queue(v), (shmask.InvalidRefError,),
                    "mode")
    step = {
        "queues": [np.array([1.0]), np.array([True]), np.zeros((1, 1), np.int64), [5], "q"],
        "lengths": [np.array([2.0]), np.array([True]), [1.5]],
        "ids": [np.array([[1.0, 2.0]]), np.array([[True, True]]),
                np.array([[1, -2]], np.int32)],
        "logprobs": [np.array([[True, False]])],
        "selected_logprobs": [np.array([True])],
        "status": [np.array([True]), np.array([0.0]), np.array([3]), np.array([0, 0])],
        "forms": [np.array([0.5]), np.array([2])],
        "vocab": [1.5, True, -1, "64"],
    }
    for name, values in step.items():
        for value in values:
            says = {"queues": "handle", "selected_logprobs": "selected_logprobs"}.get(name, name)
            if name == "ids" and value.dtype == np.int32:
                says = "negative"
            if name == "queues" and not isinstance(value, np.ndarray):
                says = "queues"
            yield Probe(f"Writer.append_step({name}=...)", _show(value),
                        lambda ctx, n=name, v=value: _step(ctx, **{n: v}), _ROWS, says)
    yield Probe("Writer.append_step(ids=..., flat CSR)", "np.array([1, -2], int32)",
                lambda ctx: _step(ctx, ids=np.array([1, -2], np.int32),
                                  logprobs=np.array([-0.5, -1.0], np.float32)), _ROWS, "negative")
    for value in (1, 0.0, "yes", None):
        yield Probe("Writer.take_batch(final=...)", repr(value),
                    lambda ctx, v=value: ctx.writer.take_batch(ctx.handles(), v), (TypeError,),
                    "final")
        yield Probe("RowQueue.take(final=...)", repr(value),
                    lambda ctx, v=value: ctx.queue().take(v), (TypeError,), "final")
    for value, says in ((np.array([1.5]), "ids"), ([True], "ids"), ([-3], "negative"),
                        (np.array([[1, 2]], np.int32), "1-D")):
        yield Probe("RowQueue.append(ids=...)", _show(value),
                    lambda ctx, v=value: ctx.queue().append(v, np.zeros(np.size(v), np.float32)),
                    _ROWS, says)


def _reader_probes() -> Iterator[Probe]:
    for value in (5, "ref", b"SMRB", None):
        yield Probe("Reader.open(...)", repr(value), lambda ctx, v=value: ctx.reader.open(v),
                    (shmask.InvalidRefError,), "ChunkRef")
        yield Probe("Reader.discard(...)", repr(value),
                    lambda ctx, v=value: ctx.reader.discard(v), (shmask.InvalidRefError,),
                    "ChunkRef")
    yield Probe("Reader.discard_batch(...)", "[5]", lambda ctx: ctx.reader.discard_batch([5]),
                (shmask.InvalidRefError,), "malformed")


def _refs_probes() -> Iterator[Probe]:
    select = [
        ([1.0, 2.0], TypeError, "1.0"), (np.array([1.5]), TypeError, "float64"),
        ([True, 2], TypeError, "True"), ([0, False], TypeError, "False"),
        (np.array([True, False]), ValueError, "mask"), ([True] * 5, ValueError, "mask"),
        (np.array([[0, 1]]), ValueError, "1-D"), ([4], IndexError, "4"),
        ([-5], IndexError, "-5"), (np.array([7], np.uint64), IndexError, "7"),
        ("01", TypeError, "str"), (3, TypeError, "int"), (None, TypeError, "NoneType"),
        ({0, 1}, TypeError, "set"),
    ]
    for value, error, says in select:
        yield Probe("RefBatch.select(...)", _show(value),
                    lambda ctx, v=value: ctx.batch().select(v), (error,), says)
    for value, error, says in ((1.0, TypeError, "1.0"), (True, TypeError, "True"),
                               (np.float32(0), TypeError, "0.0"), ("0", TypeError, "'0'"),
                               (4, IndexError, "4"), (-5, IndexError, "-5"),
                               (slice(0, 2), TypeError, "slice")):
        yield Probe("RefBatch[...]", _show(value), lambda ctx, v=value: ctx.batch()[v], (error,),
                    says)
    for value in (1.5, True, -1, "host", None, 2**64):
        yield Probe("RefBatch.for_host(host=...)", repr(value),
                    lambda ctx, v=value: ctx.batch().for_host(v, ctx.reader), _TYPE_OR_VALUE,
                    "host")
    for value in (None, "reader", 5):
        yield Probe("RefBatch.for_host(reader=...)", repr(value),
                    lambda ctx, v=value: ctx.batch().for_host(ctx.host, v), (TypeError,),
                    "Reader")
        yield Probe("RefBatch.to_inline(reader=...)", repr(value),
                    lambda ctx, v=value: ctx.batch().to_inline(v), (TypeError,), "Reader")
    for value in (5, "SMRB", None, [1, 2]):
        yield Probe("RefBatch.from_bytes(...)", repr(value),
                    lambda ctx, v=value: shmask.RefBatch.from_bytes(v), (TypeError,), "bytes")
        yield Probe("ChunkRef.from_bytes(...)", repr(value),
                    lambda ctx, v=value: shmask.ChunkRef.from_bytes(v), (TypeError,), "bytes")
    for code in (83.0, True, "83"):
        yield Probe("msgpack_ext_hook(code=...)", repr(code),
                    lambda ctx, c=code: shmask.msgpack_ext_hook(c, memoryview(b"")),
                    (shmask.InvalidRefError,), "code")
    yield Probe("msgpack_enc_hook(...)", "5", lambda ctx: shmask.msgpack_enc_hook(5),
                (NotImplementedError,), "int")


def _chunk_probes() -> Iterator[Probe]:
    for value, error, says in ((1.0, TypeError, "int"), (True, TypeError, "int"),
                               (np.float64(0), TypeError, "int"), ("0", TypeError, "int"),
                               (2, IndexError, "2"), (-3, IndexError, "-3")):
        yield Probe("Chunk.row(...)", _show(value), lambda ctx, v=value: ctx.chunk.row(v),
                    (error,), says)
    for start, stop, says in ((0.5, None, "start"), (True, None, "start"), ("0", None, "start"),
                              (0, 1.5, "stop"), (0, False, "stop"), (0, "1", "stop")):
        yield Probe("Chunk.slice(start, stop)", f"{start!r}, {stop!r}",
                    lambda ctx, a=start, b=stop: ctx.chunk.slice(a, b), (TypeError,), says)
        yield Probe("Chunk.check_rows(start, stop)", f"{start!r}, {stop!r}",
                    lambda ctx, a=start, b=stop: ctx.chunk.check_rows(a, b), (TypeError,), says)
    for threads in (0, 65, 1.5, True, "2"):
        yield Probe("Chunk.to_json(threads=...)", repr(threads),
                    lambda ctx, t=threads: ctx.chunk.to_json(threads=t), _TYPE_OR_VALUE,
                    "threads")
        yield Probe("Chunk.json_arrays(threads=...)", repr(threads),
                    lambda ctx, t=threads: ctx.chunk.json_arrays(threads=t), _TYPE_OR_VALUE,
                    "threads")
    for fields in ((1, 2, 3), ("a", "a", "b"), ("a", "b"), ("a", b"b", "c")):
        yield Probe("Chunk.to_json(fields=...)", repr(fields),
                    lambda ctx, f=fields: ctx.chunk.to_json(f), (ValueError,), "field")


def _responses_probes() -> Iterator[Probe]:
    # binary rows, server side
    for name, value in (("start", 1.5), ("start", True), ("start", -1), ("start", "0"),
                        ("length", 2.5), ("length", False), ("length", -2)):
        yield Probe(f"binary_rows.encode_meta_info({name}=...)", repr(value),
                    lambda ctx, n=name, v=value: binary_rows.encode_meta_info(ctx.chunk, **{n: v}),
                    (BinaryRowsError,), name)
    for value in (1.5, True, -1):
        yield Probe("binary_rows.encode_chunk(start=...)", repr(value),
                    lambda ctx, v=value: binary_rows.encode_chunk(ctx.chunk, v),
                    (BinaryRowsError,), "start")
        yield Probe("binary_rows.encode_meta_info_many(starts=...)", f"[{value!r}]",
                    lambda ctx, v=value: binary_rows.encode_meta_info_many([ctx.chunk], [v]),
                    (BinaryRowsError,), "start")
        yield Probe("binary_rows.encode_meta_info_many(lengths=...)", f"[{value!r}]",
                    lambda ctx, v=value: binary_rows.encode_meta_info_many([ctx.chunk],
                                                                            lengths=[v]),
                    (BinaryRowsError,), "length")
    for threads in (0, 65, 2.0, True):
        for call, run in (
                ("binary_rows.encode_meta_info", lambda ctx, t: binary_rows.encode_meta_info(
                    ctx.chunk, threads=t)),
                ("binary_rows.encode_chunk", lambda ctx, t: binary_rows.encode_chunk(
                    ctx.chunk, threads=t)),
                ("binary_rows.encode_meta_info_many", lambda ctx, t:
                    binary_rows.encode_meta_info_many([ctx.chunk], threads=t)),
                ("response_json.dumps", lambda ctx, t: response_json.dumps({}, threads=t)),
                ("response_json.dumps_many", lambda ctx, t: response_json.dumps_many(
                    [{}], threads=t)),
                ("response_json.response_arrays", lambda ctx, t: response_json.response_arrays(
                    True, ctx.lengths, None, ctx.ids, ctx.logprobs, threads=t))):
            yield Probe(f"{call}(threads=...)", repr(threads),
                        lambda ctx, r=run, t=threads: r(ctx, t), _TYPE_OR_VALUE, "threads")
    # rows handed over in-process, one id negative: every encoder refuses them
    yield Probe("binary_rows.encode_meta_info(chunk)", "a chunk with id -5",
                lambda ctx: binary_rows.encode_meta_info(ctx.negative_chunk()),
                (BinaryRowsError,), "negative")
    yield Probe("binary_rows.encode_chunk(chunk)", "a chunk with id -5",
                lambda ctx: binary_rows.encode_chunk(ctx.negative_chunk()),
                (BinaryRowsError,), "negative")
    yield Probe("binary_rows.encode_meta_info_many(chunks)", "[a chunk with id -5]",
                lambda ctx: binary_rows.encode_meta_info_many([ctx.negative_chunk()]),
                (BinaryRowsError,), "negative")
    yield Probe("SamplingMaskBase64.extend(chunk)", "a chunk with id -5",
                lambda ctx: SamplingMaskBase64(True).extend(ctx.negative_chunk()),
                (BinaryRowsError,), "negative")
    yield Probe("Chunk.to_json()", "a chunk with id -5",
                lambda ctx: ctx.negative_chunk().to_json(), _ROWS, "negative")
    yield Probe("response_json.dumps(RowsJSON)", "ids with -5",
                lambda ctx: response_json.dumps({"ids": ctx.negative_chunk().json_rows().ids}),
                _ROWS, "negative")
    yield Probe("response_json.response_arrays(ids=...)", "ids with -5",
                lambda ctx: response_json.response_arrays(
                    True, ctx.lengths, None, np.array([3, -5, 7], np.int32), ctx.logprobs),
                _ROWS, "negative")
    for value, says in (([3, 5, 7], "list"), (np.array([3, 5, 7]), "int64"),
                        (np.array([[3, 5, 7]], np.int32), "1-D")):
        yield Probe("response_json.response_arrays(ids=...)", _show(value),
                    lambda ctx, v=value: response_json.response_arrays(
                        True, ctx.lengths, None, v, ctx.logprobs), _ROWS, says)
    for value in (1, "yes", None):
        yield Probe("response_json.response_arrays(support=...)", repr(value),
                    lambda ctx, v=value: response_json.response_arrays(
                        v, ctx.lengths, None, ctx.ids, ctx.logprobs), (TypeError,), "support")
        yield Probe("response_json.RowsJSON(support=...)", repr(value),
                    lambda ctx, v=value: response_json.RowsJSON(
                        v, ctx.lengths, None, ctx.ids, ctx.logprobs), (TypeError,), "support")
        yield Probe("SamplingMaskBase64(support_logprobs=...)", repr(value),
                    lambda ctx, v=value: SamplingMaskBase64(v), (TypeError,), "support_logprobs")
    for value in ([0.5, 1.0], np.zeros((2, 2), np.float32)):
        yield Probe("response_json.float_json(...)", _show(value),
                    lambda ctx, v=value: response_json.float_json(v), _ROWS, "1-D numpy array")
    for value in (1, "on"):
        yield Probe("response_json.avx512(enable=...)", repr(value),
                    lambda ctx, v=value: response_json.avx512(v), (TypeError,), "enable")
    for value in (1.5, True):
        yield Probe("SamplingMaskBase64.to_bytes(start=...)", repr(value),
                    lambda ctx, v=value: SamplingMaskBase64(True).to_bytes(v),
                    (BinaryRowsError,), "start")
    # binary rows, client side
    good = orjson.loads(binary_rows.encode_chunk(_plain_chunk()))
    for key, value in (("version", 1.0), ("version", True), ("rows", 2.0), ("nnz", True),
                       ("start", 0.0), ("mode", 2)):
        forged = {**good, key: value}
        yield Probe(f"binary_rows.decode_rows({{{key!r}: ...}})", repr(value),
                    lambda ctx, f=forged: binary_rows.decode_rows(f), (BinaryRowsError,), key)
    for value in (1, "yes"):
        yield Probe("binary_rows.decode_rows(torch=...)", repr(value),
                    lambda ctx, v=value: binary_rows.decode_rows(good, torch=v), (TypeError,),
                    "torch")
        yield Probe("binary_rows.loads(torch=...)", repr(value),
                    lambda ctx, v=value: binary_rows.loads(b"{}", torch=v), (TypeError,), "torch")
    for value, says in (("\ud800", "surrogates"), ('{"a": "\udcff"}', "surrogates"),
                        (5, "Input must be"), (None, "Input must be")):
        yield Probe("binary_rows.loads(...)", repr(value),
                    lambda ctx, v=value: binary_rows.loads(v), (orjson.JSONDecodeError,), says)
    for value in (5, None, [1]):
        yield Probe("binary_rows.decode_rows(...)", repr(value),
                    lambda ctx, v=value: binary_rows.decode_rows(v), (BinaryRowsError,),
                    "JSON object")


def _plain_chunk() -> shmask.Chunk:
    return shmask.Chunk(MODE_SUPPORT, np.array([2], np.int32), np.array([3, 5], np.int32),
                        np.array([-0.5, -1.0], np.float32), None)


def _show(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"np.array({value.tolist()!r}, {value.dtype})"
    return repr(value)


def probes() -> list[Probe]:
    """The table: every (public call, bad value) pair."""
    return [*_config_probes(), *_writer_probes(), *_reader_probes(), *_refs_probes(),
            *_chunk_probes(), *_responses_probes()]


def run_probe(ctx: Context, probe: Probe) -> Outcome:
    try:
        probe.run(ctx)
    except probe.errors as exc:
        if probe.says.lower() not in str(exc).lower():
            return Outcome(probe, "unclear", f"{type(exc).__name__} without {probe.says!r}: {exc}")
        return Outcome(probe, "refused")
    except Exception as exc:  # noqa: BLE001 - a wrong kind of error is the finding
        return Outcome(probe, "unclear", f"{type(exc).__name__}: {exc}")
    return Outcome(probe, "silent", "no error: the value was taken")


@contextmanager
def context(prefix: str) -> Iterator[Context]:
    ctx = Context(prefix)
    try:
        yield ctx
    finally:
        ctx.close()


def walk(prefix: str) -> list[Outcome]:
    """Every probe of the table, on one context of segment prefix `prefix`."""
    with context(prefix) as ctx:
        return [run_probe(ctx, probe) for probe in probes()]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts for a report: probes, public calls, and each verdict's probes."""
    def listed(verdict: str) -> list[str]:
        return [f"{o.probe.call} <- {o.probe.value}: {o.detail}" for o in outcomes
                if o.verdict == verdict]
    return {"probes": len(outcomes), "calls": len({o.probe.call for o in outcomes}),
            "refused": sum(o.verdict == "refused" for o in outcomes),
            "silent": listed("silent"), "unclear": listed("unclear")}


if __name__ == "__main__":  # the fault case's child: the summary as one JSON line
    import sys

    print(json.dumps(summary(walk(sys.argv[1]))), flush=True)
