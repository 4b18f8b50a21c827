"""Which failures of an ``arbiter`` command are the user's to fix, and the one line that says what
to change: the project's own errors, a setting that does not validate, a file that is not there,
and the credential and connection errors of the AWS clients. Anything else is a bug and keeps its
traceback.

botocore is never imported here (the core imports no AWS library): an error of its can only have
been raised if a command loaded it, so its exception classes are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from arbiter.errors import ArbiterError

# botocore's errors that mean "no credentials, wrong credentials or nothing to connect to".
_BOTOCORE = {
    "NoCredentialsError": "no AWS credentials found: set AWS_PROFILE or AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (or run on a role), or ARBITER_AWS_ENDPOINT_URL for a local endpoint",
    "PartialCredentialsError": "incomplete AWS credentials",
    "NoRegionError": "no AWS region: set AWS_DEFAULT_REGION (or AWS_REGION)",
    "ProfileNotFound": "AWS profile not found",
    "EndpointConnectionError": "cannot reach the AWS endpoint: check ARBITER_AWS_ENDPOINT_URL",
    "ConnectTimeoutError": "cannot reach the AWS endpoint: check ARBITER_AWS_ENDPOINT_URL",
    "TokenRetrievalError": "cannot refresh the AWS SSO token",
}
# ClientError codes that name the caller's credentials or permissions, not a request of ours.
_DENIED = {
    "AccessDenied",
    "AccessDeniedException",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidAccessKeyId",
    "InvalidClientTokenId",
    "InvalidToken",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
}


# A path the command was given (or reads from its settings) that is not there or cannot be read.
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def one_line(text: str) -> str:
    return " ".join(text.split())


def refusal(exc: BaseException) -> str | None:
    """The one line for a failure the user can fix, or None for a bug."""
    if isinstance(exc, ArbiterError):
        return one_line(exc.message)
    if isinstance(exc, BaseExceptionGroup):  # a task group's: a refusal only if all of it is
        lines = [refusal(e) for e in exc.exceptions]
        return None if None in lines else "; ".join(dict.fromkeys(str(x) for x in lines))
    if isinstance(exc, ValidationError):
        return _invalid_setting(exc)
    if isinstance(exc, _PATH_ERRORS) and exc.filename is not None:
        return one_line(f"{exc.filename}: {exc.strerror}")
    return _aws(exc)


def _settings_class(title: str) -> type[BaseSettings] | None:
    pending: list[type[BaseSettings]] = [BaseSettings]
    while pending:
        cls = pending.pop()
        if cls.__name__ == title and cls is not BaseSettings:
            return cls
        pending.extend(cls.__subclasses__())
    return None


def _invalid_setting(exc: ValidationError) -> str | None:
    """A settings object that does not validate names its environment variables; any other
    model's validation error is a bug."""
    settings = _settings_class(exc.title)
    if settings is None:
        return None
    prefix = str(settings.model_config.get("env_prefix") or "")
    parts = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        name = f"{prefix}{field}".upper() if field else settings.__name__
        given = f"={error['input']!r}" if field and not isinstance(error["input"], dict) else ""
        parts.append(f"{name}{given}: {error['msg']}")
    return one_line("invalid setting " + "; ".join(parts))


def _aws(exc: BaseException) -> str | None:
    exceptions: Any = sys.modules.get("botocore.exceptions")
    if exceptions is None:
        return None
    for name, what in _BOTOCORE.items():
        cls = getattr(exceptions, name, None)
        if cls is not None and isinstance(exc, cls):
            return one_line(f"{what} ({exc})")
    client_error = getattr(exceptions, "ClientError", None)
    if client_error is not None and isinstance(exc, client_error):
        error = getattr(exc, "response", {}).get("Error", {})
        if error.get("Code") in _DENIED:
            operation = getattr(exc, "operation_name", "the call")
            return one_line(
                f"AWS refused {operation}: {error.get('Code')}: {error.get('Message', '')} "
                "(check the credentials and their permissions)"
            )
    return None
