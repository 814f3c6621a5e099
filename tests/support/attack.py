"""Start and stop an attacking tenant's client in its own process (``attack_client.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CLIENT = Path(__file__).with_name("attack_client.py")


class Attack:
    """``workers`` concurrent requests of ``bodies`` (cycled) to ``url`` as ``key``, from a
    separate process; :attr:`done` / :attr:`failed` count the finished ones so far."""

    def __init__(self, url: str, key: str, bodies: list[dict], workers: int, repeat: bool) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="attack-")
        self._progress = Path(self._dir.name) / "progress.json"
        self._cfg = {"url": url, "key": key, "bodies": bodies, "workers": workers,
                     "repeat": repeat, "progress": str(self._progress)}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Attack:
        self.proc = subprocess.Popen([sys.executable, str(CLIENT), json.dumps(self._cfg)])
        return self

    def _counts(self) -> dict:
        try:
            return json.loads(self._progress.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"done": 0, "failed": 0}

    @property
    def done(self) -> int:
        return self._counts()["done"]

    @property
    def failed(self) -> int:
        return self._counts()["failed"]

    def alive(self) -> bool:
        """False once the client exited by itself (it crashed, or ``repeat`` was off and every
        request ended)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._dir.cleanup()
