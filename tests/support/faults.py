"""Real dependencies as subprocesses a test may stall (SIGSTOP), resume and kill: a
PostgreSQL cluster of its own (initdb in a temporary folder), ``redis-server`` and
``moto_server`` (S3) on free loopback ports. Each runs in its own process group, so a
signal reaches every process of it (PostgreSQL's backends too). The shared services the
other tests use are never touched."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.server import free_port


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


class Service:
    """One dependency process (group) started by ``argv``; stop/resume/kill/restart."""

    def __init__(self, name: str, argv: list[str], port: int, *, user: str | None = None,
                 env: dict[str, str] | None = None, lock_files: tuple[Path, ...] = ()) -> None:
        self.name, self.argv, self.port, self.user = name, argv, port, user
        self.lock_files = lock_files
        """Removed after a kill: a restarted container has a fresh process table, here the
        killed server may linger as a zombie nobody reaps and hold its pid."""
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Service:
        argv = ["runuser", "-u", self.user, "--", *self.argv] if self.user else self.argv
        self.log = Path(tempfile.gettempdir()) / f"loramux-faults-{self.name}-{self.port}.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True,
                                         env=self.env)
        try:
            wait_port(self.port)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; {self.name} said: {self.log.read_text()[-1500:]}") from None
        return self

    def _signal(self, sig: int) -> None:
        """Signal the process group and every descendant (PostgreSQL's backends call
        setsid(), so a group signal alone misses them)."""
        assert self.proc is not None
        pids = _descendants(self.proc.pid)
        os.killpg(self.proc.pid, sig)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stall(self) -> None:
        """SIGSTOP: the port stays open, the kernel accepts, nobody answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole group (a crash), waiting until the port is free."""
        if self.proc is None:
            return
        try:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None
        time.sleep(0.2)
        for lock in self.lock_files:
            lock.unlink(missing_ok=True)

    def restart(self) -> None:
        self.kill()
        self.start()


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def redis_service() -> Service:
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server")
    port = free_port()
    return Service("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], port)


def moto_service() -> Service:
    exe = Path(sys.executable).parent / "moto_server"
    if not exe.is_file():
        raise FileNotFoundError("moto_server (moto[server])")
    port = free_port()
    return Service("s3", [str(exe), "-H", "127.0.0.1", "-p", str(port)], port,
                   env={"MOTO_CALL_RESET_API": "false"})


def postgres_service() -> tuple[Service, str, Path]:
    """A fresh PostgreSQL cluster in a new folder under the system's temporary folder (as
    user ``postgres`` when run as root: that user must reach it, so not under pytest's
    private tmp); returns the service, its SQLAlchemy URL and the folder (to remove)."""
    bindir = _pg_bindir()
    user = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="loramux-faults-pg-"))
    if user:
        shutil.chown(root, user)
    data = root / "data"
    init = [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
            "--no-sync", "-E", "UTF8"]
    subprocess.run((["runuser", "-u", user, "--"] if user else []) + init, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    port = free_port()
    argv = [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"]
    return (Service("postgres", argv, port, user=user,
                    lock_files=(data / "postmaster.pid", root / f".s.PGSQL.{port}.lock")),
            f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", root)


def _pg_bindir() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    if not versions:
        raise FileNotFoundError("initdb (PostgreSQL server binaries)")
    return versions[-1]
