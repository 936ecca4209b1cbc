"""TGI's error answers: an HTTP status and `{"error": ..., "error_type": ...}` (router/src/server.rs).

Non-streaming routes answer with the status; streaming routes, as in TGI, have already answered 200
and send the same body as a server-sent event (OpenAI routes: `{"error": {"message", "http_status_code"}}`).
"""

from __future__ import annotations

from http import HTTPStatus


class ApiError(Exception):
    def __init__(self, status: int, error: str, error_type: str):
        super().__init__(error)
        self.status = status
        self.error = error
        self.error_type = error_type

    def body(self) -> dict[str, str]:
        return {"error": self.error, "error_type": self.error_type}

    def openai_body(self) -> dict:
        return {"error": {"message": self.error, "http_status_code": 422}}  # TGI always says 422 here


def validation_error(message: str) -> ApiError:
    return ApiError(HTTPStatus.UNPROCESSABLE_ENTITY, f"Input validation error: {message}", "validation")


def overloaded() -> ApiError:
    return ApiError(HTTPStatus.TOO_MANY_REQUESTS, "Model is overloaded", "overloaded")


def generation_error(message: str) -> ApiError:
    return ApiError(HTTPStatus.FAILED_DEPENDENCY, f"Request failed during generation: {message}", "generation")


def incomplete_generation() -> ApiError:
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "Incomplete generation", "incomplete_generation")


def template_error(message: str) -> ApiError:
    return ApiError(HTTPStatus.UNPROCESSABLE_ENTITY, f"Template error: {message}", "template_error")


def tool_error(message: str) -> ApiError:
    return ApiError(HTTPStatus.UNPROCESSABLE_ENTITY, f"Tool error: {message}", "tool_error")


def unhealthy() -> ApiError:
    return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "unhealthy", "healthcheck")


def payload_too_large(limit: int) -> ApiError:
    # TGI (axum's body limit) answers 413 in plain text; the same words, as JSON, so clients can parse them.
    return ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"Failed to buffer the request body: length limit exceeded ({limit} bytes, --payload-limit)",
                    "payload_limit")
