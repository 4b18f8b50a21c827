"""SageMaker Runtime's errors as they travel: the HTTP status, the ``x-amzn-ErrorType`` header that
botocore reads the code from (rest-json), and a JSON body with the modeled fields.

``ModelError`` is the one an application meets most: a container 4xx or 5xx becomes a 424 carrying
``OriginalStatusCode`` and ``OriginalMessage`` (the container's body, as text), worded as SageMaker
words it ("Received client error (422) from primary with message ..."), so that retry code keyed on
either runs the same here and on AWS. The others carry a ``Message`` only.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar

from aiohttp import web

from emulator.template import ACCOUNT

# botocore splits the header at ':' and keeps the code; AWS appends its namespace the same way.
_NAMESPACE = "http://internal.amazon.com/coral/com.amazon.sagemaker/"
TIMED_OUT = (
    "Your invocation timed out while waiting for a response from container primary. Review the "
    "latency metrics for each container in Amazon CloudWatch, resolve the issue, and try again."
)


def request_id() -> str:
    return str(uuid.uuid4())


class RuntimeApiError(Exception):
    """An error of the SageMaker Runtime API (not of the container)."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "InternalFailure"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def fields(self) -> dict[str, Any]:
        return {"Message": self.message}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.fields()).encode(),
            content_type="application/json",
            headers={
                "x-amzn-ErrorType": f"{self.code}:{_NAMESPACE}",
                "x-amzn-RequestId": request_id(),
            },
        )


class ValidationError(RuntimeApiError):
    status = 400
    code = "ValidationError"


class ServiceUnavailable(RuntimeApiError):
    status = 503
    code = "ServiceUnavailable"


class RequestTimeout(RuntimeApiError):
    """The request's body did not arrive in time (the front closes the connection after)."""

    status = 408
    code = "RequestTimeout"


class ModelNotReady(RuntimeApiError):
    """The container does not pass its health check yet (SageMaker: ModelNotReadyException)."""

    status = 429
    code = "ModelNotReadyException"


class InternalFailure(RuntimeApiError):
    status = 500
    code = "InternalFailure"


class UnknownOperation(RuntimeApiError):
    status = 404
    code = "UnknownOperationException"


def endpoint_not_found(name: str) -> ValidationError:
    return ValidationError(f"Endpoint {name} of account {ACCOUNT} not found.")


class ModelError(RuntimeApiError):
    """The container answered 4xx or 5xx (``original_status``), or not in time (0)."""

    status = 424
    code = "ModelError"

    def __init__(self, original_status: int, original_message: str, *, endpoint: str, region: str):
        kind = "client" if 400 <= original_status < 500 else "server"
        group = f"/aws/sagemaker/Endpoints/{endpoint}"
        super().__init__(
            f"Received {kind} error ({original_status}) from primary with message "
            f'"{original_message}". See https://{region}.console.aws.amazon.com/cloudwatch/home?'
            f"region={region}#logEventViewer:group={group} in account {ACCOUNT} for more "
            "information."
        )
        self.original_status = original_status
        self.original_message = original_message
        self.error_code = (
            "CLIENT_ERROR_FROM_MODEL" if kind == "client" else "INTERNAL_FAILURE_FROM_MODEL"
        )
        self.log_stream_arn = f"arn:aws:logs:{region}:{ACCOUNT}:log-group:{group}"

    def fields(self) -> dict[str, Any]:
        return {
            "ErrorCode": self.error_code,
            "LogStreamArn": self.log_stream_arn,
            "Message": self.message,
            "OriginalMessage": self.original_message,
            "OriginalStatusCode": self.original_status,
        }


@web.middleware
async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """The one place an error becomes a response; anything unexpected is an InternalFailure."""
    try:
        response: web.StreamResponse = await handler(request)
    except RequestTimeout as exc:
        return await _closing(request, exc.response())
    except RuntimeApiError as exc:
        return exc.response()
    except web.HTTPNotFound:
        return UnknownOperation(f"no operation at {request.method} {request.path}").response()
    except web.HTTPMethodNotAllowed:
        return UnknownOperation(f"no operation at {request.method} {request.path}").response()
    except web.HTTPRequestEntityTooLarge:
        return ValidationError("Request payload is larger than the operation allows.").response()
    except Exception as exc:  # logged by the caller's log line; the client gets AWS's shape
        from arbiter.logging import get_logger

        get_logger("arbiter.runtime").error("internal_failure", error=repr(exc), exc_info=exc)
        return InternalFailure("An internal failure occurred; see the front's log.").response()
    return response


async def _closing(request: web.Request, response: web.Response) -> web.Response:
    """``response`` sent, then its connection closed at once: the rest of a body too slow to
    arrive is not waited for (aiohttp lingers up to 10 s for it, the connection held open)."""
    response.force_close()  # Connection: close
    await response.prepare(request)
    await response.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()  # what was written goes out first, then the close
    return response
