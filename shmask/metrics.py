"""Prometheus metrics (optional: `pip install shmask[metrics]`).

SGLang and vLLM export Prometheus through prometheus_client, usually in its
multiprocess mode (PROMETHEUS_MULTIPROC_DIR set before the import), so
shmask feeds ordinary Counter and Gauge objects, which work in both modes.
Nothing is counted on the hot path for this: Writers and Readers keep plain
integer stats, and their increments are handed to prometheus_client once per
emission (Writer.take_batch / publish) and once per 256 opens or per
discard on the reader side.

    import shmask.metrics
    shmask.metrics.enable()          # once per process, before Writers/Readers work
    shmask.metrics.enable(labels={"tp_rank": "0"})   # or with the engine's rank labels

docs/metrics.md lists every metric (name, type, unit, labels). The ring
gauges carry a ``segment`` label (one series per Writer, cleared at its
close); ``labels`` given to enable() are added to every metric, as the
engines label theirs per rank.

Metrics never fail a data call: an error from prometheus_client (its
multiprocess directory removed, a full disk) is logged, at most once a
minute with the count since, and the call goes on; the increments it could
not hand over are retried at the next sync.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import astuple, fields
from typing import Any

log = logging.getLogger("shmask")

_metrics: _Metrics | None = None
# The metric objects made per (registry, namespace): prometheus_client
# refuses to register a name twice, so enable() after disable() reuses them
# (their label names are fixed then; the values may change).
_made: dict[tuple[Any, str], _Metrics] = {}
# Values of the constant labels given to enable(), in _Metrics.labels order.
_label_values: tuple[str, ...] = ()
# Segments whose ring gauges were set -> (their metrics, label values), to
# clear them at the Writer's close (even after a disable()).
_rings: dict[str, tuple[_Metrics, tuple[str, ...]]] = {}
_LABEL_PATTERN = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ERROR_INTERVAL_S = 60.0
_errors = {"pending": 0, "last": -_ERROR_INTERVAL_S}
# Held across a sync's read of `synced`, its increments and its update of
# `synced`: threads sharing a Reader sync its one snapshot, and two unlocked
# syncs would both hand over the same delta. Taken once per emission or per
# 256 opens, never per row or per open.
_sync_lock = threading.Lock()


def _new_sync_lock() -> None:
    # A fork while another thread syncs would leave the child's copy held.
    global _sync_lock
    _sync_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_sync_lock)

# WriterStats field -> (metric name, help, labels)
_PRODUCER_COUNTERS = {
    "chunks": ("producer_chunks", "Chunks published (ring and inline)"),
    "rows": ("producer_rows", "Rows published"),
    "payload_bytes": ("producer_bytes", "Payload bytes published (CSR arrays)"),
    "full_waits": ("producer_full_ring_waits", "Times a call waited for a full ring"),
    "expired": ("producer_expired_leases", "Chunks reclaimed after SHMASK_LEASE_S unreleased"),
    "staging_moves": ("producer_staging_moves", "Staging buffers moved off the ring's tail"),
    "aborted_chunks": ("producer_aborted_chunks", "Published chunks given back by RowQueue.abort"),
}
_INLINE_REASONS = ("configured", "ring_full", "oversize", "ring_lost")
_READER_COUNTERS = {
    "opens": ("reader_opens", "Chunks opened"),
    "stale": ("reader_stale", "Opens or checks that raised StaleChunkError"),
    "invalid": ("reader_invalid", "Opens that raised InvalidRefError or DoubleReleaseError"),
    "discards": ("reader_discards", "Chunks given back unopened (Reader.discard_batch)"),
}


class _Metrics:
    def __init__(self, registry: Any, namespace: str, labels: tuple[str, ...]) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = labels

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, help_text, labels + extra, namespace=namespace,
                           registry=registry)

        self.producer = {field: counter(name, help_text)
                         for field, (name, help_text) in _PRODUCER_COUNTERS.items()}
        self.inline = counter("producer_inline_chunks", "Chunks sent inline, by reason",
                              ("reason",))
        self.reader = {field: counter(name, help_text)
                       for field, (name, help_text) in _READER_COUNTERS.items()}
        # One series per ring (segment label). livesum: in multiprocess mode
        # a dead process's series stay until mark_process_dead(pid) (docs/metrics.md).
        ring_labels = labels + ("segment",)
        self.ring_used = Gauge("ring_used_bytes", "Bytes between the ring's tail and head",
                               ring_labels, namespace=namespace, registry=registry,
                               multiprocess_mode="livesum")
        self.ring_capacity = Gauge("ring_capacity_bytes", "Data bytes of the ring",
                                   ring_labels, namespace=namespace, registry=registry,
                                   multiprocess_mode="livesum")

    def series(self, metric: Any, *extra: str) -> Any:
        """The metric's child for this process's constant labels (+ extra)."""
        values = _label_values + extra
        return metric.labels(*values) if values else metric


def enable(registry: Any = None, namespace: str = "shmask",
           labels: Mapping[str, object] | None = None) -> None:
    """Export shmask's metrics through prometheus_client (default registry
    unless one is given). ``labels``: constant labels added to every metric
    of this process (e.g. the engine's ``{"tp_rank": 0, "dp_rank": 1}``);
    their names are fixed by the first enable() for a registry. Idempotent
    per process; enable() after disable() feeds the same metric objects
    again."""
    global _metrics, _label_values
    if _metrics is not None:
        return
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("shmask.metrics needs prometheus_client: "
                          "pip install 'shmask[metrics]'") from None
    names = tuple(labels or ())
    for name in names:
        if not _LABEL_PATTERN.match(name) or name in ("segment", "reason") \
                or name.startswith("__"):
            raise ValueError(f"metric label {name!r} is invalid: use letters, digits and _ "
                             "(not segment or reason, which shmask sets)")
    key = (registry if registry is not None else prometheus_client.REGISTRY, namespace)
    if key not in _made:
        _made[key] = _Metrics(*key, names)
    made = _made[key]
    if made.labels != names:
        raise ValueError(f"shmask metrics of namespace {namespace!r} are registered with "
                         f"labels {list(made.labels)}; enable() was given {list(names)} "
                         "(label names are fixed per process and registry)")
    _label_values = tuple(str(labels[name]) for name in names) if labels else ()
    _metrics = made


def disable() -> None:
    """Stop feeding metrics (the metric objects stay registered)."""
    global _metrics
    _metrics = None


def enabled() -> bool:
    return _metrics is not None


def sync(stats: Any, synced: Any, ring_usage: tuple[int, int] | None = None,
         segment: str = "") -> None:
    """Hand the increments of a WriterStats or ReaderStats since `synced`
    (a snapshot of the same type, updated in place) to prometheus_client,
    and set the ring gauges of `segment` (a Writer's segment name) to
    `ring_usage` (used, capacity). Never raises: it runs inside data calls
    (take_batch, open, discard). Threads may sync one `synced` at once
    (a Reader they share): each increment is handed over once, and a
    snapshot older than `synced` hands over nothing."""
    metrics = _metrics
    if metrics is None:
        return
    try:
        with _sync_lock:
            _sync(metrics, stats, synced, ring_usage if segment else None, segment)
    except Exception:  # noqa: BLE001 - metrics must never fail a data call
        _log_error()


def forget_ring(segment: str) -> None:
    """A Writer closed (or was collected): its ring gauges go. In
    prometheus_client's multiprocess mode series cannot be removed, so they
    read 0 until the process ends and is marked dead (docs/metrics.md).
    Never raises."""
    entry = _rings.pop(segment, None)
    if entry is None:
        return
    metrics, values = entry
    try:
        for gauge in (metrics.ring_used, metrics.ring_capacity):
            gauge.labels(*values, segment).set(0)
            if not _multiprocess_mode():
                gauge.remove(*values, segment)
    except Exception:  # noqa: BLE001 - runs in close() and in a finalizer
        _log_error()


def _multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")
                or os.environ.get("prometheus_multiproc_dir"))


def _sync(metrics: _Metrics, stats: Any, synced: Any, ring_usage: tuple[int, int] | None,
          segment: str) -> None:
    if astuple(stats) == astuple(synced):
        if ring_usage is None:
            return
    for field in fields(stats):
        name = field.name
        delta = getattr(stats, name) - getattr(synced, name)
        if delta <= 0:
            continue
        if name in metrics.producer:
            metrics.series(metrics.producer[name]).inc(delta)
        elif name in metrics.reader:
            metrics.series(metrics.reader[name]).inc(delta)
        elif name.startswith("inline_") and name[7:] in _INLINE_REASONS:
            metrics.series(metrics.inline, name[7:]).inc(delta)
        # Only once handed over: a failed increment is retried next time.
        setattr(synced, name, getattr(stats, name))
    if ring_usage is not None:
        used, capacity = ring_usage
        metrics.series(metrics.ring_used, segment).set(used)
        metrics.series(metrics.ring_capacity, segment).set(capacity)
        _rings[segment] = (metrics, _label_values)


def _log_error() -> None:
    """The first failure with its traceback, then one line a minute at most."""
    _errors["pending"] += 1
    now = time.monotonic()
    if now - _errors["last"] < _ERROR_INTERVAL_S:
        return
    log.error("shmask metrics: %d failed update(s) of prometheus_client since the last report "
              "(the data calls went on; the counts are retried at the next sync)",
              _errors["pending"], exc_info=True)
    _errors["last"] = now
    _errors["pending"] = 0
