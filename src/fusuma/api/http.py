"""The HTTP edge of the API: error bodies, names in paths, request limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fusuma.api.operations import Operation
from fusuma.names import NAME_HINT, NAME_PATTERN, check_name

MAX_BODY = 1 << 20          # bytes
BODY_TIMEOUT_S = 10.0       # a request body must arrive within this (serve --client-timeout)

T = TypeVar("T")


def error_response(code: int, sentence: str) -> JSONResponse:
    """The API's error body: the sentence and its code."""
    return JSONResponse({"type": "error", "error": sentence, "error_code": code},
                        status_code=code)


def accepted(op: Operation) -> JSONResponse:
    """202 with the operation, and where to follow it."""
    return JSONResponse(op.as_json(), status_code=202,
                        headers={"Location": f"/1.0/operations/{op.id}"})


# An object's name in a path: what the OpenAPI document says of it (valid_name checks
# it, with the API's own sentence).
NamePath = Annotated[str, Path(description=f"A name: {NAME_HINT}.",
                               json_schema_extra={"pattern": NAME_PATTERN})]
NameQuery = Annotated[str | None, Query(description=f"A name: {NAME_HINT}.",
                                        json_schema_extra={"pattern": NAME_PATTERN})]


def valid_name(kind: str, value: str) -> str:
    """``value`` if it is a valid name of a ``kind`` (else a 400 sentence)."""
    check_name(kind, value)
    return value


async def unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone away (a long wait ends with
    its client: nothing is left running for nobody)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return None if task.cancelled() else task.result()


def validation_sentence(exc: RequestValidationError) -> str:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    kind = err.get("type", "")
    if kind == "json_invalid":
        ctx = err.get("ctx") or {}
        return f"the request body is not valid JSON ({ctx.get('error', 'parse error')})."
    if kind == "extra_forbidden":
        return f"unknown field {where!r}; see /docs for the fields this request takes."
    if kind == "missing":
        return f"field {where!r} is required." if where else "a request body is required."
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "model_attributes_type" or not where:
        return f"the request body must be a JSON object: {msg}."
    return f"field {where!r}: {msg}."


class Limits:
    """Pure ASGI middleware: a body over MAX_BODY gets 413, a body that has not
    arrived BODY_TIMEOUT_S after the headers gets 408; either way the connection is
    answered and the daemon goes on."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY,
                 timeout: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_body = max_body
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > self.max_body:
                        too_big = error_response(413, f"the request body is {int(v)} bytes; "
                                                 f"the API takes at most {self.max_body}.")
                        await too_big(scope, receive, send)
                        return
                except ValueError:
                    await error_response(400, "bad Content-Length header.")(scope, receive, send)
                    return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # Bodies are JSON whatever the client said (`curl -d` says form data).
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        seen = 0
        started = False
        body_done = False
        # All of the body by then, not each piece within the timeout: a body sent a
        # byte at a time would otherwise hold its connection for ever.
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if body_done:
                # After the whole body only http.disconnect can come, maybe hours later
                # (Starlette's StreamingResponse waits for it under the event stream):
                # no deadline, or every /1.0/events stream would be cut after timeout.
                return await receive()
            try:
                left = deadline - asyncio.get_running_loop().time()
                msg = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                raise BodyError(408, f"the request body did not arrive within "
                                 f"{self.timeout:g} s.") from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise BodyError(413, f"the request body is over {self.max_body} "
                                     "bytes, the most the API takes.")
                body_done = not msg.get("more_body", False)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyError as exc:
            if not started:
                await error_response(exc.code, exc.sentence)(scope, receive, send)


class BodyError(Exception):
    def __init__(self, code: int, sentence: str) -> None:
        super().__init__(sentence)
        self.code = code
        self.sentence = sentence
