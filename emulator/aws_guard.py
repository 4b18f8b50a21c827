"""`arbiter runtime` reaches real AWS only when asked.

Without ``ARBITER_AWS_ENDPOINT_URL`` (the local stack's S3, SQS and SNS) its clients would go to the
caller's AWS account: create SNS topics and an SQS queue there, read and write its S3. So that needs
an explicit opt-in (``--aws`` or ``ARBITER_RUNTIME_AWS=true``) and credentials; otherwise the command
refuses in one line, exit status 2, before it touches anything.
"""

from __future__ import annotations

from emulator.settings import RuntimeSettings


class RuntimeRefused(Exception):
    """`arbiter runtime` will not start; the message is the one line it prints."""


def check_aws(settings: RuntimeSettings) -> None:
    if settings.aws_endpoint_url:
        return
    if not settings.aws:
        raise RuntimeRefused(
            "no ARBITER_AWS_ENDPOINT_URL (the local S3/SQS/SNS, as `arbiter local` sets it); "
            "pass --aws (or ARBITER_RUNTIME_AWS=true) to use real AWS in your account"
        )
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        raise RuntimeRefused(
            "--aws: no AWS credentials found: set AWS_PROFILE or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or run on an instance role)"
        )
