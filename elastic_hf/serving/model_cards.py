"""/v1/models' wire format: the served model's card with vLLM's permission record."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from elastic_hf.serving.protocol import new_id, now


class ModelPermission(BaseModel):
    """vLLM's permission record of a served model (clients written for vLLM read it)."""
    id: str = Field(default_factory=lambda: new_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "elastic-hf"
    root: str | None = None       # the checkpoint the served name stands for
    parent: str | None = None     # a fine-tuned adapter's base (none here)
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
