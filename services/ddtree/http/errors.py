"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Every failure a client can see goes through here: request bodies pydantic refuses (400), what
this server does not support (400), an unknown model (404), gRPC errors from the verify service
by status code, unknown paths, and anything unexpected (500, logged with its traceback here,
never sent).
"""
from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

# gRPC status of the verify service -> (HTTP status, OpenAI error type); others: 500 server_error.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def from_grpc(exc: grpc.aio.AioRpcError) -> APIError:
    details = exc.details() or exc.code().name
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        # grpc's refusal of a message past the verify service's receive limit: too large, not busy
        return APIError(413, details, "invalid_request_error", code="request_too_large")
    status, type_ = GRPC_TO_HTTP.get(exc.code(), (500, "server_error"))
    return APIError(status, details, type_)


def _validation_message(errors) -> tuple[str, str | None]:
    """Pydantic's errors as one line, and the first top-level field they name."""
    parts, param = [], None
    for error in errors:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if error.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument supplied: {field}")
        elif error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}")
            param = None
        else:
            parts.append(f"{field or 'body'}: {error.get('msg')}")
    return "; ".join(parts) or "invalid request body", param


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return invalid_request(message, param).response()

    async def on_http_error(request: Request, exc: HTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()

    async def on_unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
