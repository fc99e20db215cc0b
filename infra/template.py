"""Reads ``template.yaml``: the one source of truth for routes, handlers, environment and the tables.

The tests and benchmarks read the wiring from here. The local stack reads the same wiring compiled to
``infra/wiring.json`` (``python -m infra.template`` writes it; a test fails when it is out of date), so an
installed server needs neither the checkout nor a YAML parser.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra.wiring import ROOT, WIRING, Route, ScheduleSource, StreamSource, resolve

__all__ = ["ROOT", "TEMPLATE", "Route", "ScheduleSource", "StreamSource", "resolve"]

TEMPLATE = ROOT / "template.yaml"


class _CloudFormationLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (``!Ref X`` becomes ``{"Ref": "X"}``)."""


def _tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
        if suffix == "GetAtt":
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    return {name: value}


_CloudFormationLoader.add_multi_constructor("!", _tag)


@cache
def load(path: Path = TEMPLATE) -> dict[str, Any]:
    with path.open() as f:
        document: dict[str, Any] = yaml.load(f, Loader=_CloudFormationLoader)  # noqa: S506 - SafeLoader
    return document


def functions(template: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Serverless functions by logical id, with ``Globals.Function`` merged in."""
    template = template or load()
    defaults = template.get("Globals", {}).get("Function", {})
    result = {}
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Serverless::Function":
            props = {**defaults, **resource["Properties"]}
            env = {
                **defaults.get("Environment", {}).get("Variables", {}),
                **resource["Properties"].get("Environment", {}).get("Variables", {}),
            }
            props["Environment"] = {"Variables": env}
            result[name] = props
    return result


def routes(template: dict[str, Any] | None = None) -> list[Route]:
    """Every HTTP API route in the template, the handler it reaches, and its authorizer."""
    template = template or load()
    found = []
    for name, props in functions(template).items():
        for event in props.get("Events", {}).values():
            if event["Type"] == "HttpApi":
                p = event["Properties"]
                authorizer = _authorizer_function(
                    template, p["ApiId"]["Ref"], p.get("Auth", {}).get("Authorizer")
                )
                found.append(Route(p["Method"].upper(), p["Path"], name, props["Handler"], authorizer))
    return found


def _authorizer_function(template: dict[str, Any], api: str, chosen: str | None) -> str | None:
    auth = template["Resources"][api].get("Properties", {}).get("Auth", {})
    name = chosen or auth.get("DefaultAuthorizer")
    if name in (None, "NONE"):
        return None
    arn = auth["Authorizers"][name]["FunctionArn"]
    return str(arn["Fn::GetAtt"][0])


def environment(
    function: str, refs: dict[str, str], template: dict[str, Any] | None = None
) -> dict[str, str]:
    """A function's environment, ``Ref``s resolved from ``refs`` or, for parameters, their defaults; a
    ``Ref`` to an event bus (its name on AWS) is empty unless ``refs`` names it: no bus off AWS."""
    variables = functions(template)[function]["Environment"]["Variables"]
    refs = {**dict.fromkeys(buses(template), ""), **parameter_defaults(template), **refs}
    return {name: resolve(value, refs) for name, value in variables.items()}


def parameter_defaults(template: dict[str, Any] | None = None) -> dict[str, str]:
    """Each template parameter's default, as a deployment without overrides gets it."""
    parameters = (template or load()).get("Parameters", {})
    return {name: str(p["Default"]) for name, p in parameters.items() if "Default" in p}


def tables(template: dict[str, Any] | None = None) -> list[str]:
    """The logical ids of the template's DynamoDB tables."""
    resources = (template or load())["Resources"]
    return [name for name, r in resources.items() if r["Type"] == "AWS::DynamoDB::Table"]


def buses(template: dict[str, Any] | None = None) -> list[str]:
    """The logical ids of the template's EventBridge buses (the watch's nudges on AWS; none locally)."""
    resources = (template or load())["Resources"]
    return [name for name, r in resources.items() if r["Type"] == "AWS::Events::EventBus"]


def queues(template: dict[str, Any] | None = None) -> list[str]:
    """The logical ids of the template's SQS queues."""
    resources = (template or load())["Resources"]
    return [name for name, r in resources.items() if r["Type"] == "AWS::SQS::Queue"]


def table_definition(logical_id: str, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """``create_table`` arguments for a table resource, taken from its template properties."""
    props = (template or load())["Resources"][logical_id]["Properties"]
    definition = {
        "AttributeDefinitions": props["AttributeDefinitions"],
        "KeySchema": props["KeySchema"],
        "BillingMode": props["BillingMode"],
    }
    if "GlobalSecondaryIndexes" in props:
        definition["GlobalSecondaryIndexes"] = props["GlobalSecondaryIndexes"]
    if "StreamSpecification" in props:
        view = props["StreamSpecification"]["StreamViewType"]
        definition["StreamSpecification"] = {"StreamEnabled": True, "StreamViewType": view}
    return definition


def stream_sources(template: dict[str, Any] | None = None) -> list[StreamSource]:
    found = []
    for name, props in functions(template).items():
        for event in props.get("Events", {}).values():
            if event["Type"] == "DynamoDB":
                p = event["Properties"]
                table, attribute = p["Stream"]["Fn::GetAtt"]
                assert attribute == "StreamArn", p["Stream"]
                patterns = [json.loads(f["Pattern"]) for f in p.get("FilterCriteria", {}).get("Filters", [])]
                found.append(
                    StreamSource(name, table, int(p.get("BatchSize", 100)), p["StartingPosition"], patterns)
                )
    return found


def schedule_sources(template: dict[str, Any] | None = None) -> list[ScheduleSource]:
    """Functions run on a schedule (``Schedule`` events with ``rate(N unit)``)."""
    units = {"minute": 60, "minutes": 60, "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}
    found = []
    for name, props in functions(template).items():
        for event in props.get("Events", {}).values():
            if event["Type"] == "Schedule":
                expression = event["Properties"]["Schedule"]
                number, unit = expression.removeprefix("rate(").removesuffix(")").split()
                found.append(ScheduleSource(name, expression, float(int(number) * units[unit])))
    return found


def runtime(template: dict[str, Any] | None = None) -> str:
    return str((template or load())["Globals"]["Function"]["Runtime"])


def transformed(template: dict[str, Any] | None = None, region: str = "us-east-1") -> dict[str, Any]:
    """The template as plain CloudFormation, through the SAM transform itself (offline).

    Local ``CodeUri``/``ContentUri`` are swapped for dummy S3 URIs as ``sam package`` would, and the
    managed-policy lookup (which would call IAM) is answered from an empty map: the template uses
    inline statements only, and a managed policy name would fail the transform loudly.
    """
    import copy
    import os

    from samtranslator.model.exceptions import InvalidDocumentException
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator

    document = copy.deepcopy(template or load())
    for resource in document["Resources"].values():
        props = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if isinstance(props.get(key), str):
                props[key] = f"s3://bucket/{props[key].strip('./') or 'code'}.zip"
    function_defaults = document.get("Globals", {}).get("Function", {})
    if isinstance(function_defaults.get("CodeUri"), str):
        function_defaults["CodeUri"] = "s3://bucket/code.zip"
    os.environ.setdefault("AWS_DEFAULT_REGION", region)
    try:
        output: dict[str, Any] = Translator({}, Parser()).translate(document, {})
    except InvalidDocumentException as exc:
        raise ValueError("; ".join(str(cause) for cause in exc.causes)) from None
    return output


#: The function settings the local stack runs with; the rest (events, policies) is AWS's business.
RUNTIME_SETTINGS = ("Handler", "Timeout", "MemorySize", "Environment")


def wiring(template: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the local stack needs of the template, as ``infra/wiring.json`` holds it."""
    template = template or load()
    return {
        "source": "generated from template.yaml by `python -m infra.template`; do not edit",
        "functions": {
            name: _with_parameter_defaults(
                {key: props[key] for key in RUNTIME_SETTINGS if key in props}, parameter_defaults(template)
            )
            for name, props in sorted(functions(template).items())
        },
        "routes": [asdict(route) for route in routes(template)],
        "stream_sources": [asdict(source) for source in stream_sources(template)],
        "schedule_sources": [asdict(source) for source in schedule_sources(template)],
        "tables": {name: table_definition(name, template) for name in tables(template)},
        "queues": queues(template),
        "buses": buses(template),
    }


def _with_parameter_defaults(settings: dict[str, Any], defaults: dict[str, str]) -> dict[str, Any]:
    """The environment's ``Ref``s to parameters as their defaults (the local stack is deployed with them)."""
    variables = settings.get("Environment", {}).get("Variables")
    if variables:
        resolved = {
            name: defaults[value["Ref"]]
            if isinstance(value, dict) and value.get("Ref") in defaults
            else value
            for name, value in variables.items()
        }
        settings = {**settings, "Environment": {**settings["Environment"], "Variables": resolved}}
    return settings


def render_wiring(template: dict[str, Any] | None = None) -> str:
    return json.dumps(wiring(template), indent=2, sort_keys=True) + "\n"


def main() -> None:
    WIRING.write_text(render_wiring())
    print(f"wrote {WIRING.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
