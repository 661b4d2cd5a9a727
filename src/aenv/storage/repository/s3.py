"""`S3Store`: the blob store in a bucket of any S3-compatible service (AWS, MinIO, Ceph, moto).

A PUT of one object is atomic in S3 and, since 2020, reads and listings are strongly consistent,
which is all the repository needs (see `store.py`). boto3 clients are thread-safe, so one client
serves the repository's whole thread pool; its connection pool is sized to match. Custom
endpoints get path-style addressing, which every S3-compatible server understands.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from aenv.storage.repository.errors import BlobNotFound, StoreUnavailable
from aenv.storage.repository.store import BlobInfo

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


def _not_found(error: ClientError) -> bool:
    return str(error.response.get("Error", {}).get("Code")) in _NOT_FOUND


class S3Store:
    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        prefix: str = "",
        max_connections: int = 16,
    ) -> None:
        """Credentials not given here come from boto3's usual chain (environment, config files,
        instance roles). `prefix` puts the repository below a folder of a shared bucket."""
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        config = Config(
            max_pool_connections=max_connections,
            retries={"max_attempts": 5, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=config,
        )

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def get(self, key: str) -> bytes:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            body: bytes = response["Body"].read()
        except ClientError as e:
            if _not_found(e):
                raise BlobNotFound(key) from None
            raise StoreUnavailable(f"S3 bucket {self.bucket} refused to read {key}: {e}") from e
        except BotoCoreError as e:  # no connection, a timeout, a body cut short
            raise StoreUnavailable(f"S3 bucket {self.bucket} did not answer for {key}: {e}") from e
        return body

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except ClientError as e:
            if _not_found(e):
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def list(self, prefix: str) -> Iterator[BlobInfo]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        for page in pages:
            for obj in page.get("Contents", ()):
                key = obj["Key"][len(self.prefix) :]
                yield BlobInfo(key, int(obj["Size"]), obj["LastModified"].timestamp())
