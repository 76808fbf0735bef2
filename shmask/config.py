"""Configuration from SHMASK_* environment variables.

Every field has a default; a bad value fails at start with a message naming
the variable and the accepted range (docs/configuration.md lists them). An
empty value means unset. A SHMASK_* variable that is not a setting (a typo:
SHMASK_RINGMB, say) warns once per process, naming the closest setting; the
variables the test suite and benchmarks read are known and never warn.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from .errors import ConfigError

TRANSPORTS = ("shm", "inline")
GPU_DIRECT = ("auto", "off")
# Python logging's level names (WARN and FATAL are its aliases of WARNING
# and CRITICAL, normalised to those).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "NOTSET")
_LEVEL_ALIASES = {"WARN": "WARNING", "FATAL": "CRITICAL"}
# Boolean spellings, compared case-insensitively.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# SHMASK_* variables that are not Config settings but are read elsewhere
# (the kernels at each call, the test suite, the Makefile, benchmarks):
# never reported as unknown. Names under these prefixes are free for such
# uses too.
OTHER_VARIABLES = frozenset({"SHMASK_FAULTS_FULL", "SHMASK_TEST_GPU", "SHMASK_PACKAGE_CHECK",
                             "SHMASK_KERNEL_PLANS"})
OTHER_PREFIXES = ("SHMASK_TEST_", "SHMASK_BENCH_", "SHMASK_FAULTS_")
MASK_FORMATS = ("lists", "arrays")
CAPTURES = ("shmask", "engine")
DRAWS = ("engine", "shmask")
ROW_ORDERS = ("engine", "ascending")
PAST_CAPS = ("exact", "status")
REMOTES = ("off", "nixl")
REMOTE_EXPORTS = ("process", "thread")
_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_PREFIX_RULE = "1 to 32 letters, digits or underscores"
JSON_THREADS_MAX = 64  # SHM_JSON_MAX_THREADS in native/response_json.h
# Each numeric field's accepted range (both ends included); each choice's values.
_RANGES: dict[str, tuple[float, float]] = {
    "ring_mb": (1, 1 << 20),
    "full_wait_ms": (0, 60_000),
    "lease_s": (0.001, 86_400),
    "max_tokens": (1, 1 << 22),
    # A fresh buffer holds queue_rows rows of the step's length: a bound
    # here keeps one setting from asking for gigabytes per request.
    "queue_rows": (1, 1 << 16),
    "json_threads": (1, JSON_THREADS_MAX),
    "offload_threads": (1, 256),
    "remote_port": (0, 65535),
    "remote_timeout_s": (0.01, 600),
}
_CHOICES = {"transport": TRANSPORTS, "gpu_direct": GPU_DIRECT, "log_level": LOG_LEVELS,
            "mask_format": MASK_FORMATS, "capture": CAPTURES, "draw": DRAWS, "row_order": ROW_ORDERS,
            "past_cap": PAST_CAPS, "remote": REMOTES,
            "remote_export": REMOTE_EXPORTS}


def _usable_cpus(at_most: int) -> int:
    """min(at_most, the CPUs this process may run on): a default thread count."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(at_most, usable))


def _log_level(raw: str) -> str:
    level = raw.upper()
    return _LEVEL_ALIASES.get(level, level)


def _gpu_direct(raw: str) -> str:
    # "auto" or "off"; the boolean spellings mean the same (on: auto, as
    # the GPU path needs CUDA to be there).
    value = raw.lower()
    if value in FALSE_WORDS:
        return "off"
    return "auto" if value in TRUE_WORDS else value


_NORMALIZE = {"SHMASK_TRANSPORT": str.lower, "SHMASK_LOG_LEVEL": _log_level,
              "SHMASK_GPU_DIRECT": _gpu_direct, "SHMASK_MASK_FORMAT": str.lower,
              "SHMASK_REMOTE": str.lower}


