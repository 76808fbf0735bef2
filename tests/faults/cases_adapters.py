"""Fault cases of the SGLang and vLLM adapters (issue 17, items 4 and 5):
one reference that cannot be read costs its own request, never another
request's rows, the message, or the process.

The consumer side runs in a child process (``python cases_adapters.py
<role>``, spoken to by JSON lines), through the adapters' own consumer
paths: ``shmask.adapters.sglang.lists_or_abort`` (what the patched SGLang
``TokenizerManager._handle_batch_output`` calls per request) on chunks
decoded from their msgpack bytes, and ``MaskResolver.resolve_outputs``
(what the patched vLLM ``OutputProcessor.process_outputs`` calls per
message) on ``SamplingMaskLists`` references. Rows are fault_lib's seeded
rows: ids carry request and step, so another request's rows are caught by
value.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
from fault_cases import Result, case
from fault_lib import (
    MODE_SELECTED,
    MODE_SUPPORT,
    REPO,
    Child,
    check_rows,
    child_env,
    csr_ids,
    describe_rc,
    logprobs_for,
    row_bases,
    row_lengths,
)

import shmask
from shmask.adapters import sglang as sglang_adapter
from shmask.adapters import vllm as vllm_adapter
from shmask.refs import ENTRY_DTYPE

MODE_NAMES = {MODE_SELECTED: "selected", MODE_SUPPORT: "support"}


def _xor(mask: int):  # type: ignore[no-untyped-def]
    return lambda b: b ^ mask


# Single-byte garbles at every position of an encoded reference.
GARBLES_SHORT = {"xor 0x01": _xor(0x01), "xor 0x80": _xor(0x80), "xor 0xff": _xor(0xFF),
                 "set 0x00": lambda b: 0}
GARBLES_FULL = {**GARBLES_SHORT, **{f"xor 0x{1 << k:02x}": _xor(1 << k) for k in range(1, 7)}}
SWAP_LENGTH = 8  # rows of one shape, so a swapped position is a valid-looking ref
TRIALS_PER_LINE = 64


# ------------------------------------------------------------------ rows

def row_length(seed: int, request: int, seq: int) -> int:
    return int(row_lengths(seed, request, [seq], 15)[0]) + 1  # 1..16 ids


def expected_rows(request: int, mode: int, seq: int, length: int):
    """(lengths, ids, logprobs) of one seeded row."""
    bases = row_bases([request], [seq])
    lengths = np.array([length], np.int32)
    ids = csr_ids(bases, lengths)
    return lengths, ids, logprobs_for(mode, ids, bases)


# ---------------------------------------------------------------- producer

class Producer:
    """Live requests on one Writer, each emission a fresh record per request,
    encoded as its adapter sends it."""

    def __init__(self, adapter: str, writer: shmask.Writer, requests: int, seed: int,
                 swap: bool, carrier: str = "msgpack") -> None:
        self.adapter, self.writer, self.seed, self.swap = adapter, writer, seed, swap
        self.carrier = carrier  # SGLang's IPC: "msgpack", or "pickle" (its default)
        self.modes = [MODE_SUPPORT if swap or r % 3 else MODE_SELECTED for r in range(requests)]
        self.seq = 0
        if adapter == "sglang":
            self.rows = [sglang_adapter.SamplingMaskRows(MODE_NAMES[m], writer=writer)
                         for m in self.modes]
        else:
            self.publisher = vllm_adapter.MaskPublisher(writer, mask_lists=vllm_adapter._MaskLists)

    def emission(self) -> tuple[list[bytes], list[list[int]], list[bytes]]:
        """(encoded references, [request, mode, seq, length] each, ref bytes each)."""
        seq, self.seq = self.seq, self.seq + 1
        items = []
        for request, mode in enumerate(self.modes):
            length = SWAP_LENGTH if self.swap else row_length(self.seed, request, seq)
            items.append([request, mode, seq, length])
        if self.adapter == "sglang":
            for (request, mode, _, length), rows in zip(items, self.rows, strict=True):
                _, ids, logprobs = expected_rows(request, mode, seq, length)
                rows.append(ids, logprobs)
            chunks = sglang_adapter.take_all(self.rows, writer=self.writer)
            refs = [c.ref for c in chunks]  # type: ignore[union-attr]
            if self.carrier == "pickle":
                return [pickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL) for c in chunks], \
                    items, refs
            return [msgspec.msgpack.encode(c) for c in chunks], items, refs
        rows = [expected_rows(request, mode, seq, length)[1] for request, mode, seq, length in items]
        offsets = np.cumsum([0] + [r.size for r in rows])
        step = self.publisher.publish_step(vllm_adapter._MaskLists(
            np.concatenate(rows).astype(np.int32), offsets, None))
        refs = [step.slice_request(i, 1).token_ids.tobytes() for i in range(len(items))]
        return list(refs), items, refs

    def close(self) -> None:
        if self.adapter == "sglang":
            for rows in self.rows:
                rows.close()
        else:
            self.publisher.close()


def entry_offset(encoded: bytes, ref: bytes, field: str) -> int:
    """Where `field` of the reference's entry lies in its encoded form (a
    msgpack bin inside the chunk's array, or vLLM's raw uint8 array)."""
    start = encoded.find(ref)
    assert start >= 0, "the encoding must hold the reference's bytes"
    return start + len(ref) - ENTRY_DTYPE.itemsize + ENTRY_DTYPE.fields[field][1]


# ---------------------------------------------------------------- consumer

_ERROR_TYPE = re.compile(r"\((\w+):")


def _classify_lists(masks: list, values: list, item: list[int]) -> str:
    request, mode, seq, length = item
    if any(m is None for m in masks):
        return "wrong:a dropped row"
    lengths = np.array([len(m) for m in masks], np.int32)
    ids = np.array([i for m in masks for i in m], np.int32)
    flat = [v for row in values for v in row] if mode == MODE_SUPPORT else values
    got = check_rows(lengths, ids, np.array(flat, np.float32), expected_rows(*item))
    return "ok" if not got else ("other" if got.startswith("other") else f"wrong:{got}")


def consume_sglang(message: list[tuple[bytes, list[int]]], carrier: str) -> list[str]:
    """One batch output through lists_or_abort, request by request, as the
    patched _handle_batch_output reads it. Each chunk is decoded on its own:
    bytes its carrier (SGLang's msgpack or pickle) refuses are the carrier's
    failure, not shmask's (counted apart)."""
    decoder = msgspec.msgpack.Decoder(sglang_adapter.SamplingMaskChunk)
    outcomes: list[str] = [""] * len(message)
    present, chunks = [], []
    for i, (encoded, _) in enumerate(message):
        try:
            chunk = decoder.decode(encoded) if carrier == "msgpack" else pickle.loads(encoded)
            if not isinstance(chunk, sglang_adapter.SamplingMaskChunk):
                raise TypeError(f"unpickled a {type(chunk).__name__}")
            chunks.append(chunk)
            present.append(i)
        except Exception as exc:  # noqa: BLE001 - the carrier refused the bytes
            outcomes[i] = f"refused:{type(exc).__name__}"
    aborted: list[str] = []
    manager = SimpleNamespace(abort_request=aborted.append)
    recv = SimpleNamespace(rids=[f"r{i}" for i in present], finished_reasons=[None] * len(present),
                           output_token_sampling_mask=chunks)
    for k, i in enumerate(present):
        item = message[i][1]
        meta: dict[str, Any] = {"finish_reason": None}
        try:
            masks, values = sglang_adapter.lists_or_abort(manager, recv, k, meta,
                                                          support_logprobs=item[1] == MODE_SUPPORT)
        except Exception as exc:  # noqa: BLE001 - this is what would kill the server
            return [f"whole:{type(exc).__name__}: {str(exc)[:100]}"] * len(message)
        reason = recv.finished_reasons[k]
        if reason is not None:
            clean = (reason.get("type") == "abort" and reason.get("status_code") == 500
                     and meta["finish_reason"] is reason and f"r{i}" in aborted)
            found = _ERROR_TYPE.search(reason.get("message", ""))
            outcomes[i] = (f"error:{found.group(1) if found else '?'}" if clean
                           else f"wrong:unclear failure {reason}")
        else:
            outcomes[i] = _classify_lists(masks, values, item)
    return outcomes


def consume_vllm(message: list[tuple[bytes, list[int]]], resolver: Any) -> list[str]:
    """One EngineCoreOutputs message's references through resolve_outputs.
    Every other request says it keeps its one position, as a request
    trimmed by speculative decoding says how many it keeps, so forged
    entries also meet the step copy's kept-position path."""
    outputs = [SimpleNamespace(request_id=f"r{i}", finish_reason=None, error=None,
                               new_sampling_mask=vllm_adapter._MaskLists(
                                   np.frombuffer(ref, np.uint8), None, [0, 1] if i % 2 else None))
               for i, (ref, _) in enumerate(message)]
    try:
        failed = resolver.resolve_outputs(outputs) or []
    except Exception as exc:  # noqa: BLE001 - this is what would fail every request
        return [f"whole:{type(exc).__name__}: {str(exc)[:100]}"] * len(message)
    outcomes = []
    for output, (_, item) in zip(outputs, message, strict=True):
        mask = output.new_sampling_mask
        if mask is None:
            clean = (output.finish_reason == 3 and output.error is not None
                     and output.request_id in failed)
            found = _ERROR_TYPE.search(getattr(output.error, "message", ""))
            outcomes.append(f"error:{found.group(1) if found else '?'}" if clean
                            else "wrong:unclear failure")
            continue
        lengths, ids, _ = expected_rows(*item)
        got = check_rows(np.array([mask.token_ids.size], np.int32), mask.token_ids,
                         np.zeros(0, np.float32), (lengths, ids, np.zeros(0, np.float32)))
        outcomes.append("ok" if not got else ("other" if got.startswith("other")
                                              else f"wrong:{got}"))
    return outcomes


def consumer_main(adapter: str, carrier: str) -> None:
    """Child: one JSON line of messages in, one JSON line of outcomes out."""
    logging.getLogger("shmask").setLevel(logging.CRITICAL)  # the failures are counted, not logged
    reader = shmask.Reader()
    sglang_adapter.configure(reader=reader)
    resolver = vllm_adapter.MaskResolver(reader, mask_lists=vllm_adapter._MaskLists)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("hold"):  # keep these messages, read them when told
            held = request["messages"]
            print("held", flush=True)
            continue
        messages = held if request.get("read_held") else request["messages"]
        results = []
        for message in messages:
            decoded = [(bytes.fromhex(h), item) for h, item in message]
            results.append(consume_sglang(decoded, carrier) if adapter == "sglang"
                           else consume_vllm(decoded, resolver))
        print("outcomes", json.dumps(results), flush=True)


# ------------------------------------------------------------------ cases

class ConsumerChild(Child):
    """This module run as a child (own session, bounded waits via Child)."""

    def __init__(self, adapter: str, prefix: str, carrier: str = "msgpack") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "consumer", adapter, carrier],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=child_env(prefix), cwd=str(REPO), start_new_session=True)
        self.pid = self.proc.pid
        self._buffer = b""
        self._eof = False
        self._stderr = None

    def ask(self, request: dict, timeout: float = 120) -> list[list[str]] | None:
        """Outcomes per message, or None if the child died or hung."""
        if not self.send(json.dumps(request)):
            return None
        line = self.readline(timeout)
        if line is None or not line.startswith("outcomes "):
            return None
        return json.loads(line[len("outcomes "):])


