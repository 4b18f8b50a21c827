"""The OpenAPI document is generated from the route table and the wire models, never kept by hand."""

from __future__ import annotations

import json

from adapter import openapi
from adapter.app import ROUTES, create_app
from arbiter.schema import DecisionRequest


def test_the_committed_document_is_the_generated_one() -> None:
    """``adapter/openapi.json`` (what the app serves) is what ``arbiter openapi`` writes from the
    code: a model or a route that changed without it fails here."""
    assert openapi.PATH.read_text(encoding="utf-8") == openapi.render(ROUTES), (
        "adapter/openapi.json is out of date: run arbiter openapi"
    )
    assert openapi.write(ROUTES, check=True)


def test_the_document_has_every_route_and_the_models_own_schemas() -> None:
    doc = openapi.document(ROUTES)
    app = create_app()
    served = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    assert served == {(m, p) for p, ops in doc["paths"].items() for m in ops}
    schemas = doc["components"]["schemas"]
    own = DecisionRequest.model_json_schema(ref_template=openapi.REF)
    for name, schema in [("DecisionRequest", own), *own.pop("$defs", {}).items()]:
        assert schemas[name] == schema, name
    # Every reference resolves.
    text = json.dumps(doc)
    for name in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert name in schemas, name
