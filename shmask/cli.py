"""`python -m shmask ls | gc | doctor | integrate`: list rings, remove those
of dead producers, check /dev/shm (room for N rings), limits, the native core
and the configuration, and check, apply or revert the SGLang/vLLM patch.

Output is a table on a terminal (coloured when rich is installed: the `cli`
extra), plain text whose lines are never cut when piped, or JSON with
`--json` (every command; before or after the command name alike).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

# Bytes in front of a ring's data region when the native core cannot be
# loaded to say so (tests/test_constants.py checks it against the core).
HEADER_BYTES_FALLBACK = 4096


def _version() -> str:
    from . import __version__

    return __version__


COMMANDS = ("ls", "gc", "doctor", "integrate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shmask", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shmask {_version()}")
    parser.add_argument("--json", action="store_true",
                        help=f"machine-readable output, one JSON object ({', '.join(COMMANDS)})")
    # --json after the command too: SUPPRESS leaves the value given before it alone
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="machine-readable output, one JSON object")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    ls = sub.add_parser("ls", parents=[after], help="list this user's shmask segments")
    ls.add_argument("--prefix", default=None, help="only segments of this name prefix")
    gc = sub.add_parser("gc", parents=[after], help="remove segments whose producer is gone")
    gc.add_argument("--prefix", default=None, help="only segments of this name prefix")
    doctor = sub.add_parser("doctor", parents=[after],
                            help="check /dev/shm (room for --rings), limits, the native core and config")
    doctor.add_argument("--rings", type=_positive_int, default=1, metavar="N",
                        help="rings /dev/shm must hold at once, each of the configured size "
                             "(SHMASK_RING_MB): one per scheduler rank, TP x DP per engine (default 1)")
    integrate = sub.add_parser(
        "integrate", parents=[after], help="check, apply or revert the SGLang or vLLM patch",
        description="The patch for the installed engine (shipped in shmask/integrations/): --check "
                    "(the default) dry-runs it file by file, --apply applies it, --revert takes it out. "
                    "A partly patched tree (some files patched, some not): --check names them and "
                    "exits 1, --apply patches the rest, --revert unpatches the patched ones. The engine "
                    "is found however pip installed it (wheel, editable; a local version label such "
                    "as +cu126 is the same release). Exit 1 when the engine is missing, is not the "
                    "release the patch was made for, the tree is partly patched (--check), or a file "
                    "differs from both the release and the patched release.")
    integrate.add_argument("engine", choices=["sglang", "vllm"])
    action = integrate.add_mutually_exclusive_group()
    for name, text in (("check", "dry run: say per file whether the patch applies or is applied (default)"),
                       ("apply", "patch the installed engine's unpatched files (nothing if applied)"),
                       ("revert", "take the patch out of the patched files (nothing if not applied)")):
        action.add_argument(f"--{name}", dest="action", action="store_const", const=name, help=text)
    integrate.add_argument("--site", type=Path, default=None, metavar="DIR",
                           help="the directory holding the engine's package, or the site-packages "
                                "of an editable install of it (default: the one this Python imports, "
                                "without importing it)")
    integrate.add_argument("--force", action="store_true",
                           help="try the patch on another engine version, or one without metadata "
                                "(it must still apply exactly)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


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
    handlers = {"ls": _ls, "gc": _gc, "doctor": _doctor, "integrate": _integrate}
    return handlers[args.command](out, args)


def human_bytes(count: int) -> str:
    """2560 -> "2.5 KiB": binary units, one decimal from KiB up."""
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


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
        cells = [list(headers)] + [[text for text, _ in row] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
        # rich only where the whole table fits the terminal (its borders: 3
        # columns a cell and one): narrower, rich would cut the segment
        # names one copies with an ellipsis; plain lines are never cut.
        if self._console is not None and sum(widths) + 3 * len(widths) + 1 <= self._console.width:
            from rich.markup import escape
            from rich.table import Table

            table = Table(*headers)
            for row in rows:
                table.add_row(*(_styled(escape(text), style) for text, style in row))
            self._console.print(table)
            return
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
        in_use = human_bytes(info.head - info.tail) if info.capacity else "-"
        rows.append([(info.name, ""), (human_bytes(info.size), ""), (str(info.producer_pid), ""),
                     ("yes", "") if info.alive else ("no", "bad"), (in_use, ""),
                     (str(info.published), ""), (str(info.released), ""), (str(info.expired), "")])
    # alive: the producer holds the segment's lifetime lock (segment.py)
    out.table(["segment", "size", "producer", "alive", "in use", "published", "released", "expired"],
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
    checks = doctor_checks(rings=args.rings)
    problems = sum(not check["ok"] for check in checks)
    if args.json:
        out.json({"ok": not problems, "problems": problems, "checks": checks})
    else:
        out.table(["check", "result"],
                  [[(c["check"], ""), (c["result"], "" if c["ok"] else "bad")] for c in checks])
        out.line("ok" if not problems else f"{problems} problem(s)", "good" if not problems else "bad")
    return 1 if problems else 0


def doctor_checks(rings: int = 1) -> list[dict[str, Any]]:
    """Each check: {"check": name, "ok": bool, "result": text, **details}.
    rings: how many rings of the configured size /dev/shm must hold."""
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
    free: int | None = None
    try:
        st = os.statvfs("/dev/shm")
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        add("/dev/shm", True, f"{human_bytes(size)}, {human_bytes(free)} free",
            size_bytes=size, free_bytes=free)
    except OSError as exc:
        add("/dev/shm", False, str(exc), error=str(exc))
    try:
        from .config import Config

        with warnings.catch_warnings():  # said here, in the report, not on stderr
            warnings.simplefilter("ignore")
            config = Config.from_env()
        ring = config.ring_capacity_bytes + header_bytes
        rounding = config.ring_rounding()
        add("config", True,
            f"transport={config.transport} ring={human_bytes(ring)} "
            f"lease={config.lease_s}s full_wait={config.full_wait_ms}ms"
            + (f" ({rounding})" if rounding else ""),
            config=asdict(config), ring_bytes=ring, ring_rounding=rounding)
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever is wrong
        add("config", False, str(exc), error=str(exc))
    else:
        need = rings * ring
        each = f"{rings} ring(s) of {human_bytes(ring)} (SHMASK_RING_MB={config.ring_mb})"
        if free is None:
            add("room for rings", False, f"{each}: need {human_bytes(need)}, /dev/shm unreadable",
                rings=rings, ring_bytes=ring, need_bytes=need, free_bytes=None)
        elif need <= free:
            add("room for rings", True, f"{each}: need {human_bytes(need)}, {human_bytes(free)} free",
                rings=rings, ring_bytes=ring, need_bytes=need, free_bytes=free)
        else:
            add("room for rings", False,
                f"{each}: need {human_bytes(need)}, only {human_bytes(free)} free in /dev/shm: "
                f"give it {human_bytes(need - free)} more (docker --shm-size, a Kubernetes "
                f"emptyDir medium: Memory sizeLimit) or lower SHMASK_RING_MB",
                rings=rings, ring_bytes=ring, need_bytes=need, free_bytes=free)
    # A misspelt setting is a problem: what the operator meant does not apply.
    from .config import unknown_variables

    unknown = unknown_variables(os.environ)
    add("SHMASK_* variables", not unknown,
        "; ".join(unknown.values()) if unknown else "every one is a setting",
        unknown=sorted(unknown))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    add("open files limit", True, f"{soft} (hard {hard})", soft=soft, hard=hard)
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    unlimited = memlock == resource.RLIM_INFINITY
    add("locked memory limit", True, "unlimited" if unlimited else human_bytes(memlock),
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


def _integrate(out: _Output, args: argparse.Namespace) -> int:
    from .integrate import APPLIED, DIFFERS, NOT_APPLIED, PARTLY, IntegrateError, integrate

    try:
        report = integrate(args.engine, args.action or "check", site=args.site, force=args.force)
    except IntegrateError as exc:
        if args.json:
            out.json({"ok": False, "engine": args.engine, "error": str(exc)})
        else:
            out.line(f"shmask integrate {args.engine}: {exc}", "bad")
        return 1
    if args.json:
        out.json({"ok": report.ok, **asdict(report)})
        return 0 if report.ok else 1
    version = f"{report.engine} {report.version}" + (
        "" if report.same_release else f" (patch made for {report.supported}; --force)")
    out.line(f"{version} in {report.site}")
    out.line(f"patch: {report.patch}")
    out.table(["file", "state"], [[(path, ""), (state, "good" if state in (APPLIED, NOT_APPLIED) else "bad")]
                                  for path, state in report.files.items()])
    if report.done:
        out.line(f"{report.done}: the patch is now {report.state} "
                 f"({len(report.changed)} of {len(report.files)} files changed)", "good")
    elif report.state == DIFFERS:
        out.line("the patch does not apply: these files differ from the release it was made for "
                 "(edited, or partly patched within a file):\n" + report.detail, "bad")
        out.line(f"reinstall {report.engine}=={report.supported} "
                 f"(pip install --force-reinstall --no-deps '{report.engine}=={report.supported}') "
                 "and run --apply again (an editable install: restore these files from the "
                 f"v{report.supported} tag of its checkout)", "bad")
        return 1
    elif report.state == PARTLY:
        patched = [path for path, state in report.files.items() if state == APPLIED]
        unpatched = [path for path, state in report.files.items() if state == NOT_APPLIED]
        out.line(f"the patch is partly applied: {len(patched)} of {len(report.files)} files are patched "
                 f"({', '.join(patched)}), {len(unpatched)} are not ({', '.join(unpatched)}); "
                 "--apply patches the rest, --revert takes it out of the patched ones", "bad")
        return 1
    else:
        hint = {NOT_APPLIED: "; --apply applies it", APPLIED: "; --revert takes it out"}[report.state]
        out.line(f"the patch is {report.state}{hint}", "good")
    return 0


if __name__ == "__main__":
    sys.exit(main())