def _garbled_trials(producer: Producer, garbles: dict) -> list[tuple[str, int, list]]:
    """(label, garbled index, message) per trial: every byte of the encoded
    reference of one request (rotating) under every garble, each in a
    fresh emission."""
    trials = []
    encoded, _, _ = producer.emission()  # the encoded length of one reference
    size = len(encoded[0])
    requests = len(producer.modes)
    for position in range(size):
        for name, garble in garbles.items():
            refs, items, _ = producer.emission()
            victim = (position + len(trials)) % requests
            data = bytearray(refs[victim])
            new = garble(data[position])
            if new == data[position]:
                continue
            data[position] = new
            refs[victim] = bytes(data)
            trials.append((f"{name} @ {position}/{size}", victim,
                           [[r.hex(), item] for r, item in zip(refs, items, strict=True)]))
    return trials


def _swap_trials(producer: Producer) -> list[tuple[str, int, list]]:
    """Request i's reference pointed at request j's live record (j's
    position written into i's entry; j's own ref intact), rows of one shape:
    a valid-looking ref that names another request's record."""
    trials = []
    requests = len(producer.modes)
    for i in range(requests):
        j = (i + 1) % requests
        refs, items, raw = producer.emission()
        at_i = entry_offset(refs[i], raw[i], "position")
        at_j = entry_offset(refs[j], raw[j], "position")
        width = ENTRY_DTYPE.fields["position"][0].itemsize
        a = bytearray(refs[i])
        a[at_i:at_i + width] = refs[j][at_j:at_j + width]
        refs[i] = bytes(a)
        trials.append((f"ref {i} -> record {j}", i,
                       [[r.hex(), item] for r, item in zip(refs, items, strict=True)]))
    return trials


