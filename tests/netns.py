"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

    with netns.two_hosts(prefix) as hosts:
        a = netns.run_in(hosts.a, [sys.executable, "-c", CODE, hosts.a_ip], env=env)
        ...
        netns.link_bytes(hosts.b, hosts.b_dev)   # {"rx": ..., "tx": ...}

Each namespace has its own loopback, its own end of the veth (the only
way out of it) and a /30 of 10.0.0.0/8 derived from the prefix. Processes
in the two namespaces still share the filesystem, /dev/shm and /proc: only
the network is split, so a test that means to prove bytes crossed the
"network" must send bytes that were never in shared memory, and may read
the veth's counters to see them cross.

Needs root and iproute2 (`ip`); `available()` says why not, for
`pytest.skip`. Namespaces are named `<prefix>-a` / `<prefix>-b`; interface
names (15 characters at most) are a hash of the prefix. Anything left under
those names by a crashed earlier run is removed before they are made again,
and everything is removed on exit, errors included (`ip netns del` takes
the veth with it). No pytest import: usable from scripts too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

IP_TIMEOUT_S = 10


@dataclass(frozen=True)
class Hosts:
    """Two namespaces (`a`, `b`), the veth end in each (`a_dev`, `b_dev`)
    and its address (`a_ip`, `b_ip`, without the /30)."""
    a: str
    b: str
    a_dev: str
    b_dev: str
    a_ip: str
    b_ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True,
                          timeout=IP_TIMEOUT_S, check=check)


def _digest(prefix: str) -> bytes:
    return hashlib.blake2b(prefix.encode(), digest_size=8).digest()


def names(prefix: str) -> Hosts:
    """The names and addresses `two_hosts(prefix)` uses, without making them.
    Addresses: 10.X.Y.Z/30 with X in 160..223 (clear of the 10.0-10.1 and
    10.255 ranges that container runtimes like), Y and the /30 from the
    hash. They live only inside the two namespaces, so even a clash with an
    address of this machine would reach nothing outside them."""
    if not prefix or "/" in prefix or len(prefix) > 200:
        raise ValueError(f"namespace prefix must be a short name, got {prefix!r}")
    d = _digest(prefix)
    tag = d[:4].hex()  # 8 characters: "sv" + tag + "a" is 11 <= 15
    base = (d[4] % 64 + 160, d[5], (d[6] % 64) * 4)
    net = f"10.{base[0]}.{base[1]}"
    return Hosts(a=f"{prefix}-a", b=f"{prefix}-b", a_dev=f"sv{tag}a", b_dev=f"sv{tag}b",
                 a_ip=f"{net}.{base[2] + 1}", b_ip=f"{net}.{base[2] + 2}")


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove(hosts: Hosts) -> list[str]:
    """Remove the two namespaces and any stray end of the veth in this one
    (a run that died between making and moving it). Returns what was there."""
    removed = []
    present = set(list_namespaces())
    for ns in (hosts.a, hosts.b):
        if ns in present:
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for dev in (hosts.a_dev, hosts.b_dev):
        if os.path.exists(f"/sys/class/net/{dev}"):
            _ip("link", "del", dev, check=False)
            removed.append(dev)
    return removed


def remove_stale(prefix: str) -> list[str]:
    """Remove every namespace whose name starts with `prefix` (leftovers of
    crashed runs under a shared session prefix). Returns their names."""
    stale = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    for ns in stale:
        _ip("netns", "del", ns, check=False)
    return stale


@contextmanager
def two_hosts(name_prefix: str) -> Iterator[Hosts]:
    """Make the two namespaces and the veth between them; yield their
    `Hosts`; remove both on exit, whatever happened inside."""
    hosts = names(name_prefix)
    remove(hosts)  # a crashed earlier run with the same prefix
    try:
        _ip("netns", "add", hosts.a)
        _ip("netns", "add", hosts.b)
        # Made in the host's namespace, then moved: each end lives in its
        # namespace from here on, and `ip netns del` destroys the pair.
        _ip("link", "add", hosts.a_dev, "type", "veth", "peer", "name", hosts.b_dev)
        _ip("link", "set", hosts.a_dev, "netns", hosts.a)
        _ip("link", "set", hosts.b_dev, "netns", hosts.b)
        for ns, dev, ip in ((hosts.a, hosts.a_dev, hosts.a_ip), (hosts.b, hosts.b_dev, hosts.b_ip)):
            _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        _wait_reachable(hosts)
        yield hosts
    finally:
        remove(hosts)


