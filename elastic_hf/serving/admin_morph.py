"""Admin routes of precision morphing: `GET /admin/morph` (per-layer precision, KV capacity, swap counts and
times) and `POST /admin/morph` (force a state), both behind `Authorization: Bearer <admin key>`.

POST body: {"layers": [0, 5] | "all", "precision": "fp" | "w8" | "w4", "controller": "on" | "off" (optional),
"instance": 0 (optional)} or only {"controller": "on" | "off"}. In a multi-worker deployment every TP-1 instance's
worker morphs its own layers: `instance` (GET: `?instance=N`) picks one, default 0. A forced state turns the automatic controller off unless "controller":
"on" comes with it. The call waits (up to `timeout_s`, default 30) until the swaps took effect at a step
boundary; a restore that needs KV blocks still in use returns at once with those layers under "pending"."""
from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.serving.auth import check_admin, parse_admin_body
from elastic_hf.serving.errors import error_response


class MorphRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance: int = Field(default=0, ge=0)     # which TP-1 instance (its worker morphs its own layers)
    layers: list[int] | Literal["all"] | None = None
    precision: str | None = None
    controller: Literal["on", "off"] | None = None
    timeout_s: float = Field(default=30.0, gt=0, le=600)


def admin_morph_router(model, async_engine, admin_key: str | None) -> APIRouter:
    """Routes over `model.morph` (ElasticModel.morph) served by `async_engine`. Without an admin key every call
    gets 403: an unauthenticated endpoint that rewrites the model must not exist by accident. The morph managers
    are told that the engine thread drives the model, so swaps happen at that thread's step boundaries."""
    router = APIRouter()
    morph = getattr(model, "morph", None)
    if morph is not None:
        # wake() makes an idle engine thread re-check has_unfinished_requests(), which reports the managers'
        # pending work (LLMEngine.idle_work_checks), so it runs a step boundary for it.
        morph.attach_driver(async_engine.wake)

    def guard(request: Request) -> JSONResponse | None:
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        if morph is None:
            return error_response(409, "precision morphing is off for this server: start it with --morph "
                                  "{manual,accuracy,default,performance}", code="morph_off")
        return None

    def manager_of(instance: int):
        """(manager, None) or (None, error response): 404 for an instance that does not exist, 409 for one that is
        not TP1 (its layers are tensor-parallel shards)."""
        num = len(model.instances)
        if instance >= num:
            return None, error_response(404, f"instance {instance} does not exist: topology "
                                        f"{model.deployment.topology} has instances 0..{num - 1}",
                                        code="unknown_instance", param="instance")
        try:
            return morph.manager(instance), None
        except ValueError as exc:
            return None, error_response(409, str(exc), code="instance_not_tp1", param="instance")

    def state(instance: int) -> dict:
        morphing = [i for i, inst in enumerate(model.instances) if inst.tp == 1]
        return {**morph.state(instance), "morphing_instances": morphing}

    @router.get("/admin/morph")
    async def get_morph(request: Request, instance: int = 0):
        denied = guard(request)
        if denied is not None:
            return denied
        _, missing = manager_of(instance)
        return missing if missing is not None else state(instance)

    @router.post("/admin/morph")
    async def post_morph(request: Request):
        denied = guard(request)
        if denied is not None:
            return denied
        body, invalid = await parse_admin_body(request, MorphRequest, "morph")
        if invalid is not None:
            return invalid
        manager, missing = manager_of(body.instance)
        if missing is not None:
            return missing
        if body.precision is None and body.layers is None:
            if body.controller is None:
                return error_response(400, "give 'precision' and 'layers' to force a state, or 'controller': "
                                      "'on'|'off'", code="invalid_request")
            try:
                manager.set_controller(body.controller == "on")
            except ValueError as exc:
                return error_response(400, str(exc), code="invalid_request", param="controller")
            return state(body.instance)
        if body.precision is None or body.layers is None:
            missing = "precision" if body.precision is None else "layers"
            return error_response(400, f"'{missing}' is required with "
                                  f"'{'layers' if missing == 'precision' else 'precision'}'",
                                  code="invalid_request", param=missing)
        precisions = manager.info.precisions
        if body.precision not in precisions:
            return error_response(400, f"precision {body.precision!r} is unknown; allowed: {', '.join(precisions)}",
                                  code="unknown_precision", param="precision")
        if body.layers != "all":
            bad = [i for i in body.layers if not 0 <= i < manager.num_layers]
            if bad:
                return error_response(404, f"layer(s) {bad} do not exist: this model has layers "
                                      f"0..{manager.num_layers - 1}", code="unknown_layer", param="layers")
        controller = None if body.controller is None else body.controller == "on"
        try:
            await asyncio.to_thread(manager.to_precision, body.layers, body.precision, wait=True,
                                    timeout=body.timeout_s, controller=controller)
        except ValueError as exc:
            return error_response(400, str(exc), code="invalid_request")
        except RuntimeError as exc:
            return error_response(500, str(exc), type="server_error", code="morph_failed")
        return state(body.instance)

    return router
