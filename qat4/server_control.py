"""A `qat4 serve` running in the background: its pid file, its start, what answers, its stop.

`qat4 serve --detach` starts the server as a child in a session of its own (no terminal, stdin
from /dev/null, output appended to a log file) and writes a pid file, a JSON object with the
fields of :class:`PidFile`, under the state directory (:func:`state_dir`), named by port.
`qat4 status` and `qat4 stop` find the server by it. A pid file is obeyed only while its pid is
the process it recorded: a running `qat4 serve` (/proc/PID/cmdline, Linux) that started when the
pid file says (/proc/PID/stat), so not another process that took the pid over; otherwise it is stale
and removed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from qat4.errors import Qat4Error
from qat4.serve_process import POLL_INTERVAL_S, fetch_health, health_body, output_tail, terminate_then_kill, \
    wait_for_health

STATE_DIR_ENV = "QAT4_STATE_DIR"
DEFAULT_PORT = 8100
LOOPBACK = "127.0.0.1"
LOOPBACK_V6 = "::1"
LOOPBACK_HOSTS = (LOOPBACK, "localhost", LOOPBACK_V6)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
PROBE_TIMEOUT_S = 1.0  # a program holding the port may never answer HTTP
FAILED_START_GRACE_S = 5.0


def state_dir() -> Path:
    """Where pid and log files go: $QAT4_STATE_DIR, else $XDG_STATE_HOME/qat4, else ~/.local/state/qat4."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).absolute()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base).absolute() / "qat4"


def default_pid_file(port: int) -> Path:
    """The pid file of the server on `port`."""
    return state_dir() / f"serve-{port}.pid"


def default_log_file(port: int) -> Path:
    """The log file of the server on `port`."""
    return state_dir() / f"serve-{port}.log"


def check_port(port: int) -> None:
    """Raise Qat4Error, naming --port, for a port no server can listen on."""
    if not 0 < port < 65536:
        raise Qat4Error(f"--port must be 1 to 65535, got {port}")


