"""Fault cases of rows read from another host through NIXL: SGLang's
scheduler of --node-rank 1 in one network namespace, the tokenizer on node
0 in another, with a /dev/shm of its own (tests/remote_nodes.py). Each
fault fails the requests it touches, alone (an abort with status 500, the
error named), within SHMASK_REMOTE_TIMEOUT_S; never another request's rows,
never a hang, and the requests it does not touch go through.

Needs root and nixl-cu12 (netns.nixl_unavailable() says why not); without
them a case reports that it was skipped.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: netns, remote_nodes

import netns  # noqa: E402
import remote_nodes  # noqa: E402
from fault_cases import Result, case  # noqa: E402

REQUESTS = remote_nodes.REQUESTS
# A failed pull ends within the timeout; the rest of the message's reads are
# local (inline or lost): one second of slack on a busy 2-core machine.
BOUND_S = remote_nodes.REMOTE_TIMEOUT_S + 1.0


def _run(result: Result, prefix: str, mode: str) -> tuple[dict[str, Any], dict[str, Any] | None,
                                                           int | None] | None:
    reason = netns.nixl_unavailable()
    if reason is not None:
        result.happened = f"skipped: {reason}"
        result.metrics["skipped"] = reason
        return None
    with tempfile.TemporaryDirectory() as directory:
        return remote_nodes.run(prefix, directory, mode)


def _failed_alone(result: Result, read: dict[str, Any], errors: set[str], what: str) -> None:
    result.check(read["other"] == 0, f"{what}: {read['other']} requests got rows not theirs")
    result.check(read["failed"] == REQUESTS and read["aborted"] == REQUESTS,
                 f"{what}: {read['failed']} of {REQUESTS} requests failed, "
                 f"{read['aborted']} aborted in the scheduler (expected all)")
    result.check(set(read["errors"]) <= errors and len(read["errors"]) == REQUESTS,
                 f"{what}: errors {sorted(set(read['errors']))}, expected {sorted(errors)}")
    result.check(read["seconds"] <= BOUND_S,
                 f"{what}: the message took {read['seconds']:.2f} s (bound {BOUND_S} s)")


def _all_ok(result: Result, read: dict[str, Any], what: str) -> None:
    result.check(read["ok"] == REQUESTS and read["failed"] == read["other"] == 0,
                 f"{what}: {read['ok']} ok, {read['failed']} failed, {read['other']} other rows "
                 f"of {REQUESTS}")


def _never_mapped(result: Result, got: dict[str, Any]) -> None:
    result.check(got["own_shm"] and not got["mapped"],
                 "the tokenizer saw or mapped the scheduler's /dev/shm")


@case("remote: producer killed before the pull")
def remote_producer_killed(result: Result, prefix: str, full: bool) -> None:
    ran = _run(result, prefix, "kill")
    if ran is None:
        return
    got, _, code = ran
    (read,) = got["reads"]
    result.check(code == -9, f"the scheduler exited {code}, not by SIGKILL")
    _failed_alone(result, read, {"StaleChunkError"}, "after the kill")
    _never_mapped(result, got)
    result.metrics.update(failed=read["failed"], seconds_to_fail=read["seconds"])
    result.happened = ("scheduler SIGKILLed after sending an emission, before the tokenizer "
                       "pulled it")
    result.figure = (f"{read['failed']}/{REQUESTS} requests failed alone (StaleChunkError) in "
                     f"{read['seconds']:.2f} s (timeout {remote_nodes.REMOTE_TIMEOUT_S:g} s), "
                     f"0 other rows")


@case("remote: link dropped mid-stream")
def remote_link_dropped(result: Result, prefix: str, full: bool) -> None:
    ran = _run(result, prefix, "link")
    if ran is None:
        return
    got, sent, _ = ran
    before, first, *after = got["reads"]
    _all_ok(result, before, "before the link went down")
    _failed_alone(result, first, {"StaleChunkError"}, "link down")
    result.check(any(r["other"] for r in after) == 0, "rows not theirs after the link came back")
    recovered = got.get("recovered_s")
    result.check(recovered is not None, "no emission read whole within 20 s of the link's return")
    if after:
        _all_ok(result, after[-1], "after the link came back")
    _never_mapped(result, got)
    result.metrics.update(failed=first["failed"], seconds_to_fail=first["seconds"],
                          recovered_s=recovered, emissions_after=len(after))
    result.happened = ("the veth of the scheduler's host taken down (no FIN, no RST) between "
                       "two emissions' pulls, then up again")
    result.figure = (f"{first['failed']}/{REQUESTS} failed alone in {first['seconds']:.2f} s "
                     f"({', '.join(sorted(set(first['errors'])))}); the next emission whole "
                     f"{recovered if recovered is None else round(recovered, 2)} s after the "
                     f"link's return ({len(after)} emission(s))")


@case("remote: agent unreachable")
def remote_agent_unreachable(result: Result, prefix: str, full: bool) -> None:
    ran = _run(result, prefix, "unreachable")
    if ran is None:
        return
    got, sent, _ = ran
    (read,) = got["reads"]
    _failed_alone(result, read, {"StaleChunkError"}, "unreachable agent")
    result.check(sent is not None and sent["released"] == 0,
                 "records released though no pull reached the scheduler")
    result.metrics.update(failed=read["failed"], seconds_to_fail=read["seconds"])
    result.happened = (f"the scheduler advertises {remote_nodes.UNREACHABLE_IP} "
                       "(SHMASK_REMOTE_IP), which the tokenizer's host has no route to")
    result.figure = (f"{read['failed']}/{REQUESTS} failed alone (StaleChunkError) in "
                     f"{read['seconds']:.2f} s; its records left to the lease")


@case("remote: forged descriptors")
def remote_forged_descriptors(result: Result, prefix: str, full: bool) -> None:
    ran = _run(result, prefix, "forged")
    if ran is None:
        return
    got, sent, _ = ran
    moved, unknown, real = got["reads"]
    _failed_alone(result, moved, {"InvalidRefError"}, "segment address moved by 1 MiB")
    _failed_alone(result, unknown, {"RemoteChunkError"}, "segment name not exported")
    _all_ok(result, real, "the real emission after the forged ones")
    result.check(sent is not None and sent["export"]["release_errors"] == 0
                 and sent["released"] == REQUESTS,
                 f"the scheduler's releases: {sent and sent['export']}")
    _never_mapped(result, got)
    result.metrics.update(failed=moved["failed"] + unknown["failed"], ok_after=real["ok"])
    result.happened = ("every chunk of an emission re-sent with its descriptor forged: the "
                       "segment's address moved, or a segment name the export does not have; "
                       "then the real emission")
    result.figure = (f"{moved['failed']}/{REQUESTS} (InvalidRefError, {moved['seconds']:.2f} s) "
                     f"and {unknown['failed']}/{REQUESTS} (RemoteChunkError) failed alone; the "
                     f"real one {real['ok']}/{REQUESTS} exact")


@case("remote: records reused before the pull")
def remote_records_reused(result: Result, prefix: str, full: bool) -> None:
    ran = _run(result, prefix, "reused")
    if ran is None:
        return
    got, sent, _ = ran
    first, *later = got["reads"]
    result.check(got.get("overwritten", 0) > 0,
                 "no later record was written over the held emission's bytes")
    _failed_alone(result, first, {"StaleChunkError", "InvalidRefError"},
                  "held past the lease, its records reused")
    for i, read in enumerate(later):
        _all_ok(result, read, f"later emission {i}")
    result.check(sent is not None and sent["expired"] >= REQUESTS,
                 f"the held records were not reclaimed: {sent}")
    _never_mapped(result, got)
    result.metrics.update(failed=first["failed"], overlaps=got.get("overwritten", 0),
                          later_ok=sum(r["ok"] for r in later))
    result.happened = (f"an emission held past its lease ({remote_nodes.LEASE_S:g} s) while "
                       f"{len(later)} later ones wrapped a 1 MiB ring over its records")
    result.figure = (f"{first['failed']}/{REQUESTS} failed alone "
                     f"({', '.join(sorted(set(first['errors'])))}), 0 other rows "
                     f"({got.get('overwritten', 0)} overlaps); later "
                     f"{sum(r['ok'] for r in later)}/{REQUESTS * len(later)} exact")
