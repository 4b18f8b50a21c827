"""The front's state, shared by its routes through one typed app key. The async backlog has a key
of its own (``emulator.backlog.BACKLOG``), so that nothing here imports the async modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from emulator.container import Container
from emulator.errors import ValidationError, endpoint_not_found
from emulator.metrics import RuntimeMetrics
from emulator.settings import RuntimeSettings
from emulator.template import ACCOUNT, AsyncSpec, EndpointSpec

INVOKED_VARIANT = "x-Amzn-Invoked-Production-Variant"
# Headers of features this single-model, single-container endpoint does not have.
UNSUPPORTED = (
    "X-Amzn-SageMaker-Target-Model",
    "X-Amzn-SageMaker-Target-Container-Hostname",
    "X-Amzn-SageMaker-Inference-Component",
    "X-Amzn-SageMaker-Session-Id",
    "X-Amzn-SageMaker-Enable-Explanations",
)


OPERATION_MODES = {
    "InvokeEndpoint": "realtime",
    "InvokeEndpointWithResponseStream": "realtime",
    "InvokeEndpointAsync": "async",
}


@dataclass
class Front:
    settings: RuntimeSettings
    endpoints: dict[str, EndpointSpec]  # EndpointName -> what the template deploys for it
    metrics: RuntimeMetrics
    clock: Callable[[], float]
    container: Container | None = None  # opened at start-up
    topics: dict[str, str] = field(default_factory=dict)

    def check(self, request: web.Request, operation: str) -> EndpointSpec:
        """The endpoint named, in the mode ``operation`` needs; its variant and the headers this
        endpoint can serve."""
        name = request.match_info["name"]
        spec = self.endpoints.get(name)
        if spec is None:
            raise endpoint_not_found(name)
        if spec.mode != OPERATION_MODES[operation]:
            # An endpoint with an AsyncInferenceConfig accepts only asynchronous invocations, and
            # one without it none (the wording is ours; the code is AWS's).
            kind = "an asynchronous" if spec.mode == "async" else "a real-time"
            use = "InvokeEndpointAsync" if spec.mode == "async" else "InvokeEndpoint"
            raise ValidationError(
                f"Endpoint {name} of account {ACCOUNT} is {kind} inference endpoint: "
                f"{operation} is not supported for it; use {use}."
            )
        variant = request.headers.get("X-Amzn-SageMaker-Target-Variant")
        if variant is not None and variant != spec.variant:
            raise ValidationError(
                f"Variant {variant} not found for endpoint {name}; its variant is {spec.variant}."
            )
        for header in UNSUPPORTED:
            if header in request.headers:
                raise ValidationError(
                    f"{header} is not supported by endpoint {name}: it serves one model in one "
                    "container."
                )
        return spec

    def asynchronous(self) -> tuple[str, AsyncSpec] | None:
        """The async endpoint's name and config, if the front serves one."""
        for name, spec in self.endpoints.items():
            if spec.asynchronous is not None:
                return name, spec.asynchronous
        return None

    def require_container(self) -> Container:
        assert self.container is not None, "the front is not started"
        return self.container


FRONT = web.AppKey("front", Front)