@dataclass(frozen=True)
class Config:
    """Settings shared by Writer and Reader. `Config.from_env()` reads them."""

    transport: str = "shm"
    """"shm": rows go through the ring; "inline": every chunk rides in its ref."""
    ring_mb: int = 1024
    """Data bytes of one producer's ring in MiB (rounded up to a power of two).
    Size it for requests x emission tokens x max support x 8 bytes, x2 slack."""
    name_prefix: str = "shmask"
    """Segments are /dev/shm/<prefix>-<uid>-<pid>-<random>."""
    full_wait_ms: float = 50.0
    """How long a producer waits for readers to release when the ring is full,
    before the chunk goes inline in its ref."""
    lease_s: float = 60.0
    """A published chunk not released within this time is reclaimed."""
    max_tokens: int = 8192
    """Longest row accepted in ids form (a wider row travels, exactly, as a
    V-bit bitmask, which this does not bound)."""
    queue_rows: int = 64
    """Rows a new RowQueue buffer holds before it first doubles (the emission
    interval is a good value)."""
    gpu_direct: str = "auto"
    """"auto": device rows given to shmask.kernels.publish are stored into the
    ring by the GPU where CUDA is present (docs/kernels.md); "off": they are
    copied to the host and appended by the CPU."""
    log_level: str = "WARNING"
    """Level of the `shmask` logger, applied by the CLI and the examples
    (Config.apply_log_level); the library never sets it on its own."""
    json_threads: int = _usable_cpus(4)
    """Threads that write responses: those sharing the rows of one chunk's
    response (Chunk.to_json / json_arrays, response_json.dumps, the binary
    rows' codec), and those taking whole documents of an emission
    (response_json.dumps_many, binary_rows.encode_meta_info_many); 1: the
    calling thread only. Default min(4, usable CPUs); small chunks use fewer."""
    json_simd: bool = True
    """The response writers use AVX-512 where the CPU has it: floats and ids
    eight at a time, base64 48 bytes at a time (the same bytes, about twice
    as fast on one thread); off: one at a time, and AVX2 base64."""
    offload_threads: int = _usable_cpus(8)
    """Worker threads of a shmask.Offload pool built without `threads=`:
    they open chunks and write responses off a server's event loop (each
    may split a large chunk's JSON across json_threads threads)."""
    mask_format: str = "lists"
    """What the engine adapters put in the engine's own output objects on the
    consumer side (shmask.adapters.sglang / .vllm): "lists", the engine's
    Python lists exactly; "arrays", numpy arrays copied once out of the ring
    (for RL frameworks that run the engine in their own process; an HTTP
    server cannot JSON-encode them)."""
    capture: str = "shmask"
    """Who captures a patched engine's sampling masks on the GPU: "shmask",
    shmask.kernels.capture on the opted-in rows after the draw (SGLang:
    shmask.adapters.sglang_sampler); "engine", the engine's own capture,
    as released."""
    draw: str = "engine"
    """Who draws the tokens of a patched engine's batch where some row asks
    for masks: "engine", its own sampler, as released; "shmask",
    shmask.kernels.sample, which draws each row's token and captures its
    support in one pass (SGLang: shmask.adapters.sglang_sampler; its
    tokens follow from shmask's seeds, not the engine's generator)."""
    row_order: str = "engine"
    """Order of a row's ids where the engine's own responses have one
    (SGLang: by descending weight, ties by ascending id): "engine", that
    order; "ascending", by id (shmask's own rows)."""
    past_cap: str = "exact"
    """A patched engine's rows longer than its own per-row capacity (SGLang:
    --sampling-mask-max-tokens), top-p-only rows above all: "exact", they
    reach the response whole (a V-bit bitmask on the GPU-to-host copy,
    listed by ascending id); "status", the engine's OVERFLOW status (SGLang
    aborts that request with its 400; the other rows of the batch are
    untouched)."""
    remote: str = "off"
    """How a patched engine's rows reach a consumer on another host (SGLang:
    the schedulers of --node-rank 1 and above send to the tokenizer on node
    0): "off", inline in their references (the rows' bytes on the engine's
    sockets; nothing else to install); "nixl", the references alone, the
    consumer reading the rows from the producer's ring with one-sided NIXL
    READs (pip install 'shmask[nixl]'; docs/multi-node.md)."""
    remote_export: str = "process"
    """Where a producer's ring is exported to NIXL (SHMASK_REMOTE=nixl):
    "process", a sidecar process of its own on this host
    (shmask.remote_sidecar) that maps the ring and serves the pullers'
    READs, so the engine's process never copies READ bytes into a socket
    (UCX over TCP does that in the exporting process); "thread", an agent
    and a release thread inside the producer's own process."""
    remote_ip: str = ""
    """The address consumers on other hosts reach this producer's NIXL agent
    at; empty: the address of this host's interface that routes to the
    engine's head node (SGLang: --dist-init-addr)."""
    remote_port: int = 0
    """The port of this process's NIXL agent (its metadata listener); 0: a
    free port."""
    remote_timeout_s: float = 5.0
    """How long a consumer waits for one message's remote rows before the
    requests they belong to fail (NIXL does not fail a READ on a dropped
    link; it waits)."""

    def __post_init__(self) -> None:
        # Every field's type before its range: a dataclass checks none, and
        # a value of the wrong type would fail far from here (ring_mb=1.5)
        # or be taken for another (json_simd=1, ring_mb=True).
        for field in fields(self):
            name, value = field.name, getattr(self, field.name)
            variable = "SHMASK_" + name.upper()
            _check_type(variable, name, value, type(field.default))
            if name in _RANGES:
                _check_range(variable, value, *_RANGES[name])
            elif name in _CHOICES:
                _check_choice(variable, value, _CHOICES[name])
        if self.remote_ip:
            try:
                ipaddress.ip_address(self.remote_ip)
            except ValueError:
                raise ConfigError(f"SHMASK_REMOTE_IP={self.remote_ip!r} is not an IP address "
                                  "(or leave it empty: the address that routes to the head "
                                  "node)") from None
        if not _PREFIX_PATTERN.match(self.name_prefix):
            raise ConfigError(
                f"SHMASK_NAME_PREFIX={self.name_prefix!r} is invalid: "
                f"use {_PREFIX_RULE}"
            )

    @property
    def ring_capacity_bytes(self) -> int:
        """The ring's data bytes: ring_mb MiB rounded up to a power of two."""
        return 1 << (self.ring_mb * 1024 * 1024 - 1).bit_length()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Build a Config from SHMASK_* variables; keyword overrides win."""
        env = os.environ if environ is None else environ
        _warn_unknown(env)
        values: dict[str, object] = {}
        for field in fields(cls):
            name = "SHMASK_" + field.name.upper()
            raw = env.get(name, "").strip()
            if not raw:
                continue  # unset, or set to nothing: the default
            values[field.name] = _parse(name, raw, type(getattr(cls, field.name)))
        values.update(overrides)
        config = cls(**values)  # type: ignore[arg-type]
        # Said of the environment's value only: a program that passes its
        # own ring_mb (an override, or Config(ring_mb=...)) chose it.
        note = config.ring_rounding() if "ring_mb" not in overrides else None
        if "ring_mb" in values and note and note not in _warned:
            _warned.add(note)
            warnings.warn(note, RingSizeWarning, stacklevel=2)
        return config

    def ring_rounding(self) -> str | None:
        """What SHMASK_RING_MB became where it is not a power of two (the
        ring's size is one: positions wrap by a mask), else None."""
        made = self.ring_capacity_bytes >> 20
        if made == self.ring_mb:
            return None
        return (f"SHMASK_RING_MB={self.ring_mb} is rounded up to {made} "
                f"(the ring's size is a power of two of MiB)")

    def apply_log_level(self) -> None:
        """Set the `shmask` logger to SHMASK_LOG_LEVEL. For programs (the
        CLI, the examples); the library itself never changes its host's
        logging."""
        logging.getLogger("shmask").setLevel(self.log_level)


def check_threads(threads: object) -> None:
    """A `threads=` argument of the response writers (Chunk.to_json,
    response_json.dumps, binary_rows.encode_meta_info, ...): None (then
    SHMASK_JSON_THREADS) or an int from 1 to JSON_THREADS_MAX, never a
    float or a bool, never clamped."""
    if threads is None:
        return
    accepted = f"a positive int up to {JSON_THREADS_MAX} (or None: SHMASK_JSON_THREADS)"
    if not isinstance(threads, int | np.integer) or isinstance(threads, bool):
        raise TypeError(f"threads must be {accepted}, got {threads!r}")
    if not 1 <= threads <= JSON_THREADS_MAX:
        raise ValueError(f"threads must be {accepted}, got {threads}")


class UnknownVariableWarning(UserWarning):
    """A SHMASK_* environment variable that no setting reads."""


class RingSizeWarning(UserWarning):
    """SHMASK_RING_MB is not a power of two: the ring is the next one up."""


def variable_names() -> tuple[str, ...]:
    """The SHMASK_* variables Config reads."""
    return tuple("SHMASK_" + field.name.upper() for field in fields(Config))


_warned: set[str] = set()  # unknown names and rounding notes already reported by this process


def unknown_variables(env: Mapping[str, str]) -> dict[str, str]:
    """Each SHMASK_* variable in env that no setting reads (a typo), with
    what to say about it (the closest setting)."""
    known = variable_names()
    found = {}
    for name in env:
        if (not name.startswith("SHMASK_") or name in known or name in OTHER_VARIABLES
                or name.startswith(OTHER_PREFIXES)):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
        found[name] = f"{name} is not a shmask setting and is ignored ({hint})"
    return found


def _warn_unknown(env: Mapping[str, str]) -> None:
    for name, message in unknown_variables(env).items():
        if name not in _warned:
            _warned.add(name)
            warnings.warn(message, UnknownVariableWarning, stacklevel=3)


def parse_bool(name: str, raw: str) -> bool:
    """on/off, true/false, yes/no, 1/0, in any case."""
    value = raw.strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={raw!r} is invalid: accepted {'/'.join(TRUE_WORDS)} or "
                      f"{'/'.join(FALSE_WORDS)} (any case)")