def _run_trials(result: Result, child: ConsumerChild, trials: list, label: str,
                tally: dict) -> bool:
    """Send the trials in lines; count outcomes; False when the child died."""
    for start in range(0, len(trials), TRIALS_PER_LINE):
        part = trials[start:start + TRIALS_PER_LINE]
        outcomes = child.ask({"messages": [t[2] for t in part]})
        if outcomes is None:
            rc = child.wait(5)
            tally["deaths"] += 1
            result.problems.append(f"{label}: the consumer process died or hung at "
                                   f"{part[0][0]} ({describe_rc(rc)}): {child.stderr_tail(600)}")
            return False
        for (name, victim, _), got in zip(part, outcomes, strict=True):
            tally["trials"] += 1
            mine = got[victim]
            others = [g for k, g in enumerate(got) if k != victim]
            if mine.startswith("whole"):
                tally["whole_message"] += 1
                if len(tally["examples"]) < 6:
                    tally["examples"].append(f"{name}: {mine}")
                continue
            kind = mine.split(":")[0]
            if kind == "error":
                tally["clean_errors"][mine[6:]] = tally["clean_errors"].get(mine[6:], 0) + 1
            elif kind == "refused":
                tally["carrier_refused"] += 1
            elif kind == "ok":
                tally["unaffected"] += 1
            else:
                tally[kind if kind in ("other",) else "wrong"] += 1
                if len(tally["examples"]) < 6:
                    tally["examples"].append(f"{name}: {mine}")
            collateral = [g for g in others if g != "ok"]
            if collateral:
                tally["collateral"] += 1
                tally["other"] += sum(g == "other" for g in collateral)
                if len(tally["examples"]) < 6:
                    tally["examples"].append(f"{name}: another request got {collateral[0]}")
    return True


