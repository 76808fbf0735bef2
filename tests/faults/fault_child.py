"""The child side of the fault cases: `python fault_child.py <role> args...`.

Each role is a real process doing what a scheduler or tokenizer would; it
talks to the parent by lines on stdin/stdout ("result {json}" at the end),
so a role that dies of a signal is seen by its exit status, not by a
Python exception the parent could mistake for success.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from fault_lib import (
    MODE_SELECTED,
    MODE_SUPPORT,
    Workload,
    check_rows,
    encode_rows,
    expected_for,
    memory_kib,
)

import shmask


def say(*parts: object) -> None:
    print(*parts, flush=True)


def result(value: dict) -> None:
    say("result", json.dumps(value))


def prefix() -> str:
    return os.environ["SHMASK_NAME_PREFIX"]


def wait_for(word: str) -> None:
    """Block until the parent sends `word` (or closes stdin)."""
    for line in sys.stdin:
        if line.strip() == word:
            return


def outcome(call) -> str:  # type: ignore[no-untyped-def]
    """'ok', 'shmask:<Error>' or 'other:<Error>: message' for one call."""
    try:
        call()
    except shmask.ShmaskError as exc:
        return f"shmask:{type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - classifying is the point
        return f"other:{type(exc).__name__}: {str(exc)[:120]}"
    return "ok"


def batch_hex(batch, meta: np.ndarray) -> str:
    return batch.to_bytes().hex() + " " + meta.astype(np.int64).tobytes().hex()


def parse_batch(text: str):
    batch_part, meta_part = text.split()
    batch = shmask.RefBatch.from_bytes(bytes.fromhex(batch_part))
    meta = np.frombuffer(bytes.fromhex(meta_part), np.int64).reshape(-1, 4)
    return batch, meta


# ------------------------------------------------------------ streaming producer

def producer_stream(seed: str, endpoint: str, requests: str) -> None:
    """Publish emissions to a zmq PUSH socket until killed."""
    import zmq

    writer = shmask.Writer()
    say("segment", writer.segment_name)
    work = Workload(writer, int(seed), int(requests), max_len=64)
    socket = zmq.Context().socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 64)
    socket.connect(endpoint)
    sent = 0
    while True:
        for _ in range(2):
            work.step()
        batch, meta = work.take()
        socket.send_multipart([meta.tobytes(), batch.to_bytes()])
        sent += 1
        if sent % 20 == 0:
            say("sent", sent)
        time.sleep(0.002)


# ------------------------------------------------------------ consumers

def consumer_hold(endpoint: str, seed: str, target: str) -> None:
    """Open every chunk received and never release it; say when `target`
    chunks are held, then keep them until killed."""
    import zmq

    reader = shmask.Reader()
    socket = zmq.Context().socket(zmq.PULL)
    socket.setsockopt(zmq.RCVTIMEO, 30_000)
    socket.connect(endpoint)
    held, bad = [], 0
    while True:
        meta_bytes, data = socket.recv_multipart()
        meta = np.frombuffer(meta_bytes, np.int64).reshape(-1, 4)
        for ref, row in zip(shmask.RefBatch.from_bytes(data), meta, strict=True):
            chunk = reader.open(ref)
            bad += bool(check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                   expected_for(int(seed), row, 64)))
            held.append(chunk)
        if len(held) >= int(target):
            say("held", len(held), bad)
            while True:
                time.sleep(1)


def consumer_stop(seed: str) -> None:
    """Hold chunks, get stopped past the lease, then report what reading them gives."""
    reader = shmask.Reader()
    line = sys.stdin.readline()
    batch, meta = parse_batch(line.split(" ", 1)[1])
    line = sys.stdin.readline()
    late_batch, late_meta = parse_batch(line.split(" ", 1)[1])
    held = []
    for ref, row in zip(batch, meta, strict=True):
        if ref.kind == 1:
            held.append((reader.open(ref), row))
    say("held", len(held))
    wait_for("go")
    counts = {"stale": 0, "true_rows": 0, "other_rows": 0, "other_errors": [], "late_stale": 0,
              "late_true": 0}

    def judge(make, row, prefix_key=""):  # type: ignore[no-untyped-def]
        try:
            ids, logprobs = make()
        except shmask.StaleChunkError:
            counts[prefix_key + "stale"] += 1
            return
        except Exception as exc:  # noqa: BLE001
            counts["other_errors"].append(f"{type(exc).__name__}: {str(exc)[:100]}")
            return
        want = expected_for(int(seed), row, 255)
        lengths = np.array([len(r) for r in ids], np.int32)
        flat_ids = np.array([v for r in ids for v in r], np.int32)
        flat_lp = np.array([v for r in logprobs for v in r] if row[1] == MODE_SUPPORT
                           else logprobs, np.float32)
        if check_rows(lengths, flat_ids, flat_lp, want):
            counts["other_rows"] += 1
        else:
            counts["late_true" if prefix_key else "true_rows"] += 1

    for chunk, row in held:
        judge(chunk.to_lists, row)
        for call in (chunk.to_json, chunk.check, chunk.release):
            got = outcome(call)  # stale (a shmask error) is the expected answer
            if got.startswith("other"):
                counts["other_errors"].append(got)
            elif got == "ok" and call != chunk.release:
                counts["other_errors"].append(f"{call.__name__} of a reclaimed chunk succeeded")
    for ref, row in zip(late_batch, late_meta, strict=True):
        if ref.kind != 1:
            continue

        def late(ref=ref):  # type: ignore[no-untyped-def]
            with reader.open(ref) as chunk:
                return chunk.to_lists()
        judge(late, row, "late_")
    result(counts)


def soak_consumer(endpoint: str, seed: str, index: str, hold_max: str) -> None:
    """Verify every chunk, release in random order from a random-sized pool."""
    import zmq

    rng = np.random.default_rng([int(seed), int(index)])
    reader = shmask.Reader()
    socket = zmq.Context().socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 16)
    socket.setsockopt(zmq.RCVTIMEO, 60_000)
    socket.bind(endpoint)  # the producer connects to every consumer
    say("ready")
    held: list = []
    stats = {"chunks": 0, "rows": 0, "mismatches": 0, "inline": 0, "empty": 0, "stale": 0,
             "errors": [], "json_checked": 0}
    rss_start = None
    batches = 0
    while True:
        frames = socket.recv_multipart()
        if frames[0] == b"END":
            break
        meta = np.frombuffer(frames[0], np.int64).reshape(-1, 4)
        for ref, row in zip(shmask.RefBatch.from_bytes(frames[1]), meta, strict=True):
            if ref.kind == 0:
                stats["empty"] += 1
                continue
            stats["inline"] += ref.kind == 2
            try:
                chunk = reader.open(ref)
            except shmask.StaleChunkError:
                stats["stale"] += 1
                continue
            want = expected_for(int(seed), row)
            problem = check_rows(chunk.lengths, chunk.ids, chunk.logprobs, want)
            if not problem and stats["chunks"] % 97 == 0:
                # now and then through the response paths too
                ids, _ = chunk.to_lists()
                parsed = json.loads(chunk.to_json())
                if [v for r in ids for v in r] != want[1].tolist():
                    problem = "to_lists ids"
                if (parsed["mask_lengths"] != want[0].tolist()
                        or [v for r in parsed["mask_ids"] for v in r] != want[1].tolist()):
                    problem = "to_json"
                stats["json_checked"] += 1
            if problem:
                stats["mismatches"] += 1
                if len(stats["errors"]) < 5:
                    stats["errors"].append(problem)
            stats["chunks"] += 1
            stats["rows"] += int(row[3])
            held.append(chunk)
            # random release order: a random-sized pool, released from random places
            while len(held) > rng.integers(0, int(hold_max) + 1):
                held.pop(int(rng.integers(len(held)))).release()
        batches += 1
        if batches == 50:
            rss_start = memory_kib()
    for chunk in held:
        chunk.release()
    stats["rss_start"] = rss_start or memory_kib()
    stats["rss_end"] = memory_kib()
    result(stats)


def soak_producer(seed: str, chunks: str, *endpoints: str) -> None:
    """A scheduler + detokenizer: emissions of random sizes, each routed in
    parts (RefBatch.select) to several consumers over zmq, until `chunks`
    non-empty chunks went out; then END to each consumer."""
    import zmq

    rng = np.random.default_rng(int(seed) + 1)
    writer = shmask.Writer()
    work = Workload(writer, int(seed), 48, selected_share=0.25, churn=0.05)
    context = zmq.Context()
    sockets = []
    for endpoint in endpoints:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 16)
        socket.setsockopt(zmq.SNDTIMEO, 120_000)
        socket.connect(endpoint)
        sockets.append(socket)
    say("segment", writer.segment_name)
    sent = emissions = 0
    rss_start = None
    started = time.monotonic()
    while sent < int(chunks):
        for _ in range(int(rng.integers(1, 9))):
            work.step(skip=float(rng.random()) * 0.5)
        batch, meta = work.take()
        owner = rng.integers(len(sockets), size=len(batch))
        for index, socket in enumerate(sockets):
            mine = np.flatnonzero(owner == index)
            socket.send_multipart([meta[mine].tobytes(), batch.select(mine).to_bytes()])
        sent += int(np.count_nonzero(meta[:, 3]))
        emissions += 1
        if emissions == 50:
            rss_start = memory_kib()
    for socket in sockets:
        socket.send_multipart([b"END"])
    stats = writer.stats
    result({"chunks": sent, "emissions": emissions, "seconds": time.monotonic() - started,
            "inline_chunks": stats.inline_chunks, "full_waits": stats.full_waits,
            "expired": stats.expired, "rss_start": rss_start or memory_kib(),
            "rss_end": memory_kib()})
    for socket in sockets:
        socket.close(linger=60_000)
    wait_for("exit")
    writer.close()


# ------------------------------------------------------------ truncation

def trunc_writer(seconds: str) -> None:
    """A producer whose ring gets truncated under it: every later call must
    raise a shmask error or work, never kill the process."""
    config = shmask.Config.from_env(ring_mb=1, full_wait_ms=5, lease_s=0.5)
    writer = shmask.Writer(config)
    work = Workload(writer, 7, 6, max_len=32, selected_share=0.0)
    for _ in range(3):
        work.step(skip=0.0)
    first = work.take()
    for _ in range(3):
        work.step(skip=0.0)
    second = work.take()
    say("segment", writer.segment_name)
    say("refs", batch_hex(*first))
    say("refs", batch_hex(*second))
    wait_for("go")
    # keep writing while the parent truncates the file under us
    calls: dict[str, dict[str, int]] = {}
    lengths, ids, logprobs = encode_rows(7, 999, MODE_SUPPORT, 0, 4, 32)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        for name, call in (("append_step", lambda: work.step(skip=0.0)), ("take_batch", work.take),
                           ("publish", lambda: writer.publish(lengths, ids, logprobs)),
                           ("reclaim", writer.reclaim)):
            got = outcome(call)
            calls.setdefault(name, {})
            calls[name][got] = calls[name].get(got, 0) + 1
        time.sleep(0.01)
    result(calls)
    wait_for("exit")
    writer.close()


def trunc_reader(seed: str) -> None:
    """A tokenizer holding a chunk of a ring that gets truncated."""
    reader = shmask.Reader()
    batch, meta = parse_batch(sys.stdin.readline().split(" ", 1)[1])
    late, _ = parse_batch(sys.stdin.readline().split(" ", 1)[1])
    chunk = reader.open(batch[0])
    bad = check_rows(chunk.lengths, chunk.ids, chunk.logprobs, expected_for(int(seed), meta[0], 32))
    say("held", bad or "ok")
    wait_for("go")
    calls = {
        "to_lists": outcome(chunk.to_lists),
        "to_json": outcome(chunk.to_json),
        "check": outcome(chunk.check),
        "release": outcome(chunk.release),
        "open(held batch)": outcome(lambda: reader.open(batch[1]).to_lists()),
        "open(unopened batch)": outcome(lambda: reader.open(late[0]).to_lists()),
        "open+release": outcome(lambda: reader.open(late[1]).release()),
    }
    # A fresh Reader attaches anew to the truncated segment.
    calls["new Reader().open"] = outcome(lambda: shmask.Reader().open(late[2]).to_lists())
    result(calls)


# ------------------------------------------------------------ plain producers

def writer_sleep() -> None:
    """A Writer from the environment that lives until killed (or stdin closes)."""
    writer = shmask.Writer()
    say("segment", writer.segment_name, os.getpid())
    for _ in sys.stdin:
        pass
    time.sleep(3600)


def hold_lock(template: str, create: str, seconds: str) -> None:
    """Create (O_EXCL) or open a segment file and hold flock + POSIX locks on
    it, as a producer does while it sets its ring up ('{pid}' in the path
    becomes this process's pid; create='sized' also gives it a ring's size)."""
    import fcntl

    path = template.replace("{pid}", str(os.getpid()))
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create in ("create", "sized") else 0)
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    if create == "sized":
        os.ftruncate(fd, 4096 + (1 << 20))
    say("locked", path)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    os.close(fd)


# ------------------------------------------------------------ fork

def fork_producer(seed: str) -> None:
    """A producer that forks: children exit in every way a child exits; the
    parent's ring must stay and keep working."""
    import signal

    writer = shmask.Writer(shmask.Config.from_env(ring_mb=1))
    work = Workload(writer, int(seed), 4, max_len=32, selected_share=0.0)
    work.step(skip=0.0)
    say("segment", writer.segment_name)
    say("refs", batch_hex(*work.take()))
    exits = {}
    for how in ("sys.exit", "close+exit", "sigterm", "own-writer", "os._exit"):
        pid = os.fork()
        if pid == 0:
            try:
                if how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
                if how == "close+exit":
                    writer.close()
                if how == "own-writer":
                    with shmask.Writer(shmask.Config.from_env(ring_mb=1)):
                        pass
                if how == "os._exit":
                    os._exit(0)
            finally:
                if how != "os._exit":
                    sys.exit(0)
        _, status = os.waitpid(pid, 0)
        exits[how] = status
    exists = os.path.exists("/dev/shm" + writer.segment_name)
    work.step(skip=0.0)
    say("refs", batch_hex(*work.take()))
    say("forks", json.dumps({"exits": exits, "ring_exists_after_children": exists}))
    # A child that outlives the producer (a worker forked earlier) must not
    # keep the producer's ring alive once the producer is killed.
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    say("longchild", pid)
    wait_for("exit")
    writer.close()


