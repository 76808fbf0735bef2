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

Metrics never fail a data call: an error from prometheus_client (its
multiprocess directory removed, a full disk) is logged, at most once a
minute with the count since, and the call goes on; the increments it could
not hand over are retried at the next sync.
"""

from __future__ import annotations

import logging
import time
from dataclasses import astuple, fields
from typing import Any

log = logging.getLogger("shmask")

_metrics: _Metrics | None = None
# The metric objects made per (registry, namespace): prometheus_client
# refuses to register a name twice, so enable() after disable() reuses them.
_made: dict[tuple[Any, str], _Metrics] = {}
_ERROR_INTERVAL_S = 60.0
_errors = {"pending": 0, "last": -_ERROR_INTERVAL_S}

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
    def __init__(self, registry: Any, namespace: str) -> None:
        from prometheus_client import Counter, Gauge

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Any:
            return Counter(name, help_text, labels, namespace=namespace, registry=registry)

        self.producer = {field: counter(name, help_text)
                         for field, (name, help_text) in _PRODUCER_COUNTERS.items()}
        self.inline = counter("producer_inline_chunks", "Chunks sent inline, by reason",
                              ("reason",))
        self.reader = {field: counter(name, help_text)
                       for field, (name, help_text) in _READER_COUNTERS.items()}
        # livesum: in multiprocess mode the rings of live producers add up.
        self.ring_used = Gauge("ring_used_bytes", "Bytes between the ring's tail and head",
                               namespace=namespace, registry=registry,
                               multiprocess_mode="livesum")
        self.ring_capacity = Gauge("ring_capacity_bytes", "Data bytes of the rings",
                                   namespace=namespace, registry=registry,
                                   multiprocess_mode="livesum")


def enable(registry: Any = None, namespace: str = "shmask") -> None:
    """Export shmask's counters through prometheus_client (default registry
    unless one is given). Idempotent per process; enable() after disable()
    feeds the same metric objects again."""
    global _metrics
    if _metrics is not None:
        return
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("shmask.metrics needs prometheus_client: "
                          "pip install 'shmask[metrics]'") from None
    key = (registry if registry is not None else prometheus_client.REGISTRY, namespace)
    if key not in _made:
        _made[key] = _Metrics(*key)
    _metrics = _made[key]


def disable() -> None:
    """Stop feeding metrics (the metric objects stay registered)."""
    global _metrics
    _metrics = None


def enabled() -> bool:
    return _metrics is not None


def sync(stats: Any, synced: Any, ring_usage: tuple[int, int] | None = None) -> None:
    """Hand the increments of a WriterStats or ReaderStats since `synced`
    (a snapshot of the same type, updated in place) to prometheus_client.
    Never raises: it runs inside data calls (take_batch, open, discard)."""
    metrics = _metrics
    if metrics is None:
        return
    try:
        _sync(metrics, stats, synced, ring_usage)
    except Exception:  # noqa: BLE001 - metrics must never fail a data call
        _log_error()


def _sync(metrics: _Metrics, stats: Any, synced: Any, ring_usage: tuple[int, int] | None) -> None:
    if astuple(stats) == astuple(synced):
        if ring_usage is None:
            return
    for field in fields(stats):
        name = field.name
        delta = getattr(stats, name) - getattr(synced, name)
        if delta <= 0:
            continue
        if name in metrics.producer:
            metrics.producer[name].inc(delta)
        elif name in metrics.reader:
            metrics.reader[name].inc(delta)
        elif name.startswith("inline_") and name[7:] in _INLINE_REASONS:
            metrics.inline.labels(reason=name[7:]).inc(delta)
        # Only once handed over: a failed increment is retried next time.
        setattr(synced, name, getattr(stats, name))
    if ring_usage is not None:
        used, capacity = ring_usage
        metrics.ring_used.set(used)
        metrics.ring_capacity.set(capacity)


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
