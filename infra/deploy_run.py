"""`arbiter deploy`'s execution: a plan built by :mod:`infra.deploy` run call by call with botocore.

Kept apart from the plan so that ``--dry-run`` and its review never load what makes calls, and the
plan stays a pure function of the configuration; this module owns what AWS answers (a stack that
exists or not, an update with nothing to do, an archive already uploaded, a multipart upload aborted
on any failure).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TextIO

from botocore.exceptions import ClientError

from infra.deploy import Call, DeployConfig, DeployError, Plan, Template, build_plan, print_plan


class Deployer:
    """Runs a plan's calls with botocore clients (one per service)."""

    def __init__(self, config: DeployConfig, log: Callable[[str], None]) -> None:
        import botocore.session

        self.config = config
        self.session = botocore.session.get_session()
        self.clients: dict[str, Any] = {}
        self.log = log

    def client(self, service: str) -> Any:
        if service not in self.clients:
            self.clients[service] = self.session.create_client(
                service, region_name=self.config.region, endpoint_url=self.config.endpoint_url
            )
        return self.clients[service]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def run(self, plan: Plan) -> dict[str, str]:
        steps = list(plan.calls())
        outputs: dict[str, str] = {}
        i = 0
        while i < len(steps):
            call = steps[i]
            if call.operation == "describe_stacks" and i + 1 < len(steps):
                exists = self._stack_exists(call.params["StackName"])
                self._deploy_stack(steps[i + 1], steps[i + 2], exists)
                i += 3
            elif call.operation == "head_object":
                uploads = [s for s in steps[i + 1 :] if s.service == "s3"]
                if not self._already_uploaded(call, plan.model_sha256):
                    self._upload(uploads)
                i += 1 + len(uploads)
            elif call.operation == "describe_stacks":
                stack = self.client("cloudformation").describe_stacks(**call.params)["Stacks"][0]
                outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
                i += 1
            else:  # pragma: no cover - every planned call is handled above
                raise DeployError(f"unplanned call {call.operation}")
        return outputs

    def _stack_exists(self, name: str) -> bool:
        try:
            stacks = self.client("cloudformation").describe_stacks(StackName=name)["Stacks"]
        except ClientError as exc:
            if "does not exist" in str(exc):
                return False
            raise
        return bool(stacks) and stacks[0]["StackStatus"] != "DELETE_COMPLETE"

    def _deploy_stack(self, change: Call, wait: Call, exists: bool) -> None:
        cfn = self.client("cloudformation")
        params = {k: (v.body if isinstance(v, Template) else v) for k, v in change.params.items()}
        name = params["StackName"]
        if exists:
            self.log(f"updating stack {name}")
            try:
                cfn.update_stack(**params)
            except ClientError as exc:
                if "No updates are to be performed" in str(exc):
                    self.log(f"stack {name}: no changes")
                    return
                raise
            waiter = "stack_update_complete"
        else:
            self.log(f"creating stack {name}")
            cfn.create_stack(**params, OnFailure="DELETE")
            waiter = "stack_create_complete"
        cfn.get_waiter(waiter).wait(**wait.params)
        self.log(f"stack {name}: done")

    def _already_uploaded(self, head: Call, sha: str | None) -> bool:
        try:
            found = self.client("s3").head_object(**head.params)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
                return False
            raise
        same = bool(found.get("Metadata", {}).get("sha256") == sha)
        if same:
            self.log(f"s3://{head.params['Bucket']}/{head.params['Key']} already holds the archive")
        return same

    def _upload(self, calls: list[Call]) -> None:
        s3 = self.client("s3")
        if calls[0].operation == "put_object":
            params = dict(calls[0].params)
            params["Body"] = params["Body"].read()
            s3.put_object(**params)
            self.log(f"uploaded s3://{params['Bucket']}/{params['Key']}")
            return
        create, *parts, complete = calls
        upload_id = s3.create_multipart_upload(**create.params)["UploadId"]
        try:
            done = []
            for part in parts:
                params = {**part.params, "UploadId": upload_id, "Body": part.params["Body"].read()}
                etag = s3.upload_part(**params)["ETag"]
                done.append({"ETag": etag, "PartNumber": params["PartNumber"]})
            s3.complete_multipart_upload(
                Bucket=complete.params["Bucket"],
                Key=complete.params["Key"],
                UploadId=upload_id,
                MultipartUpload={"Parts": done},
            )
        except BaseException:
            s3.abort_multipart_upload(
                Bucket=create.params["Bucket"], Key=create.params["Key"], UploadId=upload_id
            )
            raise
        self.log(
            f"uploaded s3://{create.params['Bucket']}/{create.params['Key']} in {len(parts)} parts"
        )


def check_model(plan: Plan, log: Callable[[str], None]) -> None:
    """The engine's read check on the local archive the plan uploads, as the endpoint will load
    it (``infra.package_check``): a model that would refuse to start is refused before any call,
    instead of after a 10-15 minute endpoint deploy. An uploaded archive is not checked here."""
    from arbiter.errors import ModelLoadError
    from infra.package_check import check_archive, describe

    if plan.model_file is None:  # already in S3: checked where it was packaged
        return
    try:
        log(describe(check_archive(plan.model_file, plan.config.read_check)))
    except ModelLoadError as exc:
        raise DeployError(exc.message) from exc


def deploy(config: DeployConfig, *, dry_run: bool, out: TextIO, log: Callable[[str], None]) -> int:
    plan = build_plan(config)
    check_model(plan, log)
    if dry_run:
        print_plan(plan, out)
        return 0
    deployer = Deployer(config, log)
    try:
        outputs = deployer.run(plan)
    finally:
        deployer.close()
    out.write(
        json.dumps({"stack": config.stack, "model_key": plan.model_key, "outputs": outputs}) + "\n"
    )
    return 0
