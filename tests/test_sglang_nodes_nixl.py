"""SGLang's scheduler on node 1, its tokenizer on node 0, SHMASK_REMOTE=nixl:
two "hosts" (tests/netns.py), the adapter on each side as the patched
SGLang calls it (tests/remote_nodes.py). The rows are pulled in one NIXL
pull for the message, the scheduler gets its records back, and the socket
carries references only. The fault cases (the scheduler killed, the link
dropped, an agent that cannot be reached, forged descriptors, records
reused) are in the fault matrix: tests/faults/cases_remote.py.

Needs root (namespaces) and nixl-cu12; skipped with the reason without.
"""

from __future__ import annotations

import netns  # tests/netns.py
import pytest
import remote_nodes  # tests/remote_nodes.py

from shmask.segment import collect_garbage

needs_nixl_hosts = pytest.mark.skipif(netns.nixl_unavailable() is not None,
                                      reason=netns.nixl_unavailable() or "")


@needs_nixl_hosts
@pytest.mark.timeout(150)
def test_node_1_schedulers_rows_reach_node_0s_tokenizer_through_nixl(prefix, tmp_path):
    try:
        got, sent, code = remote_nodes.run(prefix, tmp_path)
    finally:
        collect_garbage(prefix)
    requests = remote_nodes.REQUESTS
    (read,) = got["reads"]
    assert read["ok"] == requests and read["failed"] == read["other"] == 0, read
    # one pull for the whole message, every chunk read from the ring through NIXL
    assert got["stats"]["pulls"] == 1 and got["stats"]["pulled"] == requests, got["stats"]
    assert not got["mapped"]  # never the producer's /dev/shm
    # the socket carried references: the rows are ~8 bytes an entry
    assert got["payload_bytes"] < 0.05 * got["rows_bytes"], got
    # the scheduler saw each record given back once, on the pull's notification
    assert code == 0 and sent["released"] == sent["published"] == requests, sent
    assert sent["export"]["releases"] == requests and sent["export"]["release_errors"] == 0, sent
    # it advertised its address on the route to the head node (namespace A's)
    assert sent["descriptor"]["ip"] == netns.names(prefix).a_ip, sent["descriptor"]
    print(f"\n{requests} requests: message {got['payload_bytes']} B for {got['rows_bytes']} B "
          f"of rows; read in {read['seconds'] * 1e3:.1f} ms (NIXL metadata included)")
