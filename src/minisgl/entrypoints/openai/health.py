"""`GET /health` (200 serving; 503 starting, stopping, unhealthy or while a scheduler rank is
stalled), `GET /v1/models`, `GET /v1/models/{id}` and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from minisgl.entrypoints.openai.errors import APIError
from minisgl.entrypoints.openai.serving import JSONObject
from minisgl.entrypoints.openai.state import ServerState, State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    if state.status == "serving" and not state.stalled:
        return JSONResponse({"status": "ok"})
    if state.status == "serving":
        return JSONResponse({"status": "stalled", "detail": state.stalled}, status_code=503)
    return JSONResponse({"status": state.status, "detail": state.detail}, status_code=503)


def _model_card(state: ServerState) -> JSONObject:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "minisgl",
        "root": state.root or state.model_name,  # what the model was loaded from (vLLM's field)
        "parent": None,
        "max_model_len": state.max_seq_len,
    }


@router.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> JSONObject:
    if not state.knows_model(model_id):
        raise APIError(
            404, f"the model '{model_id}' does not exist", "not_found_error", "model", "model_not_found"
        )
    return {**_model_card(state), "id": model_id}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    body = state.manager.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
