"""`qat4 status`: what the running `qat4 serve` is (README, "Running it in the background").

It asks the server's /health (pid, model, the device it computes on, memory, load, uptime) and
reads its pid file when it has one (a server started with --detach). Exit status 0 when the
server answers healthy, 1 when nothing answers or it reports an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from qat4.commands.ask import DEFAULT_URL
from qat4.errors import Qat4Error
from qat4.serve_process import fetch_health, health_body
from qat4.server_control import LOOPBACK, LOOPBACK_HOSTS, WILDCARD_HOSTS, PidFile, check_port, default_pid_file, \
    live_pid_file, url_for

LOCAL_HOSTS = (*LOOPBACK_HOSTS, *WILDCARD_HOSTS)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="what the running qat4 server is: pid, model, device, memory, load",
        description="Ask a running qat4 serve's /health and read its pid file (left by --detach): pid, model, "
                    "the device it computes on, memory, running and queued sequences, KV pool use, uptime, "
                    "log file. Exit status 0 when it answers healthy, 1 when nothing answers or it reports "
                    "an error.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help=f"server address (default: $QAT4_URL or {DEFAULT_URL})")
    where.add_argument("--port", type=int, default=None, metavar="N",
                       help=f"the server on this machine's port N (the address its pid file records, else "
                            f"http://{LOOPBACK}:N)")
    p.add_argument("--pid-file", default=None, metavar="PATH",
                   help="the pid file (default: serve-PORT.pid in the state directory, for a server on this machine)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class Status:
    """What `qat4 status` found: ``report``, the object --json prints; ``answered``, whether a qat4
    server answered /health (when not, the report's "error" says why in a sentence); ``healthy``,
    whether it answered 200."""

    report: dict
    answered: bool
    healthy: bool


def _url(url: str | None, port: int | None, record: PidFile | None) -> str:
    """The address asked: --url, the pid file's, --port on loopback, $QAT4_URL, the default, in that order."""
    if url is None and record is None and port is not None:
        return url_for(LOOPBACK, port)
    return (url or (record.url if record else None) or os.environ.get("QAT4_URL") or DEFAULT_URL).rstrip("/")


def _url_port(url: str) -> int:
    """The port of `url` (80 when it names none); a URL that is not one is a Qat4Error naming --url or $QAT4_URL."""
    try:
        return urlsplit(url).port or 80
    except ValueError as exc:
        flag = "--url" if url != os.environ.get("QAT4_URL") else "$QAT4_URL"
        raise Qat4Error(f"{flag} {url!r} is not a server address like http://HOST:PORT ({exc})") from None


def _pid_path(url: str | None, port: int | None, pid_file: str | None) -> Path | None:
    """--pid-file, else the default pid file of the port asked about when the server is on this machine."""
    if pid_file:
        return Path(pid_file).absolute()
    if port is not None:
        return default_pid_file(port)
    address = _url(url, None, None)
    return default_pid_file(_url_port(address)) if urlsplit(address).hostname in LOCAL_HOSTS else None


def _silence(url: str, pid_path: Path | None, record: PidFile | None, note: str | None) -> str:
    """Why nothing answers at `url`, in one sentence."""
    if record is not None:
        return (f"no server answers at {url} yet; pid {record.pid} of pid file {pid_path} is running (still starting? "
                f"its log: {record.log_file})")
    if note is not None:
        return f"no server answers at {url}; {note}"
    return f"no server answers at {url}" + (f" (no pid file at {pid_path})" if pid_path else "")


def _report(url: str, body: dict, pid_path: Path | None, record: PidFile | None) -> dict:
    """/health's answer with the address, and the pid and log files when the pid file is this server's."""
    if record is not None and body.get("pid", record.pid) != record.pid:
        print(f"qat4 status: pid file {pid_path} names pid {record.pid}, but pid {body['pid']} answers at {url}",
              file=sys.stderr)
        record = None
    return {"url": url, **body, "pid_file": str(pid_path) if record else None,
            "log_file": record.log_file if record else None}


def _duration(seconds: float) -> str:
    """Like '45 s', '3 min 12 s', '2 h 05 min', '3 d 4 h'."""
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _memory(memory: dict) -> str:
    """The memory line: the GPU allocator's share, then the resident memory."""
    parts = []
    if "allocated_mib" in memory:
        parts.append(f"{memory['allocated_mib']:,.0f} MiB allocated, {memory['reserved_mib']:,.0f} MiB reserved "
                     "on the GPU")
    if "resident_mib" in memory:
        parts.append(f"{memory['resident_mib']:,.0f} MiB resident")
    return "; ".join(parts)


def _text(report: dict) -> str:
    """The report as aligned lines; fields the server does not report are left out."""
    r = report
    pid = r.get("pid")
    if pid is not None:
        pid = f"{pid} (pid file {r['pid_file']})" if r["pid_file"] else f"{pid} (no pid file)"
    device = r.get("device")
    if device and r.get("device_name"):
        device += f" ({r['device_name']})"
    sequences = None
    if "running" in r:
        sequences = f"{r['running']} running, {r['queue_depth']} queued"
        if "max_num_seqs" in r:
            sequences += f" (up to {r['max_num_seqs']} at once, {r['max_ctx']:,} tokens of context)"
    rows = [
        ("error", r.get("error")),
        ("pid", pid),
        ("model", r.get("model")),
        ("device", device),
        ("memory", _memory(r["memory"]) if r.get("memory") else None),
        ("sequences", sequences),
        ("KV pool", ", ".join(f"{kind} {share:.0%}" for kind, share in r["kv_pool_usage"].items()) + " used"
         if r.get("kv_pool_usage") else None),
        ("uptime", _duration(r["uptime_s"]) if "uptime_s" in r else None),
        ("version", r.get("version")),
        ("log", r.get("log_file")),
    ]
    lines = [f"qat4 serve at {r['url']}/: {r['status']}"]
    lines += [f"  {label:<10} {value}" for label, value in rows if value is not None]
    return "\n".join(lines)


def server_status(*, url: str | None = None, port: int | None = None, pid_file: str | None = None) -> Status:
    """Ask the server at --url or this machine's --port (else the pid file's address, $QAT4_URL, the
    default) and read its pid file. When nothing answers, the report's status is "starting" (the pid
    file's process runs) or "unreachable"; a program that answers, but not as a qat4 server, is a
    Qat4Error, and so is a --port or --url no server can have."""
    if port is not None:
        check_port(port)
    else:
        _url_port(_url(url, None, None))
    pid_path = _pid_path(url, port, pid_file)
    record, note = live_pid_file(pid_path) if pid_path else (None, None)
    address = _url(url, port, record)
    response = fetch_health(address)
    if response is None:
        return Status({"url": address, "status": "starting" if record else "unreachable",
                       "error": _silence(address, pid_path, record, note), "pid": record.pid if record else None,
                       "pid_file": str(pid_path) if pid_path else None}, answered=False, healthy=False)
    body = health_body(response)
    if body is None:
        raise Qat4Error(f"{address} answers, but not as a qat4 server (GET /health: {response.status_code})")
    if note is not None:
        print(f"qat4 status: {note}", file=sys.stderr)
    return Status(_report(address, body, pid_path, record), answered=True, healthy=response.status_code == 200)


def run(args: argparse.Namespace) -> int:
    found = server_status(url=args.url, port=args.port, pid_file=args.pid_file)
    if not found.answered:
        if args.json:
            print(json.dumps(found.report))
        raise Qat4Error(found.report["error"])
    print(json.dumps(found.report) if args.json else _text(found.report))
    return 0 if found.healthy else 1
