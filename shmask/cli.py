"""`python -m shmask ls | gc | doctor`."""

from __future__ import annotations

import argparse
import os
import resource
import sys

from rich.console import Console
from rich.table import Table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmask", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list this user's shmask segments")
    gc = sub.add_parser("gc", help="remove segments whose producer is gone")
    gc.add_argument("--prefix", default=None, help="only segments of this name prefix")
    sub.add_parser("doctor", help="check /dev/shm, limits, the native core and config")
    args = parser.parse_args(argv)
    from .config import Config
    from .errors import ConfigError

    try:
        Config.from_env().apply_log_level()  # a program may set levels; the library never does
    except ConfigError:
        pass  # `doctor` reports it
    console = Console()
    return {"ls": _ls, "gc": _gc, "doctor": _doctor}[args.command](console, args)


def _ls(console: Console, args: argparse.Namespace) -> int:
    from .segment import list_segments

    table = Table("segment", "MiB", "producer", "alive", "in use", "published", "released",
                  "expired")
    for info in list_segments():
        in_use = f"{(info.head - info.tail) / 2**20:.1f} MiB" if info.capacity else "-"
        table.add_row(info.name, f"{info.size / 2**20:.0f}", str(info.producer_pid),
                      "yes" if info.alive else "[red]no[/]", in_use, str(info.published),
                      str(info.released), str(info.expired))
    console.print(table if table.row_count else "no shmask segments")
    return 0


def _gc(console: Console, args: argparse.Namespace) -> int:
    from .segment import collect_garbage

    removed = collect_garbage(args.prefix)
    for name in removed:
        console.print(f"removed {name}")
    console.print(f"{len(removed)} segment(s) removed")
    return 0


def _doctor(console: Console, args: argparse.Namespace) -> int:
    problems = 0
    table = Table("check", "result")
    try:
        from . import _native

        table.add_row("native core", f"loaded ({_native.__file__})")
    except ImportError as exc:
        table.add_row("native core", f"[red]not loaded: {exc}[/]")
        problems += 1
    try:
        st = os.statvfs("/dev/shm")
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        table.add_row("/dev/shm", f"{size / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free")
    except OSError as exc:
        table.add_row("/dev/shm", f"[red]{exc}[/]")
        problems += 1
        free = 0
    try:
        from .config import Config

        config = Config.from_env()
        need = config.ring_capacity_bytes + 4096
        verdict = "fits" if need <= free else "[red]does not fit /dev/shm[/]"
        problems += need > free
        table.add_row("config", f"transport={config.transport} ring={need / 2**20:.0f} MiB "
                      f"({verdict}) lease={config.lease_s}s full_wait={config.full_wait_ms}ms")
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever is wrong
        table.add_row("config", f"[red]{exc}[/]")
        problems += 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    table.add_row("open files limit", f"{soft} (hard {hard})")
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    table.add_row("locked memory limit",
                  "unlimited" if memlock == resource.RLIM_INFINITY else f"{memlock / 2**20:.0f} MiB")
    from .segment import list_segments

    segments = list(list_segments())
    dead = sum(not s.alive for s in segments)
    table.add_row("segments", f"{len(segments)} ({dead} of dead producers: `python -m shmask gc`)")
    console.print(table)
    console.print("[green]ok[/]" if not problems else f"[red]{problems} problem(s)[/]")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