def url_for(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server listening on host:port by (a wildcard
    address by the loopback address of its family: uvicorn listens on IPv6 only for `::`)."""
    if host in WILDCARD_HOSTS:
        host = LOOPBACK_V6 if host == "::" else LOOPBACK
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class PidFile:
    """The pid file of a detached server, at `path`: its pid, where it listens, its model, its log
    file, when it started (unix time), its command line, and its start in clock ticks since boot
    (:func:`process_start`; None in pid files of older qat4 versions)."""

    path: Path
    pid: int
    host: str
    port: int
    url: str
    model: str
    log_file: str
    started: float
    command: list[str]
    start_ticks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pid, int) or isinstance(self.pid, bool) or self.pid < 1:
            raise ValueError(f"pid {self.pid!r} is not a process id")

    @classmethod
    def read(cls, path: Path) -> PidFile | None:
        """The pid file at `path`, or None when there is none."""
        try:
            data = json.loads(path.read_text())
            return cls(path, **{f.name: data[f.name] for f in dataclasses.fields(cls)
                                if f.name != "path" and (f.name in data or f.default is dataclasses.MISSING)})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise Qat4Error(f"{path} is not a qat4 serve pid file ({type(exc).__name__}: {exc}); "
                            "remove it or name another") from None

    def fields(self) -> dict:
        """What the file holds."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "path"}

    def write(self) -> None:
        """Write the file whole (a temporary name, then a hard link to the real one), refusing when
        another pid file has appeared at `path` meanwhile."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        except OSError as exc:
            raise Qat4Error(f"cannot write the pid file {self.path} ({exc.strerror})") from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.fields(), f)
                f.write("\n")
            os.link(temporary, self.path)
        except FileExistsError:
            raise Qat4Error(f"another qat4 serve wrote the pid file {self.path} meanwhile; stop it first "
                            "or pick --port") from None
        finally:
            os.unlink(temporary)

    def remove(self) -> None:
        """Remove the file if it still names this pid."""
        current = PidFile.read(self.path)
        if current is not None and current.pid == self.pid:
            self.path.unlink(missing_ok=True)


def _is_qat4_serve(argv: list[str]) -> bool:
    """Whether a command line is `qat4 serve ...`: `serve` the subcommand right after the console
    script or `-m qat4.cli`."""
    for i, arg in enumerate(argv[:-1]):
        if Path(arg).name == "qat4" or (arg == "qat4.cli" and i > 0 and argv[i - 1] == "-m"):
            return argv[i + 1] == "serve"
    return False


def _serve_port(argv: list[str]) -> int | None:
    """The port a `qat4 serve` command line names (DEFAULT_PORT when none); None when it is no number."""
    value = str(DEFAULT_PORT)
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--port="):
            value = arg.partition("=")[2]
    return int(value) if value.isdigit() else None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first); None when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat); None when it is not running."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def stale_reason(pid: int, *, start_ticks: int | None = None, port: int | None = None) -> str | None:
    """None when `pid` is a running qat4 serve, one that started at `start_ticks` and listens on
    `port` when these are given; else why not, as the end of a sentence."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return "which is not running"
    except OSError as exc:
        return f"whose command line cannot be read ({exc.strerror})"
    if not argv:  # exited, not yet collected by its parent
        return "which is not running"
    if not _is_qat4_serve(argv):
        return f"which is now another program ({shlex.join(argv)[:80]})"
    if start_ticks is not None and process_start(pid) != start_ticks:
        return "which is now another qat4 serve (it started after the pid file was written)"
    if port is not None and _serve_port(argv) != port:
        return f"which is a qat4 serve of another port ({shlex.join(argv)[:80]})"
    return None


def live_pid_file(path: Path) -> tuple[PidFile | None, str | None]:
    """The pid file at `path` when its pid is the running qat4 serve it recorded, else None; a stale
    one is removed, and the second value then says so in a sentence."""
    record = PidFile.read(path)
    if record is None:
        return None, None
    reason = stale_reason(record.pid, start_ticks=record.start_ticks)
    if reason is None:
        return record, None
    record.remove()
    return None, f"pid file {path} names pid {record.pid}, {reason}; removed it"


def _exited(pid: int) -> bool:
    """Whether `pid` has ended: no such process, or one ended whose parent has not collected it
    (collected here when it is this process's own child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


class ProcessById:
    """A process known only by its pid, with the part of subprocess.Popen terminate_then_kill uses."""

    def __init__(self, pid: int):
        self.pid = pid

    def send_signal(self, sig: int) -> None:
        """Signal the process, if it is still there."""
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise Qat4Error(f"pid {self.pid} belongs to another user; this one may not signal it") from None

    def wait(self, timeout: float | None = None) -> None:
        """Return once the process has ended; raise subprocess.TimeoutExpired after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not _exited(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(POLL_INTERVAL_S / 2)


def stop_pid(pid: int, timeout_s: float) -> bool:
    """SIGTERM `pid`, SIGKILL it if it is still there after `timeout_s`; True when it ended on SIGTERM."""
    return terminate_then_kill(ProcessById(pid), timeout_s)


def port_in_use(host: str, port: int) -> bool:
    """Whether something holds host:port: binding it as the server will (SO_REUSEADDR) fails with
    EADDRINUSE. Any other failure to bind is a Qat4Error."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise Qat4Error(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return False


def port_holder(host: str, port: int) -> str:
    """Who holds host:port, as 'qat4 serve pid N' or 'another program'."""
    response = fetch_health(url_for(host, port), PROBE_TIMEOUT_S)
    body = None if response is None else health_body(response)
    if body is None:
        return "another program"
    return f"qat4 serve pid {body['pid']}" if "pid" in body else "qat4 serve"


def _log_tail(path: Path, start: int) -> str:
    with open(path, "rb") as log:
        return output_tail(log, start)


def start_detached(command: list[str], *, env: dict[str, str], host: str, port: int, model: str, pid_path: Path,
                   log_path: Path, startup_timeout_s: float) -> PidFile:
    """Start `command` (a qat4 serve) in a session of its own with its output appended to `log_path`,
    write its pid file at `pid_path`, and return that once url/health answers 200 with the child's pid. When the server
    exits or does not answer within `startup_timeout_s` (or this process is interrupted), it is
    stopped, its pid file removed, and a Qat4Error carries the end of its log."""
    url = url_for(host, port)
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
    except OSError as exc:
        raise Qat4Error(f"cannot write the log file {log_path} ({exc.strerror})") from None
    with log:
        log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
        log.flush()
        start = log.tell()
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    record = PidFile(pid_path, child.pid, host, port, url, model, str(log_path), time.time(), command,
                     process_start(child.pid))
    try:
        record.write()
        print(f"qat4 serve: started pid {child.pid}, waiting for {url}/health (log: {log_path})", file=sys.stderr)
        wait_for_health(url, child.poll, partial(_log_tail, log_path, start), startup_timeout_s, child.pid)
    except BaseException:
        if child.poll() is None:
            terminate_then_kill(child, FAILED_START_GRACE_S)
        record.remove()
        raise
    return record
