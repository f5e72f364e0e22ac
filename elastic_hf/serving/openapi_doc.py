"""The OpenAPI document describes every request body. The routes read the raw request themselves (to keep
OpenAI's error shapes for bad JSON, wrong types and unknown models), so FastAPI cannot infer their bodies; this
adds each route's pydantic request model to the generated document, so client generators, API gateways and fuzzers
(schemathesis) see what the server takes."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def document_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]], model_names: tuple[str, ...] = ()
                            ) -> None:
    """bodies: POST path -> the model its handler validates the JSON body with. model_names: the served names,
    the only values a body's `model` field takes (another is a 404)."""
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            operation = doc.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            if model_names and "model" in schema.get("properties", {}):
                field = schema["properties"]["model"]
                served = {"type": "string", "enum": list(model_names)}
                # optional fields (/tokenize's) keep null allowed
                schema["properties"]["model"] = {"anyOf": [served, {"type": "null"}]} if "anyOf" in field else served
            schemas[model.__name__] = schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(model=model.__name__)}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
