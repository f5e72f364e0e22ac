"""Admin routes of reshaping (changing the TP x PP layout of a running deployment), behind the admin key:

    GET  /admin/topology  -> the layout now: every instance's workers, TP, PP, stages with their layer ranges, KV
    GET  /admin/reshape   -> current topology, candidate topologies, past reshapes
    POST /admin/reshape   {"topology": [2]} or {"topology": ["1x2"]} or {"topology": "1x2:16/14,1"}
                          -> runs the reshape as a transaction on the engine thread

Topologies travel as lists whose items are a TP degree (int) or "TPxPP[:layers/per/stage]" (str). A rejected
topology is a 400 naming the candidates; a reshape that rolled back before its commit point is a 409 (the old
topology keeps serving). A single-worker server has one candidate, [1]."""
from __future__ import annotations


from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.serving.auth import admin_request, check_admin
from elastic_hf.serving.errors import error_response


class ReshapeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    topology: list[int | str] | str = Field(min_length=1, max_length=64)
    weights_source: str | None = None  # "host" (shared weight store) or "peers"; default: the plan's choice


def admin_reshape_router(model, async_engine, admin_key: str | None) -> APIRouter:
    """Routes over `model.reshape` (ElasticModel); the reshape runs on the engine thread of `async_engine`."""
    from elastic_hf.parallel.reshape import ReshapeAborted

    router = APIRouter()
    deployment = model.deployment

    def as_json(topology) -> list:
        return [s if isinstance(s, int) else str(s) for s in topology.sizes]

    @router.get("/admin/topology")
    async def get_topology(request: Request):
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        topology = deployment.topology
        instances = []
        for idx, inst in enumerate(deployment.instances):
            shape = inst.shape
            bounds = shape.stage_bounds(deployment.num_layers)
            kv = inst.engine.scheduler.kv
            instances.append({"index": idx, "workers": list(inst.workers), "tp": shape.tp, "pp": shape.pp,
                              "stages": [{"workers": list(ws), "layers": list(bounds[s])}
                                         for s, ws in enumerate(topology.stages(idx))],
                              "kv_blocks_total": kv.num_total, "kv_blocks_used": kv.num_used,
                              "num_requests": len(inst.engine.requests)})
        standby = [w for w in range(deployment.config.num_workers) if topology.role(w) is None]
        return {"topology": as_json(topology), "text": str(topology), "num_layers": deployment.num_layers,
                "instances": instances, "standby_workers": standby,
                "candidates": [str(t) for t in deployment.candidates]}

    @router.get("/admin/reshape")
    async def get_reshape(request: Request):
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        return {"topology": as_json(deployment.topology),
                "candidates": [as_json(t) for t in deployment.candidates],
                "tp_policy": deployment.config.tp_policy,
                "reshapes": [r.summary() for r in deployment.reshapes]}

    @router.post("/admin/reshape")
    async def post_reshape(request: Request):
        body, refused = await admin_request(request, admin_key, ReshapeRequest, "reshape")
        if refused is not None:
            return refused
        if body.weights_source not in (None, "host", "peers"):
            return error_response(400, f"weights_source must be 'host' or 'peers', got {body.weights_source!r}",
                                  code="invalid_request", param="weights_source")
        try:
            # On the engine thread, between two steps: that is the transaction's quiesce point.
            report = await async_engine.call(model.reshape, body.topology, body.weights_source)
        except ValueError as exc:
            return error_response(400, str(exc), code="invalid_topology", param="topology")
        except ReshapeAborted as exc:
            return error_response(409, str(exc), code="reshape_rolled_back")
        return report.summary()

    return router