def _wait_reachable(hosts: Hosts, timeout: float = 5.0) -> None:
    """Until both ends report carrier (operstate UP): a process started at
    once could otherwise find its first packets dropped."""
    deadline = time.monotonic() + timeout
    while True:
        states = [_link(ns, dev).get("operstate") for ns, dev in
                  ((hosts.a, hosts.a_dev), (hosts.b, hosts.b_dev))]
        if all(state == "UP" for state in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"veth {hosts.a_dev}/{hosts.b_dev} not up after {timeout} s: {states}")
        time.sleep(0.02)


def _link(ns: str, dev: str) -> dict:
    return json.loads(_ip("-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)[0]


def link_bytes(ns: str, dev: str) -> dict[str, int]:
    """{"rx": bytes, "tx": bytes, "rx_packets": n, "tx_packets": n} of
    interface `dev` in namespace `ns` (its kernel counters)."""
    stats = _link(ns, dev)["stats64"]
    return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"],
            "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


def set_link(ns: str, dev: str, up: bool) -> None:
    """Take `dev` in `ns` down (a cable pulled: no FIN, no RST) or back up."""
    _ip("-n", ns, "link", "set", dev, "up" if up else "down")


@functools.cache
def available() -> str | None:
    """None when namespaces and veth pairs can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"shmprobe{os.getpid()}"
    reason = None
    # Tried three times: `ip netns add` run while another process adds or
    # deletes a namespace can fail once (the /run/netns mount being made),
    # and one failed probe would skip every two-host test of the session.
    for attempt in range(3):
        try:
            _ip("netns", "add", probe)
            try:
                _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
            finally:
                _ip("netns", "del", probe, check=False)
            return None
        except subprocess.CalledProcessError as exc:
            reason = (f"cannot make a network namespace with a veth pair: {' '.join(exc.cmd)}: "
                      f"{exc.stderr.strip()}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            reason = f"cannot make a network namespace: {exc}"
        time.sleep(0.2 * (attempt + 1))
    return reason


def nixl_unavailable() -> str | None:
    """None when the two-host NIXL tests can run here, else why not (for
    pytest's skip): namespaces (available()) and nixl-cu12 installed."""
    reason = available()
    if reason is not None:
        return reason
    if importlib.util.find_spec("nixl_cu12") is None:
        return "nixl-cu12 is not installed (pip install -r tests/compat/requirements-nixl.txt)"
    return None


# `ip netns exec` gives the program a mount namespace of its own; a tmpfs
# mounted there over /dev/shm is that program's alone.
_OWN_SHM = ["sh", "-c", 'mount -t tmpfs -o size=64m shmask-own /dev/shm && exec "$0" "$@"']


def run_in(ns: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
           timeout: float | None = None, own_shm: bool = False,
           **popen: object) -> subprocess.Popen:
    """Start `argv` inside namespace `ns` (`ip netns exec`, which execs it:
    the Popen's pid is the program's own) in a process group of its own,
    stdout and stderr piped as text unless `popen` says otherwise. With
    `timeout`, a watchdog kills the group when it runs longer: `proc.wait()`
    then returns -SIGKILL rather than hang. With `own_shm`, the program sees
    a /dev/shm of its own (an empty tmpfs): it cannot map the other
    namespace's rings and its shmask.host_id() differs, as on another
    machine."""
    kwargs: dict = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    kwargs.update(popen)
    if own_shm:
        argv = [*_OWN_SHM, *argv]
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv],
                            env=dict(env) if env is not None else None,
                            start_new_session=True, **kwargs)
    if timeout is not None:
        _watchdog(proc, timeout)
    return proc


def _watchdog(proc: subprocess.Popen, timeout: float) -> None:
    import threading

    def watch() -> None:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)

    threading.Thread(target=watch, daemon=True, name=f"netns-watchdog-{proc.pid}").start()


def kill_group(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to the process group `run_in` made for `proc` (and to
    `proc` itself, should the group be gone); a stopped process gets
    SIGCONT first. Reaps it when `sig` is SIGKILL. Safe to call twice; once
    `proc` is reaped its pid (so its group id) may be another's: nothing sent."""
    if proc is None or proc.returncode is not None:
        return
    for send in (os.killpg, os.kill):
        try:
            if sig == signal.SIGKILL:
                send(proc.pid, signal.SIGCONT)
            send(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    if sig == signal.SIGKILL:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
