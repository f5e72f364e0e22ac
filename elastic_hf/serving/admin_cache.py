"""Admin routes of the prefix cache, behind the admin key:

    GET  /admin/prefix_cache  -> on or off, blocks it names (in use and free), prompt tokens looked up and found
    POST /reset_prefix_cache  -> forget every cached prefix (vLLM's route; there a dev-mode route, here an admin one),
                                 e.g. after changing weights by hand or to measure cold-cache latency"""
from __future__ import annotations

from fastapi import APIRouter, Request

from elastic_hf.serving.auth import check_admin


def admin_cache_router(model, async_engine, admin_key: str | None) -> APIRouter:
    """Routes over `model.memory_report()["prefix_cache"]` and `model.reset_prefix_cache` (ElasticModel), run on
    the engine thread between steps."""
    router = APIRouter()

    @router.get("/admin/prefix_cache")
    async def get_prefix_cache(request: Request):
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        return await async_engine.call(lambda: model.memory_report()["prefix_cache"])

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        denied = check_admin(request, admin_key)
        if denied is not None:
            return denied
        forgotten = await async_engine.call(model.reset_prefix_cache)
        return {"reset": True, "forgotten_blocks": forgotten}

    return router
