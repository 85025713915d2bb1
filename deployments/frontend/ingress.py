"""OpenAI-compatible HTTP ingress (FastAPI) in front of the verifier deployment.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /health, GET /v1/stats.
The two generating routes share their verifier calls, usage, SSE events and errors here; what each
makes of its choices' output is its ChoiceFormat (deployments.frontend.completions, .chat).
The same replica also serves Python handle calls: `generate`, `generate_stream`, `stats`.
With an API key (app args `api_key`, else $RAYSPEC_API_KEY) every HTTP route but GET /health wants
`Authorization: Bearer <key>` (deployments.frontend.api_key); handle calls come over Ray, which has no keys.
(Over 500 lines: the routes, the readiness probe and the verifier calls' error mapping share one
replica's state: its admission gate, failover counts and health clock.)
"""


import asyncio
import contextlib
import json
import logging
import time
from typing import AsyncIterator, Protocol, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.frontend.admission import (AdmissionGate, AdmissionState, BodyLimit, body_routes, error_response,
                                            not_ready, tenant_salt,
                                   overloaded)
from deployments.frontend.api_key import RequireApiKey, exposure_warning, key_digest
from deployments.frontend.proxy_guard import unguarded_warning
from deployments.frontend.chat import ChatChoices
from deployments.frontend.choices import check_work, expand, gather_or_cancel, merged, open_streams
from deployments.frontend.completions import CompletionChoices
from deployments.config import load_app_args, resolve_api_key
from deployments.frontend.failover import REPLICA_LOST, FailoverCounts, FailoverStream, call_with_failover, time_left
from deployments.frontend.openai_limits import OpenAIError
from deployments.frontend.openai_requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deployments.frontend.openai_responses import new_id, now, sum_usage
from deployments.transport.protocol import GenerateChunk, GenerateRequest, GenerateResponse, RequestTimeoutError
from deployments.frontend.sse import SSE_HEADERS
from rayspec.engine.outputs import EngineOverloadedError, InvalidGrammarError, InvalidRequestError
from rayspec.sampling.tool_parsers import ToolCallParser, get_parser

logger = logging.getLogger("rayspec.serve")
app = FastAPI(title="rayspec", description="Speculative decoding on Ray Serve (OpenAI-compatible)")


def _replica_key_digest() -> bytes | None:
    """The API key of the ingress replica serving this request (None: no key)."""
    return serve.get_replica_context().servable_object._api_key_digest


def _replica_admission() -> AdmissionState:
    return serve.get_replica_context().servable_object.admission


def _replica_body_limit() -> int:
    return serve.get_replica_context().servable_object.cfg.max_request_body_bytes


def _replica_body_timeout() -> float:
    return serve.get_replica_context().servable_object.cfg.body_timeout_s


def _replica_remote_allowed() -> bool:
    return serve.get_replica_context().servable_object.cfg.allow_unauthenticated


# the last added runs first: the key is checked before a request takes a place in the gate, and
# the body is read (at most max_request_body_bytes of it, within body_timeout_s) only once it has a
# place, and only on a route that takes one
app.add_middleware(BodyLimit, max_bytes=_replica_body_limit, takes_body=body_routes(),
                   timeout_s=_replica_body_timeout)
app.add_middleware(AdmissionGate, state=_replica_admission)
app.add_middleware(RequireApiKey, expected=_replica_key_digest, remote_allowed=_replica_remote_allowed)


def _ingress_replica_id() -> str | None:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve
        return None


HEALTH_TIMEOUT_S = 5.0  # a verifier probe that takes longer reads as not ready
HEALTH_PROBE_S = 2.0  # how often the ingress asks a verifier for its health (whatever /health's traffic)
TOKENIZER_WAIT_S = 10.0  # /tokenize, /detokenize: past this in a full verifier's queue, a 429
HEALTH_STALE_S = 3 * HEALTH_PROBE_S + HEALTH_TIMEOUT_S  # /health is 503 when no probe succeeded this recently


async def _awaited(response):
    return await response


def _error_response(err: OpenAIError) -> JSONResponse:
    return error_response(err)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError):
    return _error_response(err)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, err: RequestValidationError):
    errors = err.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                    for e in errors[:5])
    return _error_response(OpenAIError(msg or "invalid request", param=".".join(loc) or None))


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, err: StarletteHTTPException):
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return _error_response(OpenAIError(str(err.detail), status_code=err.status_code, type=kind))


