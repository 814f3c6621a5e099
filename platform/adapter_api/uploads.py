"""Streaming intake of adapter uploads: multipart bodies and ``s3://`` sources go
straight to files in a scratch folder, chunk by chunk, under a size cap (413 past it).
Nothing is buffered whole in memory.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from loramux.platform.errors import BadRequest, PayloadTooLarge
from loramux.registry.chat import CHAT_FILES, MAX_CHAT_TEMPLATE_CHARS

MAX_FILES = 16
MAX_FIELD_BYTES = 64 * 1024
MAX_TEMPLATE_FIELD_BYTES = 4 * MAX_CHAT_TEMPLATE_CHARS
"""The ``chat_template`` form field's own cap (the service then applies the server's
``max_chat_template_chars``, naming it)."""
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_filename(name: str, index: int) -> str:
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = _SAFE.sub("_", base).lstrip(".")[:128]
    return base or f"upload-{index}"


@dataclass
class Received:
    """What an upload delivered: plain form fields and the files written to ``folder``."""

    folder: Path
    fields: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    size: int = 0

    def cleanup(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def source(self) -> Path:
        """One uploaded file (an archive) as is; several files as their folder."""
        if not self.files:
            raise BadRequest(
                "no adapter files in the upload: send adapter_config.json and "
                "adapter_model.safetensors, or one .tar.gz / .zip archive, as file parts",
                param="file",
            )
        if len(self.files) == 1 and self.files[0].name not in (
            "adapter_config.json", "adapter_model.safetensors"
        ):
            return self.files[0]
        return self.folder


class _Sink:
    """python-multipart callbacks that write file parts to disk as they arrive."""

    def __init__(self, received: Received, max_bytes: int) -> None:
        self.r = received
        self.max_bytes = max_bytes
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._file: BinaryIO | None = None
        self._field: str | None = None
        self._value = bytearray()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self.part_begin,
            "on_header_field": lambda d, s, e: self._add("_header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("_header_value", d[s:e]),
            "on_header_end": self.header_end,
            "on_headers_finished": self.headers_finished,
            "on_part_data": self.part_data,
            "on_part_end": self.part_end,
        }

    def _add(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def part_begin(self) -> None:
        self._headers = {}
        self._file = None
        self._field = None
        self._value = bytearray()

    def header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = b""
        self._header_value = b""

    def headers_finished(self) -> None:
        disposition = self._headers.get(b"content-disposition", b"")
        _, options = parse_options_header(disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if filename is not None:
            if len(self.r.files) >= MAX_FILES:
                raise BadRequest(f"at most {MAX_FILES} files per upload", param="file")
            fname = safe_filename(filename.decode("utf-8", "replace"), len(self.r.files))
            path = self.r.folder / fname
            n = 1
            while path.exists():
                path = self.r.folder / f"{n}-{fname}"
                n += 1
            self._file = open(path, "wb")  # noqa: SIM115 - closed in part_end
            self.r.files.append(path)
        else:
            self._field = name

    def part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._file is not None:
            self.r.size += len(chunk)
            if self.r.size > self.max_bytes:
                raise PayloadTooLarge(f"the upload is larger than {self.max_bytes} bytes")
            self._file.write(chunk)
        elif self._field is not None:
            self._value += chunk
            cap = MAX_TEMPLATE_FIELD_BYTES if self._field == "chat_template" else MAX_FIELD_BYTES
            if len(self._value) > cap:
                raise BadRequest(f"form field {self._field!r} is too long", param=self._field)

    def part_end(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        elif self._field is not None:
            self.r.fields[self._field] = self._value.decode("utf-8", "replace")
            self._field = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


async def receive_multipart(request: Request, scratch: Path, max_bytes: int) -> Received:
    """Stream a multipart/form-data body into a new folder under ``scratch``."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise BadRequest("expected multipart/form-data with a boundary", param="content-type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes + 1024 * 1024:
        raise PayloadTooLarge(f"the upload is larger than {max_bytes} bytes")
    scratch.mkdir(parents=True, exist_ok=True)
    received = Received(Path(tempfile.mkdtemp(prefix="upload-", dir=scratch)))
    sink = _Sink(received, max_bytes)
    try:
        parser = MultipartParser(boundary, sink.callbacks())
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except (BadRequest, PayloadTooLarge):
        sink.close()
        received.cleanup()
        raise
    except ClientDisconnect:
        sink.close()
        received.cleanup()
        raise BadRequest("the client disconnected during the upload") from None
    except Exception as e:  # malformed multipart
        sink.close()
        received.cleanup()
        raise BadRequest(f"malformed multipart body: {e}", param="file") from None
    sink.close()
    return received


