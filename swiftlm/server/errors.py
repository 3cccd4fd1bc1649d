"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def render_error(exc: APIError, headers: dict | None) -> JSONResponse:
    """An APIError as an OpenAI-shaped error response (the renderer of ``auth.guard`` on the /v1 routes)."""
    return error_response(exc.status, exc.message, exc.param, exc.code, headers=headers)