def fork_reader(seed: str) -> None:
    """A reader that forks after attaching: both sides read and release."""
    reader = shmask.Reader()
    batch, meta = parse_batch(sys.stdin.readline().split(" ", 1)[1])
    held = reader.open(batch[0])
    report = {"parent_held_before": check_rows(held.lengths, held.ids, held.logprobs,
                                               expected_for(int(seed), meta[0], 32)) or "ok"}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        child = {}
        try:
            child["held_in_child"] = check_rows(held.lengths, held.ids, held.logprobs,
                                                expected_for(int(seed), meta[0], 32)) or "ok"
            with reader.open(batch[1]) as chunk:
                child["open_in_child"] = check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                                    expected_for(int(seed), meta[1], 32)) or "ok"
            fresh = shmask.Reader()
            with fresh.open(batch[2]) as chunk:
                child["fresh_reader_in_child"] = check_rows(
                    chunk.lengths, chunk.ids, chunk.logprobs,
                    expected_for(int(seed), meta[2], 32)) or "ok"
            fresh.close()
        except Exception as exc:  # noqa: BLE001
            child["error"] = f"{type(exc).__name__}: {exc}"
        os.write(write, json.dumps(child).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    report["child"] = json.loads(os.read(read, 65536) or b"{}")
    report["child_status"] = status
    report["parent_held_after"] = outcome(held.to_lists)
    report["parent_release"] = outcome(held.release)
    with reader.open(batch[3]) as chunk:
        report["parent_open_after"] = check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                                 expected_for(int(seed), meta[3], 32)) or "ok"
    result(report)


