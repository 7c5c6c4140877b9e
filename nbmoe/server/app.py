"""The routes: /v1/chat/completions, /v1/completions (SSE streams or whole replies),
/v1/models, /health. Built on FastAPI (Starlette, run by uvicorn): HTTP parsing, keep-alive,
streaming and client disconnects are theirs, so this module holds only the API."""
import asyncio
import hmac
import json
import os

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from nbmoe.server.protocol import ApiError, Reply, check_fits, parse_json, parse_request
from nbmoe.server.slots import Job, SlotWorker
from nbmoe.text.chat_template import ChatTemplateError, chat_prompt_ids

# a non-streamed request checks this often whether its client is still there
DISCONNECT_POLL_S = 0.5


def create_app(llm, alias=None, api_key=None, batch=True):
    """The server's app for a loaded engine; its worker thread starts here and stops with
    the app (lifespan). batch: the generating slots' tokens decode as one batch (-cb)."""
    name = alias or os.path.basename(llm.path)
    names = {name, os.path.basename(llm.path), llm.path}
    state = {}

    async def lifespan(app):
        state["worker"] = SlotWorker(llm, batch)
        yield
        state["worker"].close()

    app = FastAPI(title="nbmoe", lifespan=lifespan)
    app.state.llm = llm

    def error(e):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def api_error(request, e):
        return error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e):      # unknown routes, wrong methods
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    @app.middleware("http")
    async def check_key(request, call_next):
        if api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return error(ApiError(401, "invalid or missing API key (send 'Authorization: "
                                           "Bearer KEY')", type="authentication_error",
                                      code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", **state["worker"].status()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(os.path.getmtime(llm.path)),
            "owned_by": "nbmoe", "meta": {"n_ctx_slot": llm.n_ctx, "n_slots": len(llm.slots),
                                          "arch": llm.cfg.arch, "n_vocab": llm.cfg.n_vocab}}]}

    async def complete(request, chat):
        req = parse_request(parse_json(await request.body()), chat)
        if req.model is not None and req.model not in names:
            raise ApiError(404, f"the model '{req.model}' does not exist (this server runs '{name}')",
                           code="model_not_found", param="model")
        req.prompt_ids = await run_in_threadpool(prompt_ids, llm, req)
        check_fits(req, llm.n_ctx)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = Job(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        state["worker"].submit(job)
        reply = Reply(req, name)
        if req.stream:
            return StreamingResponse(sse(job, events, reply, req.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(request, job, events, reply)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    return app


def prompt_ids(llm, req):
    """The request's prompt as token ids: chat messages through the GGUF's chat template."""
    if req.chat:
        try:
            return chat_prompt_ids(llm.tokenizer, req.messages)
        except ChatTemplateError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
    if isinstance(req.prompt, str):
        return llm.tokenize(req.prompt)
    bad = [t for t in req.prompt if not 0 <= t < llm.cfg.n_vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary of {llm.cfg.n_vocab}",
                       param="prompt")
    return list(req.prompt)


async def whole(request, job, events, reply):
    """Wait for the whole reply; a client gone meanwhile cancels the job."""
    text = []
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return JSONResponse({}, status_code=499)
                continue
            if ev[0] == "text":
                text.append(ev[1])
            elif ev[0] == "done":
                return reply.whole("".join(text), ev[1], ev[2])
            else:
                return JSONResponse(ApiError(500, ev[1], type="server_error").body(), status_code=500)
    finally:
        job.cancel()        # (a no-op once done)


async def sse(job, events, reply, include_usage):
    """Server-sent events: chunks as `data: {json}`, then `data: [DONE]`. When the client
    goes away Starlette stops this generator: the job is cancelled."""
    def data(obj):
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    try:
        first = True
        while True:
            ev = await events.get()
            if ev[0] == "text":
                yield data(reply.chunk(ev[1], first=first))
                first = False
            elif ev[0] == "done":
                if first and reply.chat:
                    yield data(reply.chunk("", first=True))
                yield data(reply.chunk("", finish_reason=ev[1]))
                if include_usage:
                    yield data(reply.usage_chunk(ev[2]))
                break
            else:
                yield data(ApiError(500, ev[1], type="server_error").body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()