def _new_tally() -> dict:
    return {"trials": 0, "other": 0, "wrong": 0, "whole_message": 0, "deaths": 0,
            "collateral": 0, "unaffected": 0, "carrier_refused": 0, "clean_errors": {},
            "examples": []}


@case("garbled refs through both adapters")
def garbled_refs_through_adapters(result: Result, prefix: str, full: bool) -> None:
    requests = 8 if full else 4
    garbles = GARBLES_FULL if full else GARBLES_SHORT
    config = shmask.Config(ring_mb=16, name_prefix=prefix, lease_s=600, full_wait_ms=20)
    figures = []
    for adapter, carrier in (("sglang", "msgpack"), ("sglang", "pickle"), ("vllm", "msgpack")):
        for sub, swap in (("garbles", False), ("swapped positions", True)):
            label = f"{adapter} ({carrier}) {sub}"
            tally = _new_tally()
            with shmask.Writer(config) as writer:
                producer = Producer(adapter, writer, requests, seed=31, swap=swap,
                                    carrier=carrier)
                child = ConsumerChild(adapter, prefix, carrier)
                try:
                    child.expect("ready", 60)
                    trials = _swap_trials(producer) if swap else _garbled_trials(producer, garbles)
                    _run_trials(result, child, trials, label, tally)
                finally:
                    child.kill()
                    producer.close()
            result.metrics[label] = tally
            result.check(tally["other"] == 0, f"{label}: {tally['other']} reads returned another "
                         f"request's rows: {tally['examples'][:3]}")
            result.check(tally["wrong"] == 0, f"{label}: {tally['wrong']} reads returned wrong "
                         f"rows or failed unclearly: {tally['examples'][:3]}")
            result.check(tally["whole_message"] == 0, f"{label}: {tally['whole_message']} "
                         f"garbles failed the whole message: {tally['examples'][:3]}")
            result.check(tally["collateral"] == 0, f"{label}: {tally['collateral']} garbles "
                         f"cost another request of the message its rows")
            result.check(tally["deaths"] == 0, f"{label}: the consumer process died")
            figures.append(f"{label}: {tally['trials']} trials, {tally['other']} other-request "
                           f"rows, {tally['whole_message']} whole-message failures, "
                           f"{tally['deaths']} deaths, "
                           f"{sum(tally['clean_errors'].values())} clean per-request errors")
    result.happened = "; ".join(figures)
    result.figure = (f"{sum(m['trials'] for m in result.metrics.values())} garbled messages: "
                     f"{sum(m['other'] for m in result.metrics.values())} other-request rows, "
                     f"{sum(m['whole_message'] for m in result.metrics.values())} whole-message "
                     f"failures, {sum(m['deaths'] for m in result.metrics.values())} deaths")