# ------------------------------------------------------------ configuration

def bad_config(cases_json: str) -> None:
    """For each (variable, value): Writer() and Reader() at start."""
    base = {k: v for k, v in os.environ.items()}
    report = []
    for variable, value in json.loads(cases_json):
        os.environ.clear()
        os.environ.update(base)
        os.environ[variable] = value
        before = set(os.listdir("/dev/shm"))
        row = {"variable": variable, "value": value}
        for cls in (shmask.Writer, shmask.Reader):
            try:
                made = cls()
            except shmask.ConfigError as exc:
                row[cls.__name__] = "ConfigError"
                row[cls.__name__ + "_names_variable"] = variable in str(exc)
                row[cls.__name__ + "_message"] = str(exc)[:160]
            except Exception as exc:  # noqa: BLE001
                row[cls.__name__] = f"{type(exc).__name__}: {str(exc)[:120]}"
            else:
                row[cls.__name__] = "accepted"
                made.close()
        # This process's segments only (a ring's name carries its pid):
        # other processes of the machine may make rings meanwhile.
        row["segments_created"] = sorted(name for name in set(os.listdir("/dev/shm")) - before
                                         if f"-{os.getpid()}-" in name)
        report.append(row)
    result({"rows": report})


def small_shm() -> None:
    """Inside a private 8 MiB tmpfs on /dev/shm: rings that do not fit."""
    report = {"df_mib": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize >> 20}
    attempts = [("Config(ring_mb=16)", lambda: shmask.Writer(shmask.Config(ring_mb=16,
                                                                          name_prefix=prefix())))]
    os.environ["SHMASK_RING_MB"] = "32"
    attempts.append(("SHMASK_RING_MB=32 Writer()", shmask.Writer))
    for label, make in attempts:
        try:
            made = make()
        except shmask.SegmentError as exc:
            report[label] = {"error": "SegmentError", "names_variable": "SHMASK_RING_MB" in str(exc),
                             "message": str(exc)[:200]}
        except Exception as exc:  # noqa: BLE001
            report[label] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        else:
            report[label] = {"error": None}
            made.close()
        report[label]["left_in_tmpfs"] = os.listdir("/dev/shm")
    # a ring that fits, then one that no longer does
    first = shmask.Writer(shmask.Config(ring_mb=4, name_prefix=prefix()))
    lengths, ids, logprobs = encode_rows(1, 1, MODE_SELECTED, 0, 3, 16)
    with shmask.Reader().open(first.publish(lengths, ids, logprobs, "selected")) as chunk:
        report["fitting_ring_rows_ok"] = not check_rows(chunk.lengths, chunk.ids, chunk.logprobs,
                                                        (lengths, ids, logprobs))
    try:
        shmask.Writer(shmask.Config(ring_mb=4, name_prefix=prefix())).close()
        report["second"] = {"error": None}
    except shmask.SegmentError as exc:
        report["second"] = {"error": "SegmentError", "names_variable": "SHMASK_RING_MB" in str(exc),
                            "message": str(exc)[:200]}
    except Exception as exc:  # noqa: BLE001
        report["second"] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    first.close()
    report["left_at_end"] = os.listdir("/dev/shm")
    result(report)

