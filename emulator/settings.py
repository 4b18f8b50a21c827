"""The local front's settings (``ARBITER_RUNTIME_*``) and those it shares with the rest of the stack.

What the endpoint *is* (variant, async concurrency, S3 paths, topics) is not configured here: it is
read from the serving template (``emulator.template``). These say where the front listens, which
endpoint name it answers to, where the container and the local S3/SNS are.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field
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
        pattern=r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$",
        description="The EndpointName the front answers to; any other is a ValidationError.",
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
        description="Async requests queued at most (SageMaker's queue has no documented bound; "
        "this one is in memory); beyond it InvokeEndpointAsync answers ServiceUnavailable.",
    )
    drain_s: float = Field(
        default=10.0, ge=0, description="On shutdown: time for async invocations in flight to end."
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