@case("tokenizer falls behind its lease (SGLang adapter)")
def tokenizer_behind_lease(result: Result, prefix: str, full: bool) -> None:
    rounds, requests, lease = (12, 32, 0.5) if full else (3, 6, 0.3)
    config = shmask.Config(ring_mb=1, name_prefix=prefix, lease_s=lease, full_wait_ms=20)
    late_failed: dict[str, int] = {}
    ontime = ontime_exact = late = other = wrong = 0
    with shmask.Writer(config) as writer:
        producer = Producer("sglang", writer, requests, seed=41, swap=False)
        child = ConsumerChild("sglang", prefix)
        try:
            child.expect("ready", 60)
            for _ in range(rounds):
                # The tokenizer takes this message and falls behind on it...
                refs, items, _ = producer.emission()
                held = [[[r.hex(), item] for r, item in zip(refs, items, strict=True)]]
                child.send(json.dumps({"hold": True, "messages": held}))
                result.check(child.expect("held", 60) == "", "the tokenizer did not hold")
                # ... while it keeps reading the messages that follow on time,
                # and the producer's ring reclaims and reuses the late space.
                deadline = time.monotonic() + lease * 2
                while time.monotonic() < deadline:
                    refs, items, _ = producer.emission()
                    got = child.ask({"messages": [[[r.hex(), item] for r, item in
                                                   zip(refs, items, strict=True)]]})
                    if got is None:
                        raise RuntimeError(f"the tokenizer died ({describe_rc(child.wait(5))}): "
                                           f"{child.stderr_tail(600)}")
                    for outcome in got[0]:
                        ontime += 1
                        ontime_exact += outcome == "ok"
                        other += outcome == "other"
                    time.sleep(lease / 10)
                writer.reclaim()
                got = child.ask({"read_held": True})
                if got is None:
                    raise RuntimeError(f"the tokenizer died reading late chunks "
                                       f"({describe_rc(child.wait(5))}): {child.stderr_tail(600)}")
                for outcome in got[0]:
                    late += 1
                    if outcome.startswith("error:"):
                        late_failed[outcome[6:]] = late_failed.get(outcome[6:], 0) + 1
                    else:
                        other += outcome == "other"
                        wrong += outcome != "other"
            rc = child.proc.poll()
            result.check(rc is None, f"the tokenizer process ended: {describe_rc(rc)}")
        finally:
            child.kill()
            producer.close()
    result.metrics.update(rounds=rounds, requests=requests, lease_s=lease, on_time=ontime,
                          on_time_exact=ontime_exact, late=late, late_failures=late_failed,
                          other_rows=other, late_read_anyway=wrong)
    result.check(other == 0, f"{other} reads returned another request's rows")
    result.check(ontime_exact == ontime, f"{ontime - ontime_exact} on-time requests lost their rows")
    result.check(sum(late_failed.values()) == late, f"{wrong} late requests did not fail cleanly")
    result.check(set(late_failed) <= {"StaleChunkError"},
                 f"late reads failed with {late_failed}, not StaleChunkError")
    result.happened = (f"{late} late requests failed alone ({late_failed}); {ontime_exact}/{ontime} "
                       f"on-time requests got their exact rows; the tokenizer process lived")
    result.figure = (f"{late} late: {sum(late_failed.values())} clean errors, {other} other rows; "
                     f"{ontime_exact}/{ontime} on time exact; 0 deaths" if rc is None else "died")


if __name__ == "__main__":
    if sys.argv[1] == "consumer":
        os.environ.setdefault("SHMASK_NAME_PREFIX", "shmfaults")
        consumer_main(sys.argv[2], sys.argv[3])
