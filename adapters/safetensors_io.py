"""Read safetensors files defensively: the header is parsed and checked before any tensor
is touched, and nothing here ever unpickles."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.adapters.errors import AdapterValidationError, pickle_refusal

MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 100_000

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype string, shape, byte range inside the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def looks_like_pickle(head: bytes) -> bool:
    """True for raw pickle bytes (protocol 2+) and for torch's zip-based ``torch.save`` format."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    return head.startswith(b"PK\x03\x04")


def read_header(
    path: str | os.PathLike, *, name: str = "adapter_model.safetensors"
) -> dict[str, TensorInfo]:
    """Parse and check the header of a safetensors file. Raises AdapterValidationError."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise AdapterValidationError(f"{name} is empty", field=name)
    header, n = _read_json_header(path, name, size)
    data_size = size - 8 - n
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad(name, "__metadata__ must map strings to strings")
    if len(header) > MAX_TENSORS:
        raise _bad(name, f"{len(header)} tensors, above the limit of {MAX_TENSORS}")
    infos = {key: _tensor_info(key, entry, data_size) for key, entry in header.items()}
    _check_packed(infos, data_size, name)
    return infos


def _read_json_header(path: Path, name: str, size: int) -> tuple[dict, int]:
    """The header's JSON object and its length ``n`` (bounded, inside the file); a file
    that is a pickle instead is refused as one."""
    with open(path, "rb") as f:
        head = f.read(8)
        try:
            if len(head) < 8:
                raise _bad(name, "the file is shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise _bad(
                    name, f"the header is {n} bytes, above the {MAX_HEADER_BYTES}-byte limit"
                )
            if 8 + n > size:
                raise _bad(name, "the header length runs past the end of the file")
            raw = f.read(n)
            try:
                header = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise _bad(name, f"the header is not valid JSON ({e})") from None
            if not isinstance(header, dict):
                raise _bad(name, "the header is not a JSON object")
        except AdapterValidationError:
            if looks_like_pickle(head):
                raise pickle_refusal(name) from None
            raise
    return header, n


def _tensor_info(key: str, entry: object, data_size: int) -> TensorInfo:
    """One header entry checked: a known dtype, a plausible shape, offsets inside the data
    section that hold exactly the shape's bytes."""
    if not isinstance(entry, dict):
        raise AdapterValidationError(f"{key}: header entry is not an object", field=key)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise AdapterValidationError(f"{key}: unknown dtype {dtype!r}", field=key)
    if not (
        isinstance(shape, list)
        and len(shape) <= 8
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise AdapterValidationError(f"{key}: invalid shape {shape!r}", field=key)
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise AdapterValidationError(
            f"{key}: data_offsets {offsets!r} fall outside the {data_size}-byte data section",
            field=key,
        )
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise AdapterValidationError(
            f"{key}: {offsets[1] - offsets[0]} bytes of data for a {dtype} tensor of shape "
            f"{tuple(shape)}, expected {expected}",
            field=key,
        )
    return TensorInfo(key, dtype, tuple(shape), offsets[0], offsets[1])


def _check_packed(infos: dict[str, TensorInfo], data_size: int, name: str) -> None:
    """The tensors' data cover the data section exactly: no overlap, gap or trailing bytes."""
    cursor = 0
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start != cursor:
            raise AdapterValidationError(
                f"{info.name}: tensor data overlaps or leaves a gap at byte {cursor}",
                field=info.name,
            )
        cursor = info.end
    if cursor != data_size:
        raise _bad(name, f"{data_size - cursor} trailing bytes after the last tensor")


def load_tensors(
    path: str | os.PathLike, names: list[str], *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Load the named tensors (header already checked by :func:`read_header`)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in names:
                t = f.get_tensor(key)
                out[key] = t.to(dtype).contiguous() if dtype is not None else t
    except SafetensorError as e:
        raise _bad(Path(path).name, str(e)) from None
    return out


def _bad(name: str, why: str) -> AdapterValidationError:
    return AdapterValidationError(f"{name} is not a valid safetensors file: {why}", field=name)
