"""The notification SageMaker publishes for an async request (``eventName`` ``InferenceResult``) on
the template's success or error topic, raw JSON as an application reads it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from arbiter.logging import get_logger
from emulator.async_request import AsyncRequest, now_iso

log = get_logger("arbiter.runtime")
PUBLISH_TRIES = 3


@dataclass(frozen=True)
class InferenceResult:
    """What became of a request, as the notification of that name says it: ``Completed`` or
    ``Failed``, and what was written."""

    status: str
    content_type: str | None = None
    reason: str | None = None
    output_written: bool = False
    failure_written: bool = False


def message(request: AsyncRequest, outcome: InferenceResult, *, endpoint: str, region: str) -> str:
    request_params: dict[str, Any] = {"endpointName": endpoint}
    if request.content_type is not None:
        request_params["contentType"] = request.content_type
    if request.input_location is not None:
        request_params["inputLocation"] = str(request.input_location)
    response_params: dict[str, Any] = {}
    if outcome.content_type is not None:
        response_params["contentType"] = outcome.content_type
    if outcome.output_written:
        response_params["outputLocation"] = str(request.output)
    elif outcome.failure_written and request.failure is not None:
        response_params["failureLocation"] = str(request.failure)
    body: dict[str, Any] = {
        "awsRegion": region,
        "eventTime": now_iso(),
        "receivedTime": request.received,
        "invocationStatus": outcome.status,
        "requestParameters": request_params,
        "responseParameters": response_params,
        "inferenceId": request.inference_id,
        "eventVersion": "1.0",
        "eventSource": "aws:sagemaker",
        "eventName": "InferenceResult",
    }
    if outcome.reason is not None:
        body["failureReason"] = outcome.reason
    return json.dumps(body)


async def publish(sns: Any, topic: str, text: str, inference_id: str) -> bool:
    """Publish, retried; False (logged with the inference id) if it never got through."""
    for attempt in range(PUBLISH_TRIES):
        try:
            await sns.publish(TopicArn=topic, Message=text)
            return True
        except Exception as exc:
            if _topic_gone(exc):  # the SNS server restarted without its state: made anew
                with contextlib.suppress(Exception):
                    await sns.create_topic(Name=topic.rsplit(":", 1)[-1])
            log.warning(
                "async_notification_retry"
                if attempt + 1 < PUBLISH_TRIES
                else "async_notification_failed",
                inference_id=inference_id,
                topic=topic,
                error=repr(exc),
            )
            if attempt + 1 < PUBLISH_TRIES:
                await asyncio.sleep(0.2 * 2**attempt)
    return False


def _topic_gone(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in {"NotFound", "NotFoundException"}
