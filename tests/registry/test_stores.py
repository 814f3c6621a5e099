"""ObjectStore contract, run against FileStore and S3Store (moto on loopback)."""

from __future__ import annotations

import hashlib
import os

import pytest

from loramux.registry import ObjectIntegrityError, ObjectNotFound, ObjectStoreError
from loramux.registry.store import FileStore


def write(path, data: bytes):
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def test_put_get_list_delete(object_store, tmp_path):
    src, digest = write(tmp_path / "src", b"hello adapter")
    key = f"adapters/sha256/{digest}/adapter_model.safetensors"
    assert not object_store.exists(key)
    object_store.put_file(key, src, sha256=digest)
    assert object_store.exists(key)
    object_store.get_file(key, tmp_path / "out", sha256=digest)
    assert (tmp_path / "out").read_bytes() == b"hello adapter"
    object_store.put_file("adapters/other/x", src)
    listed = {o.key: o for o in object_store.list("adapters/sha256/")}
    assert list(listed) == [key] and listed[key].size == 13
    assert listed[key].last_modified.tzinfo is not None
    assert {o.key for o in object_store.list()} == {key, "adapters/other/x"}
    object_store.delete(key)
    object_store.delete(key)  # missing is fine
    assert not object_store.exists(key)
    with pytest.raises(ObjectNotFound):
        object_store.get_file(key, tmp_path / "gone")
    assert not (tmp_path / "gone").exists()
    assert object_store.describe()


def test_sha256_verified_on_write_and_read(object_store, tmp_path):
    src, digest = write(tmp_path / "src", b"payload")
    with pytest.raises(ObjectIntegrityError):
        object_store.put_file("k/a", src, sha256="0" * 64)
    assert not object_store.exists("k/a")
    object_store.put_file("k/a", src, sha256=digest)
    with pytest.raises(ObjectIntegrityError, match="corrupt"):
        object_store.get_file("k/a", tmp_path / "out", sha256="f" * 64)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/abs", "a//b", "", "a/", ".hidden"])
def test_bad_keys(object_store, tmp_path, key):
    src, _ = write(tmp_path / "src", b"x")
    with pytest.raises(ValueError):
        object_store.put_file(key, src)


def test_s3_multipart_and_recorded_sha(make_s3_store, tmp_path):
    store = make_s3_store(
        prefix="pfx", multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024
    )
    src, digest = write(tmp_path / "big", os.urandom(11 * 1024 * 1024))
    store.put_file("adapters/big", src, sha256=digest)
    head = store.client.head_object(Bucket=store.bucket, Key="pfx/adapters/big")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    assert head["Metadata"]["sha256"] == digest
    store.get_file("adapters/big", tmp_path / "out")  # verified against the recorded sha256
    assert hashlib.sha256((tmp_path / "out").read_bytes()).hexdigest() == digest
    store.client.put_object(
        Bucket=store.bucket, Key="pfx/adapters/big", Body=b"tampered", Metadata={"sha256": digest}
    )
    with pytest.raises(ObjectIntegrityError):
        store.get_file("adapters/big", tmp_path / "out2")
    assert [o.key for o in store.list()] == ["adapters/big"]


def test_s3_errors_are_actionable(moto_endpoint, tmp_path):
    from loramux.registry.s3 import S3Store

    store = S3Store(
        "no-such-bucket",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    src, _ = write(tmp_path / "src", b"x")
    with pytest.raises(ObjectStoreError, match="bucket 'no-such-bucket'"):
        store.put_file("k", src)


def test_filestore_atomic_replace(tmp_path):
    store = FileStore(tmp_path / "root")
    a, _ = write(tmp_path / "a", b"a" * 10)
    b, _ = write(tmp_path / "b", b"b" * 20)
    store.put_file("x/y", a)
    store.put_file("x/y", b)
    assert (tmp_path / "root" / "x" / "y").read_bytes() == b"b" * 20
    assert list((tmp_path / "root" / ".tmp").iterdir()) == []
    store.delete("x/y")
    assert not (tmp_path / "root" / "x").exists()
