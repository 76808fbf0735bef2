"""`python -m shmask ls | gc | doctor`: list rings, remove those of dead
producers, check /dev/shm, limits, the native core and the configuration.

Output is a table on a terminal (coloured when rich is installed: the `cli`
extra), plain text whose lines are never cut when piped, or JSON with
`--json` (ls, doctor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

# Bytes in front of a ring's data region when the native core cannot be
# loaded to say so (tests/test_constants.py checks it against the core).
HEADER_BYTES_FALLBACK = 4096


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shmask", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shmask {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{ls,gc,doctor}")
    ls = sub.add_parser("ls", help="list this user's shmask segments")
    ls.add_argument("--prefix", default=None, help="only segments of this name prefix")
    ls.add_argument("--json", action="store_true", help="one JSON object per run (machine-readable)")
    gc = sub.add_parser("gc", help="remove segments whose producer is gone")
    gc.add_argument("--prefix", default=None, help="only segments of this name prefix")
    gc.add_argument("--json", action="store_true", help="print the removed names as JSON")
    doctor = sub.add_parser("doctor", help="check /dev/shm, limits, the native core and config")
    doctor.add_argument("--json", action="store_true", help="the checks as JSON (machine-readable)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from .config import Config
    from .errors import ConfigError

    try:
        Config.from_env().apply_log_level()  # a program may set levels; the library never does
    except ConfigError:
        pass  # `doctor` reports it
    out = _Output(sys.stdout)
    handlers = {"ls": _ls, "gc": _gc, "doctor": _doctor}
    return handlers[args.command](out, args)


# ------------------------------------------------------------------ output

class _Output:
    """Tables and status lines: rich on a terminal when it is installed,
    otherwise aligned plain text that is never truncated (a pipe, a file,
    a minimal install)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._console: Any = None
        if stream.isatty():
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                self._console = Console(file=stream)

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[tuple[str, str]]]) -> None:
        """rows: cells of (text, style) where style is "", "bad" or "good"."""
        if self._console is not None:
            from rich.markup import escape
            from rich.table import Table

            table = Table(*headers)
            for row in rows:
                table.add_row(*(_styled(escape(text), style) for text, style in row))
            self._console.print(table)
            return
        cells = [list(headers)] + [[text for text, _ in row] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
        for line in cells:
            self.stream.write("  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True))
                              .rstrip() + "\n")

    def line(self, text: str, style: str = "") -> None:
        if self._console is not None:
            from rich.markup import escape

            self._console.print(_styled(escape(text), style))
        else:
            self.stream.write(text + "\n")

    def json(self, value: object) -> None:
        self.stream.write(json.dumps(value, indent=2) + "\n")


def _styled(text: str, style: str) -> str:
    return {"bad": f"[red]{text}[/]", "good": f"[green]{text}[/]"}.get(style, text)


# ---------------------------------------------------------------- commands

def _ls(out: _Output, args: argparse.Namespace) -> int:
    from .segment import list_segments

    segments = list(list_segments(args.prefix))
    if args.json:
        out.json({"segments": [
            {**asdict(info), "in_use_bytes": info.head - info.tail if info.capacity else None}
            for info in segments]})
        return 0
    if not segments:
        out.line("no shmask segments")
        return 0
    rows = []
    for info in segments:
        in_use = f"{(info.head - info.tail) / 2**20:.1f} MiB" if info.capacity else "-"
        rows.append([(info.name, ""), (f"{info.size / 2**20:.0f}", ""), (str(info.producer_pid), ""),
                     ("yes", "") if info.alive else ("no", "bad"), (in_use, ""),
                     (str(info.published), ""), (str(info.released), ""), (str(info.expired), "")])
    # alive: the producer holds the segment's lifetime lock (segment.py)
    out.table(["segment", "MiB", "producer", "alive", "in use", "published", "released", "expired"],
              rows)
    return 0


def _gc(out: _Output, args: argparse.Namespace) -> int:
    from .segment import collect_garbage

    removed = collect_garbage(args.prefix)
    if args.json:
        out.json({"removed": removed})
        return 0
    for name in removed:
        out.line(f"removed {name}")
    out.line(f"{len(removed)} segment(s) removed")
    return 0


def _doctor(out: _Output, args: argparse.Namespace) -> int:
    checks = doctor_checks()
    problems = sum(not check["ok"] for check in checks)
    if args.json:
        out.json({"ok": not problems, "problems": problems, "checks": checks})
    else:
        out.table(["check", "result"],
                  [[(c["check"], ""), (c["result"], "" if c["ok"] else "bad")] for c in checks])
        out.line("ok" if not problems else f"{problems} problem(s)", "good" if not problems else "bad")
    return 1 if problems else 0


def doctor_checks() -> list[dict[str, Any]]:
    """Each check: {"check": name, "ok": bool, "result": text, **details}."""
    checks: list[dict[str, Any]] = []

    def add(name: str, ok: bool, result: str, **details: object) -> None:
        checks.append({"check": name, "ok": ok, "result": result, **details})

    header_bytes = HEADER_BYTES_FALLBACK
    try:
        from . import _native

        header_bytes = int(_native.lib.SHM_HEADER_BYTES)
        add("native core", True, f"loaded ({_native.__file__})", path=_native.__file__)
    except ImportError as exc:
        add("native core", False, f"not loaded: {exc}", error=str(exc))
    free = 0
    try:
        st = os.statvfs("/dev/shm")
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        add("/dev/shm", True, f"{size / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free",
            size_bytes=size, free_bytes=free)
    except OSError as exc:
        add("/dev/shm", False, str(exc), error=str(exc))
    try:
        from .config import Config

        config = Config.from_env()
        need = config.ring_capacity_bytes + header_bytes
        verdict = "fits" if need <= free else "does not fit /dev/shm"
        add("config", need <= free,
            f"transport={config.transport} ring={need / 2**20:.0f} MiB ({verdict}) "
            f"lease={config.lease_s}s full_wait={config.full_wait_ms}ms",
            config=asdict(config), ring_bytes=need)
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever is wrong
        add("config", False, str(exc), error=str(exc))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    add("open files limit", True, f"{soft} (hard {hard})", soft=soft, hard=hard)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    unlimited = memlock == resource.RLIM_INFINITY
    add("locked memory limit", True, "unlimited" if unlimited else f"{memlock / 2**20:.0f} MiB",
        bytes=None if unlimited else memlock)
    try:
        from .segment import list_segments

        segments = list(list_segments())
    except ImportError as exc:  # the native core is missing: reported above
        add("segments", False, f"cannot list: {exc}", error=str(exc))
    else:
        dead = sum(not s.alive for s in segments)
        add("segments", True, f"{len(segments)} ({dead} of dead producers: `python -m shmask gc`)",
            count=len(segments), dead=dead)
    return checks


if __name__ == "__main__":
    sys.exit(main())