def _as_openai_error(err: BaseException, constraint: str | None = None, retry_after_s: float | None = None,
                     ready: bool = True) -> OpenAIError | None:
    """Errors caused by the request (engine InvalidRequestError, bad values) -> 400; a full queue
    downstream -> 429 (503 while no verifier has answered yet: `ready` False), with Retry-After; the
    request's deadline passed (request_timeout_s) -> 504; its verifier replica lost more often than
    failover retries -> 503, with Retry-After; else None. constraint: the field the request's output
    constraint came from, the `param` of a grammar the verifier could not compile (malformed, past
    llguidance's limits or its compile deadline)."""
    cause = getattr(err, "cause", None) or err  # a RayTaskError carries the replica's exception
    if isinstance(cause, OpenAIError):
        return cause
    if isinstance(cause, RequestTimeoutError) or isinstance(err, RequestTimeoutError):
        return OpenAIError(f"The request timed out: {cause}.", status_code=504, type="timeout_error",
                           code="request_timeout")
    if isinstance(err, REPLICA_LOST) or isinstance(cause, REPLICA_LOST):  # (a dead or hung replica, failed over)
        return OpenAIError("The server lost the model replica serving this request. Try again.", status_code=503,
                           type="service_unavailable", code="replica_lost", retry_after_s=retry_after_s)
    if isinstance(cause, (BackPressureError, DeploymentUnavailableError)):
        if not ready or isinstance(cause, DeploymentUnavailableError):
            return not_ready("no verifier replica is serving yet", retry_after_s)
        return overloaded("every verifier replica's queue is full", retry_after_s)
    if isinstance(cause, EngineOverloadedError):  # with a reason of its own: admission by work (WorkBudgetExceeded)
        return overloaded(getattr(cause, "reason", None) or "the engine's waiting queue is full", retry_after_s)
    if isinstance(cause, InvalidRequestError) or isinstance(err, InvalidRequestError):
        param = constraint if isinstance(cause, InvalidGrammarError) or isinstance(err, InvalidGrammarError) else None
        return OpenAIError(str(cause).strip().splitlines()[-1] if str(cause).strip() else "invalid request",
                           param=param, code=getattr(cause, "code", None))  # (WorkTooLargeError's)
    if isinstance(cause, ValidationError):
        return OpenAIError(str(cause))
    return None


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class ChoiceFormat(Protocol):
    """What a generating route (chat.ChatChoices, completions.CompletionChoices) makes of its choices'
    results; the ingress does the rest: verifier calls, usage, ids, SSE events and errors."""

    id_prefix: str  # of the response's id
    object: str  # of a whole response
    chunk_object: str  # of each streamed event

    def output(self, result):
        """A choice's GenerateResponse or chunk as returned and counted in usage."""

    def choice(self, c: int, result: GenerateResponse) -> dict:
        """Choice c of a whole response."""

    def start_stream(self, num_choices: int) -> list[dict]:
        """A stream begins: the choices sent ahead of any output."""

    def delta(self, c: int, chunk: GenerateChunk) -> dict | None:
        """Choice c's event for this chunk of its output (None: nothing to send)."""


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, args: dict, verifier, api_key=None):
        self.cfg = load_app_args(args)
        # deployments.app resolves the key where the app is built; $RAYSPEC_API_KEY here as well
        # (e.g. set through the runtime_env's env_vars). Only its digest is kept.
        self._api_key_digest = key_digest(resolve_api_key(api_key))
        self.model_name = self.cfg.model_name
        self._model_info: dict | None = None  # the verifier's model_info, asked once (tool parser, max_model_len)
        self.verifier = verifier
        self.failovers = FailoverCounts()  # requests that outlived a lost verifier replica
        self.admission = AdmissionState(self.cfg.ingress_max_ongoing, self.cfg.retry_after_s,
                                        max_tokenizer_in_flight=self.cfg.max_ongoing_tokenizer,
                                        max_per_client=self.cfg.max_ongoing_per_client,
                                        client_header=self.cfg.client_header)
        self.verifier_answered = False  # a verifier replica has answered: the target is loaded
        self._probe = None
        self._healthy_at: float | None = None  # when a verifier last answered a health probe
        self._probe_round: asyncio.Future | None = None  # resolved when the probe's next answer is in
        self._start_readiness_probe()
        self._exposure_check = self._warn_if_exposed()
        self.actor_name = None  # the verifier watches this name: when this replica dies, its requests are aborted
        import ray

        if ray.is_initialized():  # (asking a process outside Ray would start a Ray instance)
            self.actor_name = ray.get_runtime_context().get_actor_name()

    def _start_readiness_probe(self) -> None:
        """Ask a verifier for its health every HEALTH_PROBE_S, in the background: /health answers from
        the last answer, so probing the ingress costs no verifier call. Until a verifier first answers
        (`verifier_answered`) a refusal from a full verifier queue is a 503 `not_ready`, after it a 429."""
        if self._probe is not None and not self._probe.done():
            return
        try:
            loop = asyncio.get_running_loop()  # Serve builds replicas on their event loop
        except RuntimeError:  # built outside Serve (unit tests): no probe
            return

        async def probe():
            while True:
                await self._probe_verifier()
                waiting, self._probe_round = self._probe_round, None
                if waiting is not None and not waiting.done():
                    waiting.set_result(None)
                await asyncio.sleep(HEALTH_PROBE_S if self.verifier_answered else 0.5)

        self._probe = loop.create_task(probe())

    def _stale(self) -> bool:  # no probe answered, and no other verifier answer (a chunk, a call), lately
        last = max(self._healthy_at or 0.0, self.failovers.answered_at or 0.0)
        return not last or time.monotonic() - last > HEALTH_STALE_S

    async def _probe_verifier(self) -> bool:
        """One health call to a verifier replica; its answer is remembered (`_healthy_at`)."""
        try:
            await asyncio.wait_for(_awaited(self.verifier.health.remote()), HEALTH_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - still loading, every replica busy, or the engine down
            logger.debug("verifier health probe failed: %r", err)
            if not isinstance(err, TimeoutError):  # busy (the probe queued behind generation) is not down
                self._healthy_at = None
            return False
        self.verifier_answered = True
        self._healthy_at = time.monotonic()
        return True

    def _warn_if_exposed(self):
        """Ask Serve's controller once where the proxy binds: a warning when that is not loopback and no
        API key is set, or when the proxy lacks its body bounds (deployments.frontend.proxy_guard)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside Serve (unit tests)
            return None

        async def check():
            try:
                import ray
                from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
                controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                host = getattr(await controller.get_http_config.remote(), "host", None)
            except Exception:  # noqa: BLE001 - another Serve version: no warning, nothing else changes
                return
            for warning in (exposure_warning(host, self._api_key_digest is not None), unguarded_warning()):
                if warning:
                    logger.warning(warning)

        return loop.create_task(check())

    # ---- Python handle API ---------------------------------------------------------------
    def _tagged(self, request: Union[GenerateRequest, dict]) -> GenerateRequest:
        """The request as sent to a verifier: with this replica's name (caller) and the deadline (the
        app's request_timeout_s, unless the request brings its own)."""
        request = GenerateRequest.model_validate(request)
        update = {"caller": self.actor_name} if self.actor_name else {}
        if request.timeout_s is None and self.cfg.request_timeout_s is not None:
            update["timeout_s"] = self.cfg.request_timeout_s
        if request.start_by is None and self.cfg.queue_timeout_s is not None:
            update["start_by"] = time.time() + self.cfg.queue_timeout_s
        return request.model_copy(update=update) if update else request

    def _generate_call(self, request: GenerateRequest):
        """A whole request's call, sent again after a failover with the time left of its deadline."""
        started = time.monotonic()
        return call_with_failover(lambda: self.verifier.generate.remote(time_left(request, started)), self.failovers)

    async def generate(self, request: Union[GenerateRequest, dict]) -> GenerateResponse:
        return await self._generate_call(self._tagged(request))

    async def generate_stream(self, request: Union[GenerateRequest, dict]) -> AsyncIterator[GenerateChunk]:
        stream = FailoverStream(self.verifier, self._tagged(request), self.failovers)
        finished = False
        try:
            async for chunk in stream:
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the caller went away: free the verifier's slot
                stream.cancel()

    async def stats(self) -> dict:
        # + this ingress replica's failovers and admission counts, and which replica it is (its counts are its own)
        return {**await self.verifier.get_stats.remote(), **self.failovers.as_dict(), **self.admission.as_dict(),
                "ingress_replica": _ingress_replica_id()}

    def record_routing_stats(self) -> dict:
        """This replica's own counts (failovers, admission), no verifier call: what Serve's controller
        polls per replica, and what a caller reads from one replica through its actor."""
        return {**self.failovers.as_dict(), **self.admission.as_dict(), "ingress_replica": _ingress_replica_id()}

    # ---- HTTP ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        """200 {"status": "ok"} while a verifier replica answered the ingress's background probe in
        the last HEALTH_STALE_S, else 503 (OpenAI error JSON): a readiness probe that fails while the
        target loads or when every verifier is gone or failing. No verifier call per request, and
        nothing of the replicas' state or errors in the answer (the route needs no key)."""
        if self._stale() and self._probe is not None and not self._probe.done():
            # not known to be healthy: wait for the probe's next answer (shared by every /health
            # asking meanwhile, so still no call of their own), as a first probe right after start
            if self._probe_round is None:
                self._probe_round = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._probe_round), HEALTH_TIMEOUT_S + 1)
            except asyncio.TimeoutError:
                pass
        if self._stale():
            return _error_response(OpenAIError("the model is not ready: no verifier replica is answering",
                                               status_code=503, type="service_unavailable", code="not_ready"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                             "owned_by": "rayspec", "root": self.cfg.model}]}

    @app.get("/v1/stats")
    async def http_stats(self):
        return await self.stats()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, http: Request = None):
        # a text_completion (or its SSE stream): n choices per prompt of a batched prompt list. (A comment,
        # not a docstring: FastAPI would put that in /openapi.json, which these routes never had.)
        requests = self._choice_requests(body, http)
        return await self._generate_choices(requests, body, CompletionChoices(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, http: Request = None):
        # a chat.completion (or its SSE stream): n choices, each a message or tool calls
        requests = self._choice_requests(body, http)
        mode = body.tool_call()  # validated by _choice_requests
        parser = await self._tool_parser() if mode is not None and mode.auto else None
        return await self._generate_choices(requests, body, ChatChoices(mode, parser))

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """vLLM's: a prompt's (or chat messages') token ids, their count and max_model_len."""
        self._check_model(body.model)
        request = body.to_verifier(self.cfg.engine.max_model_len)
        return await self._call_method("tokenize", request)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        """vLLM's: token ids -> {"prompt": their text}."""
        self._check_model(body.model)
        body.check(self.cfg.engine.max_model_len)
        return await self._call_method("detokenize", body.tokens)

    # ---- helpers ---------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        """The served name, or the model itself (its hub id or path) answer."""
        if model not in (self.model_name, self.cfg.model):
            raise OpenAIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                              status_code=404, type="not_found_error", param="model", code="model_not_found")

    @staticmethod
    def _usage(results, n: int) -> dict:
        """results: per choice, the response or its last chunk; a prompt's tokens count once."""
        return sum_usage([(r.num_prompt_tokens if c % n == 0 else 0, r.num_output_tokens, r.num_draft_tokens,
                           r.num_accepted_tokens, r.num_cached_tokens if c % n == 0 else 0)
                          for c, r in enumerate(results)])

    def _choice_requests(self, body, http: Request | None = None) -> list[GenerateRequest]:
        """The body's verifier requests, one per choice (choice c: prompt c // n), for its model; with
        the app's tenant_header, each request's prefix cache is its tenant's (tenant_salt)."""
        self._check_model(body.model)
        requests = self._to_generate(body)
        if self.cfg.tenant_header and http is not None:
            tenant = http.headers.get(self.cfg.tenant_header, "")
            requests = [r.model_copy(update={"cache_salt": tenant_salt(tenant, r.cache_salt)}) for r in requests]
        check_work(requests, body.n, self.cfg.work_budget, self.cfg.engine.max_model_len)  # token ids: 400 unqueued
        return expand(requests, body.n)

    def _to_generate(self, body) -> list[GenerateRequest]:
        """The body's verifier requests (one per prompt), validated: limits (LIMITS), values, output
        constraint, all before any RPC; an OpenAIError (400) otherwise."""
        try:
            requests = [self._tagged(r) for r in body.to_generate(self.cfg.engine.max_model_len)]
            for request in requests:
                request.sampling_params()  # reject bad values here, before any RPC
            return requests
        except (OpenAIError, InvalidRequestError, ValidationError) as err:
            raise _as_openai_error(err) from None

    @contextlib.contextmanager
    def _errors_mapped(self, constraint: str | None = None):
        """Around a verifier call: an error the request caused or a full queue leaves as its OpenAIError
        (_as_openai_error: 400, 429 or 503, counted as back-pressure when 429 / 503); any other as it is."""
        try:
            yield
        except Exception as err:  # noqa: BLE001
            mapped = _as_openai_error(err, constraint, self.cfg.retry_after_s, self.verifier_answered)
            if mapped is None:
                raise
            if mapped.code in ("server_overloaded", "not_ready"):
                self.admission.num_backpressured += 1
            raise mapped from None

    async def _verifier_info(self) -> dict:
        if self._model_info is None:
            with self._errors_mapped():
                self._model_info = await call_with_failover(lambda: self.verifier.model_info.remote(), self.failovers)
        return self._model_info

    async def _tool_parser(self) -> ToolCallParser:
        """tool_choice "auto": the app's tool_call_parser, else the one the chat template's markers name."""
        name = self.cfg.tool_call_parser or (await self._verifier_info()).get("tool_call_parser")
        if name is None:
            raise OpenAIError("tool_choice 'auto' (the default when tools are given) reads calls out of the model's "
                              "text, and this model's chat template has a call format none of the parsers knows: "
                              "set the app arg tool_call_parser (llama3_json, hermes, mistral), or send tool_choice "
                              "'required' or a named function (the output is then constrained to a valid call)",
                              param="tool_choice")
        return get_parser(name)

    async def _call_method(self, method: str, *args):
        """A verifier method other than generation (tokenize, detokenize), errors mapped."""
        with self._errors_mapped():  # waits at most TOKENIZER_WAIT_S for a verifier's place (else 429)
            call = call_with_failover(lambda: getattr(self.verifier, method).remote(*args), self.failovers)
            try:
                result = await asyncio.wait_for(call, TOKENIZER_WAIT_S)
            except TimeoutError:
                raise EngineOverloadedError("every verifier replica is busy; try again later") from None
        self.verifier_answered = True
        return result

    async def _call(self, request: GenerateRequest, constraint: str | None = None) -> GenerateResponse:
        with self._errors_mapped(constraint):
            response = await self._generate_call(request)
        self.verifier_answered = True
        return response

    async def _generate_choices(self, requests: list[GenerateRequest], body, route: ChoiceFormat):
        """The response to a generating route's requests, one per choice: whole, or streamed (body.stream)."""
        constraint = body.constraint_field()
        if body.stream:
            return await self._stream_response(requests, body, route, constraint)
        results = [route.output(r) for r in await gather_or_cancel(self._call(r, constraint) for r in requests)]
        choices = [route.choice(c, r) for c, r in enumerate(results)]
        if body.return_token_ids:
            for choice, result in zip(choices, results):
                choice["token_ids"] = list(result.token_ids)
        return {"id": new_id(route.id_prefix), "created": now(), "model": self.model_name, "object": route.object,
                "choices": choices, "usage": self._usage(results, body.n)}

    async def _stream_response(self, requests: list[GenerateRequest], body, route: ChoiceFormat,
                               constraint: str | None = None):
        with self._errors_mapped(constraint):  # every choice's first chunk awaited: request errors still a 400
            streams, firsts = await open_streams(self.verifier, requests, self.failovers)
        self.verifier_answered = True
        return StreamingResponse(self._sse_events(streams, firsts, body, route),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def _sse_events(self, streams, firsts, body, route: ChoiceFormat) -> AsyncIterator[str]:
        rid, created = new_id(route.id_prefix), now()
        include_usage, continuous = body.include_usage, body.continuous_usage
        last: list[GenerateChunk | None] = [None] * len(streams)  # each choice's latest chunk, as counted

        def so_far() -> dict:  # continuous_usage_stats: prompts (once each) and the tokens made so far
            n = body.n
            return sum_usage([(f.num_prompt_tokens if f is not None and c % n == 0 else 0,
                               *((lc.num_output_tokens, lc.num_draft_tokens, lc.num_accepted_tokens)
                                 if (lc := last[c]) is not None else (0, 0, 0)),
                               f.num_cached_tokens if f is not None and c % n == 0 else 0)
                              for c, f in enumerate(firsts)])

        def event(choice: dict | None, usage_block=None) -> str:
            data = {"id": rid, "object": route.chunk_object, "created": created, "model": self.model_name,
                    "choices": [choice] if choice is not None else []}
            if continuous and choice is not None:
                data["usage"] = so_far()
            elif include_usage or continuous:
                data["usage"] = usage_block
            return _sse(data)

        chunks = merged(streams, firsts)
        try:
            for choice in route.start_stream(len(streams)):
                yield event(choice)
            async for c, chunk in chunks:
                last[c] = chunk = route.output(chunk)
                choice = route.delta(c, chunk)
                if choice is not None:
                    if body.return_token_ids:
                        choice["token_ids"] = list(chunk.delta_token_ids)
                    yield event(choice)
            if include_usage and all(last):
                yield event(None, self._usage(last, body.n))
            yield "data: [DONE]\n\n"
        except Exception as err:  # noqa: BLE001 - the status line is gone: report in-band
            logger.exception("stream failed")
            # (not str(err): a replica's exception carries its remote traceback, for the log only)
            mapped = _as_openai_error(err) or OpenAIError(
                f"internal error ({type(err).__name__}); the server's log has the details", 500, "internal_error")
            yield _sse(mapped.body())
        finally:  # the client went away (or an error): unfinished requests are aborted, slots freed
            await chunks.aclose()
