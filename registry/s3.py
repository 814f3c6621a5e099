"""``S3Store``: adapter weights in an S3 bucket through boto3.

Works with AWS S3 and S3-compatible servers (MinIO, Cloudflare R2, Ceph RGW) through
``endpoint_url``. Large files go up in parts (``multipart_threshold``); every object
carries its sha256 as user metadata and every read is verified against it. Connect and
read timeouts and the retry budget come from
:class:`~loramux.registry.budgets.DependencyBudgets` (botocore's own defaults, 60 s
reads and 5 attempts, let a stalled store hold a request for minutes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loramux.registry.budgets import DependencyBudgets
from loramux.registry.errors import ObjectIntegrityError, ObjectNotFound, ObjectStoreError
from loramux.registry.files import sha256_file
from loramux.registry.store import (
    ObjectInfo,
    ObjectStore,
    _verify,
    check_key,
    discard,
)

_CHUNK = 1024 * 1024


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix/``.

    Credentials come from boto3's usual chain (environment, profile, instance role)
    unless given. ``endpoint_url`` switches to path-style addressing, which MinIO and
    most S3-compatible servers expect.
    """

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        region: str | None = None,
        endpoint_url: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
        client: Any = None,
        budgets: DependencyBudgets | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket:
            raise ValueError("S3Store needs a bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        b = budgets or DependencyBudgets()
        if client is None:
            client = boto3.client(
                "s3",
                region_name=region or os.environ.get("AWS_REGION") or "us-east-1",
                endpoint_url=endpoint_url,
                aws_access_key_id=aws_access_key_id,
                aws_secret_access_key=aws_secret_access_key,
                config=Config(
                    connect_timeout=b.s3_connect_timeout,
                    read_timeout=b.s3_read_timeout,
                    retries={"total_max_attempts": b.s3_max_attempts, "mode": "standard"},
                    s3={"addressing_style": "path"} if endpoint_url else {},
                ),
            )
        self.client = client
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize
        )

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, action: str, key: str, e: Exception) -> ObjectStoreError:
        return ObjectStoreError(
            f"S3 {action} of {key!r} in bucket {self.bucket!r} failed: {e}; check the bucket, "
            "credentials and endpoint_url"
        )

    @staticmethod
    def _is_missing(e: Exception) -> bool:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        return code in ("404", "NoSuchKey", "NotFound")

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (handy for MinIO and tests)."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self.client.create_bucket(Bucket=self.bucket)

    def put_file(self, key: str, path: str | os.PathLike, *, sha256: str | None = None) -> None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        digest = sha256_file(path)
        if sha256 is not None and digest != sha256:
            raise ObjectIntegrityError(
                f"{path}: sha256 {digest} instead of {sha256}; the file changed while uploading"
            )
        try:
            self.client.upload_file(
                str(path),
                self.bucket,
                self._key(key),
                ExtraArgs={"Metadata": {"sha256": digest}},
                Config=self.transfer,
            )
        except (ClientError, BotoCoreError, S3UploadFailedError) as e:
            raise self._error("upload", key, e) from e

    def get_file(self, key: str, dest: str | os.PathLike, *, sha256: str | None = None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        dest = Path(dest)
        h = hashlib.sha256()
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            recorded = response.get("Metadata", {}).get("sha256")
            with open(dest, "wb") as out:
                for chunk in response["Body"].iter_chunks(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
        except ClientError as e:
            discard(dest)
            if self._is_missing(e):
                raise ObjectNotFound(
                    f"object {key!r} is missing from bucket {self.bucket!r}"
                ) from None
            raise self._error("download", key, e) from e
        except (BotoCoreError, OSError) as e:
            discard(dest)
            raise self._error("download", key, e) from e
        _verify(key, h.hexdigest(), sha256 or recorded, dest)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if self._is_missing(e):
                return False
            raise self._error("head", key, e) from e
        except BotoCoreError as e:
            raise self._error("head", key, e) from e

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (ClientError, BotoCoreError) as e:
            if not self._is_missing(e):
                raise self._error("delete", key, e) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        from botocore.exceptions import BotoCoreError, ClientError

        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(base) :], obj["Size"], obj["LastModified"])
        except (ClientError, BotoCoreError) as e:
            raise self._error("list", prefix or "/", e) from e

    def remove_leftovers(self, min_age_s: float) -> list[str]:
        """Abort multipart uploads under the prefix begun more than ``min_age_s`` ago."""
        from datetime import datetime, timedelta, timezone

        from botocore.exceptions import BotoCoreError, ClientError

        cutoff = datetime.now(timezone.utc) - timedelta(seconds=min_age_s)
        aborted = []
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=f"{self.prefix}/" if self.prefix else "")
            for page in pages:
                for up in page.get("Uploads", []):
                    if up["Initiated"] <= cutoff:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        aborted.append(up["Key"])
        except (ClientError, BotoCoreError) as e:
            raise self._error("multipart cleanup", "/", e) from e
        return aborted

    def folder_uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{prefix}/"

    def describe(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"S3 bucket {self.bucket!r}{where} prefix {self.prefix!r}"
