"""GET /v1/models, /health, /version."""
from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import Response

from moe_infer.server.protocol import ErrorResponse, ModelCard, ModelList, VersionResponse
from moe_infer.server.serving import error_response, get_state

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created, root=state.model_path,
                                     max_model_len=state.max_model_len)])


@router.get("/health", response_class=Response, responses={200: {"description": "the engine loop runs"},
                                                          503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 while the engine loop runs; 503 once it stopped or the server is shutting down."""
    if get_state(request).engine.is_running:
        return Response(status_code=200)
    return error_response(503, "the engine loop is not running")


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    try:
        v = metadata.version("moe_infer")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return VersionResponse(version=v)