def read_local(path: Path, scratch: Path, max_bytes: int) -> Received:
    """Copy a local adapter, a PEFT folder (its ``adapter_config.json`` and
    ``adapter_model.safetensors``, and its ``chat_template.jinja`` and
    ``tokenizer_config.json``, ``tokenizer.json`` and ``added_tokens.json`` when there: the
    registry checks its added tokens against the base's and stores its own for serving) or one archive file, into a new folder under
    ``scratch``, under the size cap. Symlinks are never followed (``O_NOFOLLOW``) and only
    regular files are read; the caller decided that ``path`` may be read. Runs in a
    worker thread."""
    import os
    import stat

    names = ["adapter_config.json", "adapter_model.safetensors", *CHAT_FILES, "tokenizer.json",
             "added_tokens.json"] \
        if path.is_dir() else [None]
    scratch.mkdir(parents=True, exist_ok=True)
    received = Received(Path(tempfile.mkdtemp(prefix="local-", dir=scratch)))
    try:
        for i, name in enumerate(names):
            src = path / name if name is not None else path
            try:
                fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                continue  # the registry names what is missing
            except OSError as e:
                raise BadRequest(f"cannot read {src.name}: {e.strerror}", param="source") from None
            dest = received.folder / safe_filename(src.name, i)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise BadRequest(f"{src.name} is not a regular file", param="source")
                with open(dest, "wb") as out:
                    while chunk := f.read(1 << 20):
                        received.size += len(chunk)
                        if received.size > max_bytes:
                            raise PayloadTooLarge(f"the adapter is larger than {max_bytes} bytes")
                        out.write(chunk)
            received.files.append(dest)
        return received
    except BaseException:
        received.cleanup()
        raise


def parse_bool(value: str | None, param: str) -> bool:
    if value is None or value == "":
        return False
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise BadRequest(f"{param} must be true or false, got {value[:40]!r}", param=param)


def parse_preset_field(value: str | None) -> dict | None:
    if value is None or value.strip() == "":
        return None
    try:
        preset = json.loads(value)
    except ValueError:
        raise BadRequest("preset must be a JSON object", param="preset") from None
    if preset is not None and not isinstance(preset, dict):
        raise BadRequest("preset must be a JSON object", param="preset")
    return preset


# --- s3:// sources ------------------------------------------------------------------------
class NothingToRead(BadRequest):
    """No object at an ``s3://`` source (400 here; vLLM's load API says 404)."""


_S3_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,62})/?(.*)$")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    m = _S3_RE.match(uri or "")
    if not m:
        raise BadRequest(f"source must be an s3://bucket/key URI, got {uri[:80]!r}", param="source")
    return m.group(1), m.group(2)


def fetch_s3(uri: str, scratch: Path, max_bytes: int, *, endpoint_url: str | None,
             region: str | None = None, client: Any = None) -> Received:
    """Download ``s3://bucket/key`` (one archive) or ``s3://bucket/prefix/`` (an adapter
    folder) into a new folder under ``scratch``; runs in a worker thread."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = parse_s3_uri(uri)
    if client is None:
        client = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1",
            config=Config(s3={"addressing_style": "path"} if endpoint_url else {},
                          retries={"max_attempts": 3, "mode": "standard"}),
        )
    scratch.mkdir(parents=True, exist_ok=True)
    received = Received(Path(tempfile.mkdtemp(prefix="s3-", dir=scratch)))
    try:
        objects: list[tuple[str, int]] = []
        if key and not key.endswith("/"):
            try:
                head = client.head_object(Bucket=bucket, Key=key)
                objects = [(key, int(head["ContentLength"]))]
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise
        if not objects:
            prefix = key if not key or key.endswith("/") else key + "/"
            listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=MAX_FILES + 1)
            objects = [
                (o["Key"], int(o["Size"])) for o in listing.get("Contents", [])
                if not o["Key"].endswith("/") and "/" not in o["Key"][len(prefix):]
            ]
            if not objects:
                raise NothingToRead(f"nothing to read at {uri}", param="source")
            if len(objects) > MAX_FILES:
                raise BadRequest(f"more than {MAX_FILES} objects under {uri}", param="source")
        total = sum(size for _, size in objects)
        if total > max_bytes:
            raise PayloadTooLarge(f"{uri} holds {total} bytes, above the limit of {max_bytes}")
        for i, (obj_key, _) in enumerate(objects):
            path = received.folder / safe_filename(obj_key, i)
            body = client.get_object(Bucket=bucket, Key=obj_key)["Body"]
            with open(path, "wb") as out:
                while chunk := body.read(1 << 20):
                    received.size += len(chunk)
                    if received.size > max_bytes:
                        raise PayloadTooLarge(f"{uri} is larger than {max_bytes} bytes")
                    out.write(chunk)
            received.files.append(path)
        return received
    except (BadRequest, PayloadTooLarge):
        received.cleanup()
        raise
    except (ClientError, BotoCoreError) as e:
        received.cleanup()
        raise BadRequest(f"cannot read {uri}: {e}", param="source") from None
    except BaseException:
        received.cleanup()
        raise
