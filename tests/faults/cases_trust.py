"""Fault cases of issue 17 that need processes: threads of a tokenizer
sharing one Reader, garbled references (their own rows or an error, never
another request's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from fault_cases import Result, case
from fault_lib import REPO, child_env, describe_rc, run_script

# The producer: requests whose rows name their request (ids q << 12 | s << 5 | k),
# one emission, the RefBatch written to a file; it keeps the ring until told.
_PRODUCER = textwrap.dedent("""
    import sys
    import numpy as np
    import shmask
    requests, steps, width, path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                    sys.argv[4])
    writer = shmask.Writer()
    queues = [writer.open_queue("support") for _ in range(requests)]
    handles = np.array([q.handle for q in queues], np.int64)
    q = np.arange(requests, dtype=np.int64)[:, None]
    for s in range(steps):
        lengths = (width - (q[:, 0] + s) % 4).astype(np.int32)
        ids = ((q << 12 | s << 5) + np.arange(width)).astype(np.int32)
        writer.append_step(handles, lengths, ids, (ids % 997).astype(np.float32) / -997)
    with open(path, "wb") as f:
        f.write(writer.take_batch(queues).to_bytes())
    print("ready", flush=True)
    sys.stdin.readline()
    writer.close()
""")

# The tokenizer: threads sharing one Reader, a switch interval of 1 us so
# they interleave inside every open; counts rows of another request.
_CONSUMER = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    import shmask
    threads, steps, width, path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                   sys.argv[4])
    batch = shmask.RefBatch.from_bytes(open(path, "rb").read())
    reader = shmask.Reader()
    counts = {"opened": 0, "other_rows": 0, "wrong_lengths": 0, "errors": 0}
    lock = threading.Lock()
    def work(first):
        mine = {"opened": 0, "other_rows": 0, "wrong_lengths": 0, "errors": 0}
        for q in range(first, len(batch), threads):
            try:
                with reader.open(batch[q]) as chunk:
                    ids, offsets = chunk.csr()
                    expected = [width - (q + s) % 4 for s in range(steps)]
                    mine["other_rows"] += int(np.any(ids >> 12 != q))
                    mine["wrong_lengths"] += chunk.lengths.tolist() != expected
                    mine["opened"] += 1
            except shmask.ShmaskError:
                mine["errors"] += 1
        with lock:
            for key, value in mine.items():
                counts[key] += value
    sys.setswitchinterval(1e-6)
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(json.dumps(counts))
""")


@case("threads sharing a Reader")
def threads_sharing_a_reader(result: Result, prefix: str, full: bool) -> None:
    threads, steps, width = 8, 4, 16
    requests = 20_000 if full else 2_400
    env = child_env(prefix, SHMASK_RING_MB="64")
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "batch")
        producer = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER, str(requests), str(steps), str(width), path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=str(REPO), start_new_session=True)
        try:
            assert producer.stdout is not None and producer.stdin is not None
            line = producer.stdout.readline()
            if not result.check(line.strip() == "ready", f"producer did not start: {line!r}"):
                return
            done = run_script(_CONSUMER.replace("sys.argv[1]", repr(str(threads)))
                              .replace("sys.argv[2]", repr(str(steps)))
                              .replace("sys.argv[3]", repr(str(width)))
                              .replace("sys.argv[4]", repr(path)), env,
                              timeout=600 if full else 120)
            producer.stdin.write("exit\n")
            producer.stdin.flush()
            rc = producer.wait(60)
        finally:
            if producer.poll() is None:
                os.killpg(producer.pid, 9)
                producer.wait(10)
    result.check(done.returncode == 0, f"tokenizer {describe_rc(done.returncode)}: "
                 f"{done.stderr[-600:]}")
    result.check(rc == 0, f"producer {describe_rc(rc)}")
    if done.returncode != 0:
        return
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    result.metrics.update(counts)
    result.check(counts["other_rows"] == 0, f"{counts['other_rows']} refs gave another "
                 "request's rows")
    result.check(counts["wrong_lengths"] == 0, f"{counts['wrong_lengths']} refs gave other lengths")
    result.check(counts["errors"] == 0, f"{counts['errors']} opens failed")
    result.check(counts["opened"] == requests, f"{counts['opened']} of {requests} opened")
    result.happened = (f"{threads} threads of one tokenizer process opened {requests:,} refs "
                       "through one Reader (switch interval 1 us) from a producer process")
    result.figure = (f"{counts['opened']:,} opened, {counts['other_rows']} other-request rows, "
                     f"{counts['errors']} errors")
