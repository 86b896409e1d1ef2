"""Request bodies longer than any legal request: 413 before they are read or parsed as JSON.

The largest legal body is a completion prompt of max_context x MAX_PROMPT_CHARS_PER_TOKEN
characters (what Prompts refuses above), every one a character outside the BMP written as a JSON
escape pair (12 bytes: "\\ud83d\\ude00"), plus 1 MiB for the other fields (stop strings, a chat's
message objects, whitespace). `--max-body-bytes` overrides it.

Nothing past the limit is kept: a body of up to twice the limit is read to its end and dropped
before the 413 goes out (a client still sending when the server closes would get a connection
reset instead of the answer), a longer one is answered at once (a Content-Length past twice the
limit: no byte of it read; a chunked body: at the first byte past twice the limit), and the
connection is closed after the 413.
"""
from __future__ import annotations

import json

from ddtree.engine.request import MAX_PROMPT_CHARS_PER_TOKEN

JSON_BYTES_PER_CHAR = 12
SLACK_BYTES = 1 << 20
WITH_BODY = ("POST", "PUT", "PATCH")


def max_body_bytes(max_context: int) -> int:
    return JSON_BYTES_PER_CHAR * max_context * MAX_PROMPT_CHARS_PER_TOKEN + SLACK_BYTES


class BodyLimit:
    """ASGI middleware: bodies over `max_bytes` get 413 with OpenAI's error body (code
    `request_too_large`); `why` says where the limit comes from."""

    def __init__(self, app, max_bytes: int, why: str):
        self.app, self.max_bytes, self.why = app, max_bytes, why

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in WITH_BODY:
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:  # h11 holds the body to it
            if length.isdigit() and int(length) > self.max_bytes:
                if int(length) <= 2 * self.max_bytes:
                    await self._drop(receive, 0)
                return await self._refuse(send, f"is {int(length)} bytes")
            return await self.app(scope, receive, send)
        read, total = [], 0   # chunked: read it up to the limit, then hand it on
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                if message.get("more_body", False):
                    await self._drop(receive, total)
                return await self._refuse(send, f"has more than {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break

        async def replay():
            return read.pop(0) if read else await receive()
        return await self.app(scope, replay, send)

    async def _drop(self, receive, total: int) -> None:
        """Reads the rest of the body without keeping it, up to twice the limit in all."""
        while total <= 2 * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            total += len(message.get("body", b""))

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps({"error": {
            "message": f"the request body {size}; this server takes at most {self.max_bytes} bytes ({self.why})",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
