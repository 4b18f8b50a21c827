"""The front's state, shared by its routes through one typed app key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from emulator.container import Container
from emulator.errors import ValidationError, endpoint_not_found
from emulator.metrics import RuntimeMetrics
from emulator.settings import RuntimeSettings
from emulator.template import EndpointSpec

if TYPE_CHECKING:
    from emulator.asynchronous import AsyncQueue

INVOKED_VARIANT = "x-Amzn-Invoked-Production-Variant"
# Headers of features this single-model, single-container endpoint does not have.
UNSUPPORTED = (
    "X-Amzn-SageMaker-Target-Model",
    "X-Amzn-SageMaker-Target-Container-Hostname",
    "X-Amzn-SageMaker-Inference-Component",
    "X-Amzn-SageMaker-Session-Id",
    "X-Amzn-SageMaker-Enable-Explanations",
)


@dataclass
class Front:
    settings: RuntimeSettings
    spec: EndpointSpec
    metrics: RuntimeMetrics
    clock: Callable[[], float]
    container: Container | None = None  # opened at start-up
    queue: AsyncQueue | None = None
    topics: dict[str, str] = field(default_factory=dict)

    def check(self, request: web.Request) -> None:
        """The endpoint name, the variant and the headers this endpoint can serve."""
        name = request.match_info["name"]
        if name != self.settings.endpoint_name:
            raise endpoint_not_found(name)
        variant = request.headers.get("X-Amzn-SageMaker-Target-Variant")
        if variant is not None and variant != self.spec.variant:
            raise ValidationError(
                f"Variant {variant} not found for endpoint {name}; its variant is {self.spec.variant}."
            )
        for header in UNSUPPORTED:
            if header in request.headers:
                raise ValidationError(
                    f"{header} is not supported by endpoint {name}: it serves one model in one "
                    "container."
                )

    def require_container(self) -> Container:
        assert self.container is not None, "the front is not started"
        return self.container


FRONT = web.AppKey("front", Front)
