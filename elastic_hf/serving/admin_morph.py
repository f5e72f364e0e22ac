"""Admin routes of precision morphing: `GET /admin/morph` (per-layer precision, KV capacity, swap counts and
times) and `POST /admin/morph` (force a state), both behind `Authorization: Bearer <admin key>`.

POST body: {"layers": [0, 5] | "all", "precision": "fp" | "w8" | "w4", "controller": "on" | "off" (optional)}
or only {"controller": "on" | "off"}. A forced state turns the automatic controller off unless "controller":
"on" comes with it. The call waits (up to `timeout_s`, default 30) until the swaps took effect at a step
boundary; a restore that needs KV blocks still in use returns at once with those layers under "pending"."""
from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.serving.admin_auth import admin_error, check_admin, parse_admin_body


class MorphRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layers: list[int] | Literal["all"] | None = None
    precision: str | None = None
    controller: Literal["on", "off"] | None = None
    timeout_s: float = Field(default=30.0, gt=0, le=600)


def admin_morph_router(model, async_engine, admin_key: str | None) -> APIRouter:
    """Routes over `model.morph` (ElasticModel) served by `async_engine`. Without an admin key every call gets
    403: an unauthenticated endpoint that rewrites the model must not exist by accident. The morph manager is
    told that the engine thread drives the model, so swaps happen at that thread's step boundaries."""
    router = APIRouter()
    manager = getattr(model, "morph", None)
    if manager is not None:
        # wake() makes an idle engine thread re-check has_unfinished_requests(), which reports the manager's
        # pending work (LLMEngine.idle_work_checks), so it runs a step boundary for it.
        manager.attach_driver(async_engine.wake)

    def guard(request: Request) -> JSONResponse | None:
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        if manager is None:
            return admin_error(409, "precision morphing is off for this server: start it with --morph "
                               "{manual,accuracy,default,performance}", "morph_off")
        return None

    @router.get("/admin/morph")
    async def get_morph(request: Request):
        denied = guard(request)
        if denied is not None:
            return denied
        return manager.state()

    @router.post("/admin/morph")
    async def post_morph(request: Request):
        denied = guard(request)
        if denied is not None:
            return denied
        body, invalid = await parse_admin_body(request, MorphRequest, "morph")
        if invalid is not None:
            return invalid
        if body.precision is None and body.layers is None:
            if body.controller is None:
                return admin_error(400, "give 'precision' and 'layers' to force a state, or 'controller': 'on'|'off'",
                              "invalid_request")
            try:
                manager.set_controller(body.controller == "on")
            except ValueError as exc:
                return admin_error(400, str(exc), "invalid_request", "controller")
            return manager.state()
        if body.precision is None or body.layers is None:
            missing = "precision" if body.precision is None else "layers"
            return admin_error(400, f"'{missing}' is required with '{'layers' if missing == 'precision' else 'precision'}'",
                          "invalid_request", missing)
        precisions = manager.swapper.store.precisions
        if body.precision not in precisions:
            return admin_error(400, f"precision {body.precision!r} is unknown; allowed: {', '.join(precisions)}",
                          "unknown_precision", "precision")
        if body.layers != "all":
            bad = [i for i in body.layers if not 0 <= i < manager.num_layers]
            if bad:
                return admin_error(404, f"layer(s) {bad} do not exist: this model has layers 0..{manager.num_layers - 1}",
                              "unknown_layer", "layers")
        controller = None if body.controller is None else body.controller == "on"
        try:
            state = await asyncio.to_thread(manager.to_precision, body.layers, body.precision, wait=True,
                                            timeout=body.timeout_s, controller=controller)
        except ValueError as exc:
            return admin_error(400, str(exc), "invalid_request")
        except RuntimeError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "server_error", "param": None,
                                           "code": "morph_failed"}}, status_code=500)
        return state

    return router