# ------------------------------------------------------------ another uid

def as_nobody(spec_json: str) -> None:
    """Import as root (the interpreter lives under /root), then drop to
    nobody and try to open, list, collect, attach and block another user's
    ring; also plant a file whose name claims uid 0."""
    import contextlib
    import fcntl
    import io

    from shmask import cli
    from shmask.segment import Segment, collect_garbage, list_segments

    spec = json.loads(spec_json)
    # The interpreter and its standard library live under /root (mode 0700):
    # import everything while still root (shmask imports its modules lazily;
    # orjson imported as nobody there dies of SIGSEGV, an artefact of this
    # setup, not of shmask).
    import importlib
    import shutil  # noqa: F401

    import orjson  # noqa: F401

    for module in ("chunk", "reader", "writer", "refs", "segment", "config", "errors"):
        importlib.import_module("shmask." + module)
    for name in ("Reader", "Writer", "Config", "ChunkRef", "RefBatch", "Chunk"):
        getattr(shmask, name)

    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(["ls"])
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    report = {"uid": os.getuid()}
    ref = shmask.ChunkRef.from_bytes(bytes.fromhex(spec["ref"]))
    report["open"] = outcome(lambda: shmask.Reader(shmask.Config(name_prefix=spec["prefix"]))
                             .open(ref).to_lists())
    report["attach"] = outcome(lambda: Segment.attach(spec["name"]))
    report["list_segments_sees_it"] = spec["name"] in [s.name for s in list_segments()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report["cli_ls"] = outcome(lambda: cli.main(["ls"]))
        report["cli_gc"] = outcome(lambda: cli.main(["gc"]))
        report["cli_gc_prefix"] = outcome(lambda: cli.main(["gc", "--prefix", spec["prefix"]]))
    report["cli_ls_shows_it"] = spec["name"][1:] in out.getvalue()
    report["collect_garbage"] = outcome(lambda: collect_garbage(spec["prefix"]))
    try:
        fd = os.open("/dev/shm" + spec["name"], os.O_RDONLY)
    except PermissionError:
        report["lock"] = "cannot open"
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            report["lock"] = "took the lock"
        except OSError:
            report["lock"] = "opened, lock busy"
    # its own Writer with the same prefix (its janitor runs over root's files,
    # including one planted by root under a name that claims nobody's uid)
    def own_writer():  # type: ignore[no-untyped-def]
        shmask.Writer(shmask.Config(ring_mb=1, name_prefix=spec["prefix"])).close()
    report["own_writer"] = outcome(own_writer)
    # plant a headerless, old file whose name claims uid 0 (root)
    planted = f"/{spec['prefix']}-0-{spec['dead_pid']}-{'ab' * 8}"
    fd = os.open("/dev/shm" + planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096 + (1 << 20))
    os.close(fd)
    old = time.time() - 3600
    os.utime("/dev/shm" + planted, (old, old))
    report["planted"] = planted
    result(report)


ROLES = {name: obj for name, obj in globals().items()
         if callable(obj) and getattr(obj, "__module__", None) == __name__
         and name not in ("say", "result", "prefix", "wait_for", "outcome", "batch_hex",
                          "parse_batch")}

if __name__ == "__main__":
    ROLES[sys.argv[1]](*sys.argv[2:])
