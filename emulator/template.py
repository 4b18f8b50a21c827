"""The endpoint as the serving template deploys it, evaluated for this machine.

The local front takes its endpoint configuration from ``infra/cloudformation/serving.yaml`` (and the
data stack's exports in ``data.yaml``) rather than from settings of its own: the variant name, the
async ``MaxConcurrentInvocationsPerInstance``, the S3 output and failure paths, the SNS topics and the
container's environment are read from the templates and evaluated with the same parameters
``arbiter deploy`` passes (``MaxInFlight`` is ``ARBITER_MAX_IN_FLIGHT`` here, as the template makes it
the container's). A change to the template changes both, so local and AWS cannot drift; an
intrinsic this evaluator does not model is an error, not a guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infra.deploy import data_stack_name, load_template

ACCOUNT = "123456789012"  # moto's account: ARNs and messages name it as AWS would name yours
_SUB = re.compile(r"\$\{([^}!][^}]*)\}")


class TemplateError(Exception):
    """The template uses something the local evaluator does not model."""


def parse(text: str) -> dict[str, Any]:
    """CloudFormation YAML, short-form intrinsics (``!Ref``, ``!Sub``, ...) as their long forms."""
    import yaml

    class Loader(yaml.SafeLoader):  # type: ignore[misc]
        pass

    def intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
        name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
        value: Any
        if isinstance(node, yaml.ScalarNode):
            value = loader.construct_scalar(node)
            if suffix == "GetAtt":
                value = str(value).split(".", 1)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_mapping(node, deep=True)
        return {name: value}

    Loader.add_multi_constructor("!", intrinsic)
    loaded = yaml.load(text, Loader=Loader)  # a SafeLoader, plus the intrinsic tags
    if not isinstance(loaded, dict):
        raise TemplateError("a template is a mapping")
    return loaded


@dataclass
class Stack:
    """One template evaluated with its parameters; ``Ref`` to a resource gives its local name."""

    name: str
    template: dict[str, Any]
    parameters: dict[str, str]
    region: str
    imports: Callable[[str], Any] | None = None
    topics: dict[str, str] = field(default_factory=dict)  # topic ARN -> name, created locally

    def parameter(self, name: str) -> str:
        if name in self.parameters:
            return self.parameters[name]
        declared = self.template.get("Parameters", {}).get(name)
        if declared is None or "Default" not in declared:
            raise TemplateError(f"{self.name}: parameter {name} has no value and no default")
        return str(declared["Default"])

    def ref(self, name: str) -> Any:
        pseudo = {
            "AWS::Region": self.region,
            "AWS::AccountId": ACCOUNT,
            "AWS::Partition": "aws",
            "AWS::StackName": self.name,
            "AWS::NoValue": None,
        }
        if name in pseudo:
            return pseudo[name]
        if name in self.template.get("Parameters", {}):
            return self.parameter(name)
        resource = self.template.get("Resources", {}).get(name)
        if resource is None:
            raise TemplateError(f"{self.name}: Ref {name} names nothing")
        kind = resource["Type"]
        props = resource.get("Properties", {})
        if kind == "AWS::S3::Bucket":
            return self.value(props["BucketName"])
        if kind == "AWS::SNS::Topic":
            named = props.get("TopicName")
            topic = str(self.value(named)) if named is not None else f"{self.name}-{name}"
            arn = f"arn:aws:sns:{self.region}:{ACCOUNT}:{topic}"
            self.topics[arn] = topic
            return arn
        raise TemplateError(f"{self.name}: Ref to a {kind} is not modelled locally")

    def condition(self, name: str) -> bool:
        return bool(self.value(self.template["Conditions"][name]))

    def value(self, node: Any) -> Any:
        """Evaluate ``node``: intrinsics resolved, everything else as written."""
        if isinstance(node, list):
            return [self.value(item) for item in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            [(key, arg)] = node.items()
            handler = _INTRINSICS.get(key)
            if handler is not None:
                return handler(self, arg)
            if key.startswith("Fn::"):
                raise TemplateError(f"{self.name}: {key} is not modelled locally")
        return {k: self.value(v) for k, v in node.items()}

    def sub(self, arg: Any) -> str:
        text, names = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])
        local = {k: self.value(v) for k, v in names.items()}

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in local:
                return str(local[name])
            if "." in name:
                raise TemplateError(f"{self.name}: Fn::Sub of an attribute ({name})")
            return str(self.ref(name))

        return _SUB.sub(one, str(text))

    def import_value(self, arg: Any) -> Any:
        if self.imports is None:
            raise TemplateError(f"{self.name}: Fn::ImportValue without an exporting stack")
        return self.imports(str(self.value(arg)))

    def exported(self, export_name: str) -> Any:
        for output in self.template.get("Outputs", {}).values():
            export = output.get("Export")
            if export is not None and self.value(export["Name"]) == export_name:
                return self.value(output["Value"])
        raise TemplateError(f"{self.name} exports no {export_name}")


_INTRINSICS: dict[str, Callable[[Stack, Any], Any]] = {
    "Ref": lambda s, a: s.ref(str(a)),
    "Fn::Sub": Stack.sub,
    "Fn::ImportValue": Stack.import_value,
    "Fn::If": lambda s, a: s.value(a[1] if s.condition(a[0]) else a[2]),
    "Fn::Equals": lambda s, a: str(s.value(a[0])) == str(s.value(a[1])),
    "Fn::Not": lambda s, a: not s.value(a[0]),
    "Condition": lambda s, a: s.condition(str(a)),
}


@dataclass(frozen=True)
class AsyncSpec:
    """``AsyncInferenceConfig`` of the endpoint config, evaluated."""

    max_concurrent: int
    output_path: str
    failure_path: str | None
    success_topic: str | None
    error_topic: str | None
    include_response_in: tuple[str, ...] = ()


@dataclass(frozen=True)
class EndpointSpec:
    mode: str  # "realtime" or "async": which EndpointConfig the template deploys
    variant: str
    container_environment: dict[str, str]
    asynchronous: AsyncSpec | None  # the async config (None for a real-time endpoint)
    topics: dict[str, str]  # ARN -> name of every topic the endpoint publishes to


MODES = {"realtime": "RealtimeEndpointConfig", "async": "AsyncEndpointConfig"}


def endpoint_spec(
    *,
    bucket: str,
    max_in_flight: int | None,
    stack: str = "arbiter",
    region: str = "us-east-1",
    mode: str = "async",
) -> EndpointSpec:
    """The endpoint ``arbiter deploy --stack STACK --mode MODE`` creates, with the data bucket
    named ``bucket`` and ``MaxInFlight`` = ``max_in_flight`` (unset: the template's)."""
    if mode not in MODES:
        raise TemplateError(f"EndpointMode {mode!r}: the front serves {' or '.join(MODES)}")
    data = Stack(
        data_stack_name(stack),
        parse(load_template("data.yaml").body),
        {"BucketName": bucket},
        region,
    )
    params = {"DataStack": data.name, "EndpointMode": mode}
    if max_in_flight is not None:
        params["MaxInFlight"] = str(max_in_flight)
    serving = Stack(
        f"{stack}-serving",
        parse(load_template("serving.yaml").body),
        params,
        region,
        imports=data.exported,
    )
    resources = serving.template["Resources"]
    config_name = MODES[mode]
    if not serving.condition(resources[config_name]["Condition"]):
        raise TemplateError(f"serving.yaml creates no {config_name} for EndpointMode {mode}")
    config = resources[config_name]["Properties"]
    [variant] = config["ProductionVariants"]  # only its name is read: the rest is AWS's
    container = resources["Model"]["Properties"]["PrimaryContainer"]
    environment = serving.value(container.get("Environment", {}))
    spec = None
    if "AsyncInferenceConfig" in config:
        settings = serving.value(config["AsyncInferenceConfig"])
        output = settings["OutputConfig"]
        notify = output.get("NotificationConfig", {})
        client = settings.get("ClientConfig", {})
        spec = AsyncSpec(
            max_concurrent=int(client.get("MaxConcurrentInvocationsPerInstance", 1)),
            output_path=output["S3OutputPath"],
            failure_path=output.get("S3FailurePath"),
            success_topic=notify.get("SuccessTopic"),
            error_topic=notify.get("ErrorTopic"),
            include_response_in=tuple(notify.get("IncludeInferenceResponseIn", ())),
        )
    return EndpointSpec(
        mode="async" if spec is not None else "realtime",
        variant=str(serving.value(variant["VariantName"])),
        container_environment={k: str(v) for k, v in environment.items()},
        asynchronous=spec,
        topics=dict(data.topics),
    )
