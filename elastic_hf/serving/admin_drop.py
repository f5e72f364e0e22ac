"""Admin routes of parameter dropping (KunServe) and the overload arbiter, behind the admin key:

    GET  /admin/drop     -> the arbiter's mode, the response in effect, KV demand vs capacity, the exchange in
                            flight and the history of drops, merges and restores
    POST /admin/drop     {"demand_tokens": 4096} (optional; default: the smallest drop) -> drops replicated layers
                            into pipeline groups freeing at least that much KV; the KV of running requests is
                            exchanged between the following steps
    POST /admin/restore  {} -> back to the configured layout (layers reloaded from the shared host store)

Both POSTs run on the engine thread between two steps. No plan (e.g. a single instance, or TP instances) or a
transaction that rolled back is a 409 with the reason; the old layout keeps serving."""
from __future__ import annotations


from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.serving.auth import admin_request, check_admin
from elastic_hf.serving.errors import error_response


class DropRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    demand_tokens: int = Field(default=1, ge=1, le=1 << 40)


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


def admin_drop_router(model, async_engine, admin_key: str | None) -> APIRouter:
    """Routes over `model.drop`, `model.restore` and `model.overload_state` (ElasticModel)."""
    router = APIRouter()

    def report_json(report) -> dict:
        return report.summary()

    def last_reason() -> str:
        history = model.overload_state()["history"]
        return history[-1].get("reason", "no change") if history else "no change"

    @router.get("/admin/drop")
    async def get_drop(request: Request):
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        return await async_engine.call(model.overload_state)

    @router.post("/admin/drop")
    async def post_drop(request: Request):
        body, refused = await admin_request(request, admin_key, DropRequest, "drop", empty_means_defaults=True)
        if refused is not None:
            return refused
        report = await async_engine.call(model.drop, body.demand_tokens)
        if report is None:
            return error_response(409, f"no parameter drop: {await async_engine.call(last_reason)}",
                                  code="drop_refused")
        return {**report_json(report), "overload": await async_engine.call(model.overload_state)}

    @router.post("/admin/restore")
    async def post_restore(request: Request):
        _, refused = await admin_request(request, admin_key, RestoreRequest, "restore", empty_means_defaults=True)
        if refused is not None:
            return refused
        if str(model.deployment.overload.base_topology) == str(model.deployment.topology):
            return {"restored": False, "topology": str(model.deployment.topology)}
        report = await async_engine.call(model.restore)
        if report is None:
            return error_response(409, f"restore refused: {await async_engine.call(last_reason)}",
                                  code="restore_refused")
        return {"restored": True, **report_json(report)}

    return router
