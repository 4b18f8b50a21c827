"""The local front's settings (``ARBITER_RUNTIME_*``) and those it shares with the rest of the stack.

What the endpoint *is* (variant, async concurrency, S3 paths, topics) is not configured here: it is
read from the serving template (``emulator.template``). These say where the front listens, which
endpoint name it answers to, where the container and the local S3/SNS are.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ARBITER_RUNTIME_", extra="ignore", populate_by_name=True
    )

    host: str = Field(default="127.0.0.1", description="Interface the runtime API listens on.")
    port: int = Field(default=8081, ge=0, le=65535, description="Its port (0: any free one).")
    endpoint_name: str = Field(
        default="arbiter",
        max_length=63,
        pattern=r"^$|^[a-zA-Z0-9](-*[a-zA-Z0-9])*$",
        description="The real-time endpoint's EndpointName (serving.yaml, EndpointMode realtime); "
        "empty: none. Any other name is a ValidationError.",
    )
    async_endpoint_name: str = Field(
        default="arbiter-async",
        max_length=63,
        pattern=r"^$|^[a-zA-Z0-9](-*[a-zA-Z0-9])*$",
        description="The asynchronous endpoint's EndpointName (EndpointMode async); empty: none.",
    )
    container_url: str = Field(
        default="http://127.0.0.1:8080", description="The container (`arbiter serve`) it invokes."
    )
    stack: str = Field(
        default="arbiter",
        description="The `arbiter deploy --stack` name the templates are evaluated for (topic names).",
    )
    invocation_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Real-time and streaming invocations: SageMaker gives the container 60 s.",
    )
    max_backlog: int = Field(
        default=10_000,
        ge=1,
        description="Async requests queued at most (SageMaker's queue has no documented bound); "
        "beyond it InvokeEndpointAsync answers ServiceUnavailable.",
    )
    async_queue: str | None = Field(
        default=None,
        description="The SQS queue the async backlog lives in (default <stack>-async-backlog), "
        "on ARBITER_AWS_ENDPOINT_URL: it outlives the front, so a restart answers what it held.",
    )
    visibility_s: int = Field(
        default=60,
        ge=5,
        le=43_200,
        description="The backlog queue's visibility timeout: a request a killed front held is "
        "taken again this long after its last heartbeat.",
    )
    body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A request body not received within this long is answered 408 and its "
        "connection closed (a half-sent body does not hold a handler).",
    )
    stream_idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A response stream whose client has taken nothing for this long (its kernel "
        "acknowledged nothing: a client that stops reading first fills its receive buffer) is "
        "dropped, and the container's call with it.",
    )
    input_prefix: str | None = Field(
        default=None,
        description="Where async InputLocations may be read (default s3://<bucket>/async/input/, "
        "what serving.yaml's SageMaker role may read); elsewhere is AccessDenied.",
    )
    aws: bool = Field(
        default=False,
        description="Without ARBITER_AWS_ENDPOINT_URL, use real AWS (`arbiter runtime --aws`).",
    )
    drain_s: float = Field(
        default=10.0,
        ge=0,
        description="On shutdown: time for async invocations in flight to end; those still "
        "running then go back to the queue.",
    )
    # Shared with the worker pool and the container: the same variables, read the same way.
    aws_endpoint_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("ARBITER_AWS_ENDPOINT_URL"),
        description="S3 and SNS endpoint (`arbiter local`'s moto server).",
    )
    aws_region: str = Field(
        default="us-east-1", validation_alias=AliasChoices("ARBITER_AWS_REGION")
    )
    bucket: str = Field(
        default="arbiter-jobs",
        min_length=3,
        validation_alias=AliasChoices("ARBITER_BUCKET"),
        description="The data bucket (the template's async paths are in it).",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        validation_alias=AliasChoices("ARBITER_MAX_IN_FLIGHT"),
        description="The template's MaxInFlight: the container's bound and the async "
        "MaxConcurrentInvocationsPerInstance (unset: the template's default).",
    )

    @model_validator(mode="after")
    def _one_endpoint_at_least(self) -> RuntimeSettings:
        if not (self.endpoint_name or self.async_endpoint_name):
            raise ValueError(
                "ARBITER_RUNTIME_ENDPOINT_NAME and _ASYNC_ENDPOINT_NAME are both empty"
            )
        if self.endpoint_name == self.async_endpoint_name:
            raise ValueError("the real-time and the async endpoint need names of their own")
        return self

    def readable_prefix(self) -> str:
        return self.input_prefix or f"s3://{self.bucket}/async/input/"

    def backlog_queue(self) -> str:
        return self.async_queue or f"{self.stack}-async-backlog"

    def client_kwargs(self) -> dict[str, str]:
        """aiobotocore client arguments; a loopback endpoint gets moto's dummy credentials when the
        environment has none (as the worker does)."""
        kwargs = {"region_name": self.aws_region}
        if self.aws_endpoint_url:
            kwargs["endpoint_url"] = self.aws_endpoint_url
            host = urlsplit(self.aws_endpoint_url).hostname or ""
            if host in _LOOPBACK and not os.environ.get("AWS_ACCESS_KEY_ID"):
                kwargs["aws_access_key_id"] = "testing"
                kwargs["aws_secret_access_key"] = "testing"
        return kwargs
