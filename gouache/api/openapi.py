"""The OpenAPI schema (`/openapi.json`) describes the request bodies the routes really read.

The image routes read their bodies themselves (a JSON body validated strictly, a multipart form
whose uploads are read apart from its text fields), so FastAPI sees no body parameter and would
document none. Each such route names its body with `openapi_extra=json_body(...)` or
`form_body(...)`, and `install` adds the models' schemas to the document's components, so that
client generators and fuzzers (`gouache bench fuzz`) reach every field, gouache's extensions
included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` for a JSON body of `model` (a component `install` adds)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def form_body(model: type[BaseModel], uploads: dict[str, str], required_uploads: tuple[str, ...],
              leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A route's `openapi_extra` for a multipart form: `model`'s fields as text fields (lists as
    JSON text, as the form carries them) but those in `leave_out`, and file `uploads` (name ->
    what it holds)."""
    schema = model.model_json_schema(ref_template=REF)
    fields = {name: _form_field(prop) for name, prop in schema["properties"].items() if name not in leave_out}
    fields.update({name: {"type": "string", "format": "binary", "description": about}
                   for name, about in uploads.items()})
    required = [name for name in schema.get("required", []) if name not in leave_out] + list(required_uploads)
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "properties": fields, "required": required}}}}}


def _form_field(prop: dict[str, Any]) -> dict[str, Any]:
    if prop.get("type") == "array":
        return {"type": "string", "title": prop.get("title", ""), "description": "a JSON list"}
    return prop


def install(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add `models` (and the models they use) to `app`'s OpenAPI components."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template=REF)
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi
