"""`qat4 stop`: stop a `qat4 serve` on this machine (README, "Running it in the background").

The server is found by its pid file (left by `qat4 serve --detach`), else by the pid its /health
reports; either way it is signalled only once its command line shows it is a qat4 serve. SIGTERM
first (qat4 serve ends its open replies within 5 s), SIGKILL after --timeout, then the pid file
is removed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from qat4.errors import Qat4Error
from qat4.serve_process import fetch_health, health_body
from qat4.server_control import DEFAULT_PORT, LOOPBACK, check_port, default_pid_file, live_pid_file, stale_reason, \
    stop_pid, url_for

DEFAULT_TIMEOUT_S = 30.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stop", help="stop a qat4 server on this machine: SIGTERM, then SIGKILL after --timeout",
        description="Stop the qat4 serve on a port of this machine, found by its pid file (left by --detach) "
                    "or else by the pid its /health reports: SIGTERM (open replies end within 5 s), SIGKILL "
                    "if it is still there after --timeout, then the pid file is removed.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                       help=f"the server on port N: its pid file in the state directory, else the pid that "
                            f"http://{LOOPBACK}:N/health reports (default: {DEFAULT_PORT})")
    where.add_argument("--pid-file", default=None, metavar="PATH", help="the server this pid file names")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait after SIGTERM before SIGKILL (default: {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(run=run)


def _pid_from_health(port: int, pid_path: Path) -> int:
    """The pid of the qat4 serve answering on this machine's `port`, checked to be one."""
    url = url_for(LOOPBACK, port)
    response = fetch_health(url)
    body = None if response is None else health_body(response)
    if body is None:
        raise Qat4Error(f"no pid file at {pid_path} and no qat4 server answers at {url}; nothing to stop")
    pid = body.get("pid")
    if not isinstance(pid, int) or pid < 1:
        raise Qat4Error(f"no pid file at {pid_path}, and the server at {url} does not report its pid; "
                        "stop it where it was started")
    reason = stale_reason(pid, port=port)
    if reason is not None:
        raise Qat4Error(f"the server at {url} reports pid {pid}, {reason} here (another machine or container?); "
                        "stop it where it runs")
    return pid


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout) and args.timeout >= 0):
        raise Qat4Error(f"--timeout must be a finite number of seconds, 0 or more, got {args.timeout:g}")
    check_port(args.port)
    pid_path = Path(args.pid_file).absolute() if args.pid_file else default_pid_file(args.port)
    record, note = live_pid_file(pid_path)
    if note is not None:
        print(f"qat4 stop: {note}", file=sys.stderr)
    if record is None and args.pid_file:
        raise Qat4Error(f"no pid file at {pid_path}; nothing to stop")
    pid = record.pid if record is not None else _pid_from_health(args.port, pid_path)
    start = time.monotonic()
    graceful = stop_pid(pid, args.timeout)
    if record is not None:
        record.remove()
    how = f"gracefully, in {time.monotonic() - start:.1f} s" if graceful else f"killed after {args.timeout:g} s"
    print(f"qat4 stop: stopped pid {pid} ({how})")
    return 0
