"""A transform job's input objects, as ``TransformS3DataSource`` names them, and where each one's
``.out`` goes.

``S3Prefix``: every object under the prefix. ``ManifestFile``: the objects a manifest lists, a JSON
array whose first element is ``{"prefix": "s3://bucket/some/prefix/"}`` and whose others are paths
relative to it (each object is the prefix followed by the path, as SageMaker reads it). Either
way an object's output is ``<S3OutputPath>/<its key relative to the prefix's folder>.out``.
``AugmentedManifestFile`` is refused before anything runs (``infra.transform``): SageMaker
documents it as not compatible with batch transform.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from arbiter.settings import MB
from emulator.s3io import S3Uri, parse_uri

MANIFEST_CAP = 64 * MB  # a manifest is read whole (a million paths are ~100 MB: split the job)


class InputsFailed(Exception):
    """The job's inputs cannot be listed; the message is its FailureReason."""


@dataclass(frozen=True)
class Input:
    source: S3Uri
    output: S3Uri


def output_for(key: str, prefix: S3Uri, output: S3Uri) -> S3Uri:
    """``<output>/<key relative to the prefix's folder>.out``."""
    folder = prefix.key[: prefix.key.rfind("/") + 1]
    return output.join(key[len(folder) :] + ".out")


async def job_inputs(s3: Any, data_type: str, uri: str, output_uri: str) -> list[Input]:
    """The objects to transform, in order, each with its output; never empty."""
    output = parse_uri(output_uri)
    if data_type == "ManifestFile":
        prefix, keys = await _manifest(s3, parse_uri(uri))
        where = f"in the manifest {uri}"
    else:
        prefix = parse_uri(uri)
        keys = await _listed(s3, prefix)
        where = f"under {uri}"
    if not keys:
        raise InputsFailed(f"ClientError: no input objects {where}")
    return [Input(S3Uri(prefix.bucket, key), output_for(key, prefix, output)) for key in keys]


async def _listed(s3: Any, prefix: S3Uri) -> list[str]:
    keys: list[str] = []
    token: dict[str, str] = {}
    while True:
        got = await s3.list_objects_v2(Bucket=prefix.bucket, Prefix=prefix.key, **token)
        keys += [o["Key"] for o in got.get("Contents", []) if not o["Key"].endswith("/")]
        if not got.get("IsTruncated"):
            return keys
        token = {"ContinuationToken": got["NextContinuationToken"]}


async def _manifest(s3: Any, uri: S3Uri) -> tuple[S3Uri, list[str]]:
    """The manifest's prefix and its objects' keys (each once, in the manifest's order)."""
    got = await s3.get_object(Bucket=uri.bucket, Key=uri.key)
    if int(got.get("ContentLength", 0)) > MANIFEST_CAP:
        got["Body"].close()
        raise InputsFailed(
            f"ClientError: the manifest {uri} is over {MANIFEST_CAP // MB} MB; split the job"
        )
    async with got["Body"] as body:
        raw = await body.read()
    try:
        entries = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputsFailed(f"ClientError: the manifest {uri} is not JSON ({exc})") from exc
    prefix = _prefix(entries, uri)
    paths = entries[1:]
    bad = [n for n, p in enumerate(paths, start=1) if not isinstance(p, str) or not p]
    if bad:
        raise InputsFailed(
            f"ClientError: the manifest {uri}'s element {bad[0]} is not a path relative to its "
            "prefix (a non-empty string)"
        )
    return prefix, list(dict.fromkeys(prefix.key + path for path in paths))


def _prefix(entries: Any, uri: S3Uri) -> S3Uri:
    shape = (
        f'ClientError: the manifest {uri} is a JSON array whose first element is {{"prefix": '
        '"s3://bucket/prefix/"}, then the paths relative to it'
    )
    if not (isinstance(entries, list) and entries and isinstance(entries[0], dict)):
        raise InputsFailed(shape)
    value = entries[0].get("prefix")
    if not isinstance(value, str):
        raise InputsFailed(shape)
    try:
        return parse_uri(value)
    except ValueError as exc:
        raise InputsFailed(f"ClientError: the manifest {uri}'s prefix: {exc}") from exc
