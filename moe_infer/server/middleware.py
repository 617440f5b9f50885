"""An ASGI middleware in front of the app: the API key of /v1/* (401) and the body size limit (413).

The key is compared in constant time (hmac.compare_digest), as `Authorization: Bearer <key>`. The
body is read here up to the limit (a Content-Length over it is refused before reading) and replayed
to the app, so a chunked upload cannot pass the limit either.
"""
from __future__ import annotations

import hmac
import json
from typing import Optional

from moe_infer.server.serving import error_body


class AdmissionMiddleware:
    def __init__(self, app, api_key: Optional[str], max_request_bytes: int) -> None:
        self.app, self.max_bytes = app, max_request_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _reply(send, 401, "invalid or missing API key (send Authorization: Bearer <key>)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _reply(send, 413, f"the request body is larger than {self.max_bytes} bytes")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _reply(send, 413, f"the request body is larger than {self.max_bytes} bytes")
            body.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)


async def _reply(send, status: int, message: str) -> None:
    payload = json.dumps(error_body(status, message).model_dump()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