def _parse(name: str, raw: str, kind: type) -> object:
    if kind is str:
        return _NORMALIZE.get(name, str)(raw)
    if kind is bool:
        return parse_bool(name, raw)
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _check_type(variable: str, field: str, value: object, kind: type) -> None:
    """`value` is of the field's kind (its default's type): an int field
    takes ints, a float field ints or floats, neither a bool (an int to
    Python, never a count or a size here); a bool field takes only a bool."""
    if kind is bool or kind is str:
        ok = type(value) is bool if kind is bool else isinstance(value, str)
    else:
        ok = isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)
    if ok:
        return
    if field in _RANGES:
        low, high = _RANGES[field]
        accepted = f"{'integers' if kind is int else 'numbers'} {low} to {high}"
    elif field in _CHOICES:
        accepted = ", ".join(_CHOICES[field])
    else:
        accepted = ("True or False" if kind is bool else _PREFIX_RULE if field == "name_prefix"
                    else "an IP address, or empty")
    raise ConfigError(f"{variable}={value!r} (Config.{field}) is not {_KIND_NAMES[kind]}: "
                      f"accepted {accepted}")


_KIND_NAMES = {int: "an int", float: "a number", bool: "a bool", str: "a str"}


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} is out of range: accepted {low} to {high}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is invalid: accepted {', '.join(choices)}")
