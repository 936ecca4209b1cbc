"""The FastAPI application: routes, TGI-shaped error answers, guards (API key, payload limit)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from tgi_vlm import __version__
from tgi_vlm.api.disconnect import ClientGone
from tgi_vlm.api.errors import ApiError, payload_too_large, validation_error
from tgi_vlm.api.guards import Guards
from tgi_vlm.api.routes import generate, openai, service
from tgi_vlm.api.state import ApiState


def build_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="tgi-vlm", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.api = state
    for module in (generate, openai, service):
        app.include_router(module.router)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_middleware(Guards, api_key=state.config.api_key, payload_limit=state.config.payload_limit)
    return app


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _client_gone(request: Request, error: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    """Bodies that do not deserialize (TGI: serde's message, 422) get TGI's validation body; a body
    that is not JSON at all is 400, as axum's JSON syntax rejection in TGI."""
    unparsable = [e for e in error.errors() if e.get("type") == "json_invalid"]
    if unparsable:
        reason = (unparsable[0].get("ctx") or {}).get("error", "invalid JSON")
        return JSONResponse({"error": f"Failed to parse the request body as JSON: {reason}", "error_type": "validation"},
                            status_code=400)
    problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
    return await _api_error(request, validation_error(f"Failed to deserialize the JSON body: {problems}"))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    if error.status_code == 413:
        return await _api_error(request, payload_too_large(request.app.state.api.config.payload_limit))
    return JSONResponse({"error": str(error.detail), "error_type": "http"}, status_code=error.status_code,
                        headers=getattr(error, "headers", None))
