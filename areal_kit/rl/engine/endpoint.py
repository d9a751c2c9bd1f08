"""An OpenAI-compatible chat endpoint over a streaming rollout engine, for agents written against `openai`.

vLLM's own chat server (OpenAIServingChat, its models and renderer) runs in process around the
engine's AsyncLLM: over HTTP from a uvicorn task on the engine's event loop, and without HTTP to
agents beside the engine that call through areal_kit.agent_client (the app then runs on the
agent's event loop, only the generation on the engine's). Each episode gets an
API key of its own; the calls made with it are recorded token-exact: the ids vLLM rendered the
prompt to, the ids it sampled (never re-tokenized text) and their processed logprobs, so an
agent's episode trains on exactly what the engine saw and sampled. A call answered with an error
status (refused, or failed in vLLM) is counted (take_failed_calls). Under LoRA each call names the
adapter of the weight version it is recorded with (vLLM serves an adapter only under a name in
its models' lora_requests), so the version and the weights that sampled stay one.

    ep = ChatEndpoint(llm, model_path, "policy", chat_template=template, temperature=1.0)
    base_url = ep.start()
    key = ep.open_episode(seed=7)
    ... the agent: openai.OpenAI(base_url=base_url, api_key=key).chat.completions.create(...)
    ... or in process: AsyncOpenAI(base_url=base_url, api_key=key, http_client=agent_client.http_client(base_url))
    trajectory = episode_of(ep.close_episode(key))    # segments.py

    .venv/bin/python -m pytest tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import contextvars
import secrets
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from http import HTTPStatus
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from areal_kit import agent_client
from areal_kit.rl.workflow import call_seed

if TYPE_CHECKING:
    from fastapi import Request
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.logprobs import Logprob
    from vllm.outputs import RequestOutput

    from areal_kit.rl.engine.streaming_llm import StreamingLLM


@dataclass
class Call:
    """One choice of a chat completion the engine served, token-exact; a request with n > 1 gives n."""

    prompt_ids: list[int]  # the ids the engine was given: vLLM's rendered and tokenized prompt
    token_ids: list[int]  # the ids it sampled for this choice
    logprobs: list[float]  # the sampling logprob of each (processed: after temperature)
    finish_reason: str
    version: int  # the engine's weight version when the call began (its oldest possible token)
    call: int = 0  # the call's index within the episode
    choice: int = 0  # the choice's index within the call (0 unless n > 1)


@dataclass
class _Episode:
    seed: int | None
    calls: list[Call] = field(default_factory=list)
    begun: int = 0  # calls accepted so far: the next call's index
    # The time the endpoint spent on the episode's calls (reading, queueing, generating, answering),
    # as the union of their spans: the agent's own time is the rest (AgentEpisodes' timeout).
    in_flight: int = 0  # calls being served now
    busy_since: float = 0.0  # when in_flight last went from 0 to 1
    served_s: float = 0.0  # seconds with a call being served, up to busy_since

    def begin(self, now: float) -> None:
        if self.in_flight == 0:
            self.busy_since = now
        self.in_flight += 1

    def end(self, now: float) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.served_s += now - self.busy_since

    def serving_seconds(self, now: float) -> float:
        return self.served_s + (now - self.busy_since if self.in_flight else 0.0)


# The episode, index and version of the call being served, from the request's handler to the
# engine's output stream it wraps (the stream is made, not yet read, in the handler's context).
_CURRENT: contextvars.ContextVar[tuple[_Episode, int, int]] = contextvars.ContextVar("areal_endpoint_call")


class ChatEndpoint:
    def __init__(self, llm: StreamingLLM, model_path: str, served_name: str, *, chat_template: str | None = None,
                 tool_parser: str | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_tokens: int = 1024, host: str = "127.0.0.1", version: Callable[[], int] | None = None,
                 adapter: Callable[[int], Any] | None = None) -> None:
        self.llm, self.model_path, self.served_name = llm, model_path, served_name
        self.chat_template, self.tool_parser = chat_template, tool_parser
        # The run's sampling: the logprobs the engine records are those the trainer recomputes.
        self.sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.max_tokens, self.host = max_tokens, host
        # The weight version a call is recorded with: the rollout worker's (the engine's by default).
        self.version = version or (lambda: llm.version)
        # LoRA: the LoRARequest that serves a weight version (None: the base, as for version 0).
        self.adapter = adapter
        self._models: Any = None  # vLLM's OpenAIServingModels: the names it serves
        self._failed = 0  # calls answered with an error status since the last take_failed_calls
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()  # episodes open and close on callers' threads, record on the loop's
        self._server: Any = None  # uvicorn's Server, serving on the engine's loop
        self._task: asyncio.Task | None = None
        self._url = ""
        self._asgi: ASGIApp | None = None
        # Seconds the endpoint's calls spent rendering (template and tokenizer) and in the engine
        # (from the request to its last output, queueing included), and the calls: cheap counters
        # read by bench/endpoint.py (take_timings).
        self._timings = {"calls": 0.0, "render": 0.0, "engine": 0.0}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Serve HTTP on a free port on the engine's event loop, and in process to this process's
        agent_client.http_client(base URL); returns the base URL (…/v1)."""
        self._url = self.llm._run(self._start())
        agent_client.serve(self._url, self._asgi)
        return self._url

    async def _start(self) -> str:
        app = self._app()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        # log_config None: leave the process's logging as it is; no access log (keys never reach
        # it, but a line per call is noise).
        self._asgi = self._auth(app)  # served over HTTP and, in process, through agent_client
        self._server = app.state.server = uvicorn.Server(uvicorn.Config(
            self._asgi, lifespan="off", log_config=None, access_log=False, log_level="warning"))
        task = self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if task.done():
                task.result()  # its error
                raise RuntimeError("the chat endpoint's server stopped as it started")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        return f"http://{self.host}:{port}/v1"

    def _app(self) -> FastAPI:
        """vLLM's chat and models routes over the engine, built as its init_app_state and build_app do."""
        from vllm.entrypoints.openai.chat_completion import api_router as chat_router
        from vllm.entrypoints.openai.models import api_router as models_router
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_renderer import OnlineRenderer

        engine = self.llm.engine
        register_parsers()
        template = load_chat_template(self.chat_template)
        auto_tools = self.tool_parser is not None
        models = OpenAIServingModels(engine_client=engine,
                                     base_model_paths=[BaseModelPath(name=self.served_name,
                                                                     model_path=self.model_path)])
        renderer = OnlineRenderer(model_config=engine.model_config, renderer=engine.renderer, request_logger=None,
                                  chat_template=template, chat_template_content_format="auto",
                                  enable_auto_tools=auto_tools, tool_parser=self.tool_parser)
        renderer.warmup()
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.state.openai_serving_models = self._models = models
        app.state.openai_serving_chat = _recording_chat(
            self, engine_client=agent_client.EngineOnItsLoop(engine, self.llm.loop), models=models,
            response_role="assistant", online_renderer=renderer, request_logger=None, chat_template=template, chat_template_content_format="auto",
            enable_auto_tools=auto_tools, tool_parser=self.tool_parser)
        chat_router.attach_router(app)
        models_router.attach_router(app)
        # vLLM's error handlers read the server's arguments (whether to log the stack), its engine
        # and its server (stopped once the engine is dead): without them a refused call (a chat over
        # the context, a malformed message) became a bare 500 from the handler's own AttributeError.
        app.state.args = SimpleNamespace(log_error_stack=False)
        app.state.engine_client = engine
        app.state.server = None  # the uvicorn server, once _start made it
        init_exception_handler(app)
        return app

    def _auth(self, app: ASGIApp) -> ASGIApp:
        """The app behind a check that each request's bearer key is an open episode's; the episode
        goes to the handler in the request's state."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        def counting(send: Send) -> Send:
            async def counted(message: Message) -> None:
                if message["type"] == "http.response.start" and message["status"] >= 400:
                    with self._lock:
                        self._failed += 1
                await send(message)
            return counted

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                send = counting(send)  # a refused or failed call, this key's or an unknown one's
                headers = dict(scope["headers"])
                scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
                with self._lock:
                    episode = self._episodes.get(key) if scheme.lower() == "bearer" else None
                if episode is None:
                    error = create_error_response("no open episode has this API key", err_type="AuthenticationError",
                                                  status_code=HTTPStatus.UNAUTHORIZED)
                    return await JSONResponse(error.model_dump(), status_code=401)(scope, receive, send)
                scope.setdefault("state", {})["episode"] = episode
                with self._lock:
                    episode.begin(time.monotonic())
                try:
                    return await app(scope, receive, send)
                finally:
                    with self._lock:
                        episode.end(time.monotonic())
            await app(scope, receive, send)

        return guarded

    def shutdown(self) -> None:
        """Stop serving (the requests in flight finish first); the engine stays up, the caller's to stop."""
        if self._server is not None:
            agent_client.unserve(self._url)
            self._server.should_exit = True
            self.llm._run(self._stopped(), timeout=30)
            self._server = None

    async def _stopped(self) -> None:
        if self._task is not None:
            await self._task

    # ------------------------------------------------------------ episodes
    def open_episode(self, seed: int | None = None) -> str:
        """A fresh API key; the calls made with it are recorded. With a seed, each call that names
        none samples with one of its own, from the seed and the call's index in the episode."""
        key = secrets.token_urlsafe(24)
        with self._lock:
            self._episodes[key] = _Episode(seed)
        return key

    def close_episode(self, key: str) -> list[Call]:
        """The episode's calls, in the order they were made (a call still in flight when the
        episode closes is not among them); the key stops working."""
        with self._lock:
            episode = self._episodes.pop(key)
            return sorted(episode.calls, key=lambda c: (c.call, c.choice))

    def serving_seconds(self, key: str) -> float:
        """Seconds the endpoint has spent serving the episode's calls so far (a call in flight
        counts up to now): time the agent waited on the engine, its queue included."""
        with self._lock:
            episode = self._episodes.get(key)
            return episode.serving_seconds(time.monotonic()) if episode is not None else 0.0

    def take_timings(self) -> dict[str, float]:
        """Seconds the calls since the last take spent rendering and in the engine, and their count."""
        with self._lock:
            out, self._timings = self._timings, dict.fromkeys(self._timings, 0.0)
        return out

    def take_failed_calls(self) -> int:
        """The calls answered with an error status (4xx, 5xx) since the last take."""
        with self._lock:
            n, self._failed = self._failed, 0
        return n

    # ------------------------------------------------------------ a call
    def _admit(self, request: ChatCompletionRequest, episode: _Episode) -> int | ErrorResponse:
        """Set the request up to be recorded and return its index in the episode, or return the
        error response that refuses it."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        for name, value in self.sampling.items():
            asked = getattr(request, name)
            if asked is not None and asked != value and not (name == "top_k" and asked in (0, -1) and value in (0, -1)):
                return create_error_response(
                    f"{name}={asked} asked; this endpoint samples at {name}={value}, the run's (ppo.gen: the "
                    "trainer recomputes the logprobs with it): leave it out or send that", param=name)
        if request.use_beam_search or request.logprob_token_ids:
            return create_error_response("beam search and logprob_token_ids are not served: a call's record holds "
                                         "the logprobs of the tokens it sampled")
        for name, value in self.sampling.items():
            setattr(request, name, value)
        # Agents name whatever model they were written for; this endpoint serves the one policy.
        request.model = self.served_name
        # max_tokens read from the fields (its deprecated getter warns on every call); vLLM reads it
        # only where max_completion_tokens is None, which it no longer is.
        asked = request.max_completion_tokens
        asked = vars(request).get("max_tokens") if asked is None else asked
        if asked is not None and asked < 1:
            which = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            return create_error_response(f"{which}={asked} asked; expected 1 to {self.max_tokens} (this endpoint's "
                                         "budget a call: ppo.gen.max_new_tokens), or leave it out", param=which)
        request.max_completion_tokens = self.max_tokens if asked is None else min(asked, self.max_tokens)
        # The record needs the prompt's ids and the sampled tokens' logprobs of every call.
        request.return_token_ids = True
        request.logprobs = True
        with self._lock:
            index = episode.begun
            episode.begun += 1
        if request.seed is None and episode.seed is not None:
            request.seed = call_seed([episode.seed, index])
        return index

    def _serve_adapter(self, request: ChatCompletionRequest, version: int) -> None:
        """Under LoRA, name the adapter of `version`, the version the call is recorded with: vLLM
        serves an adapter only under a name its models know, and gives any other name the base."""
        lora = self.adapter(version) if self.adapter is not None else None
        if lora is not None:
            self._models.lora_requests[lora.lora_name] = lora
            request.model = lora.lora_name

    async def _tap(self, outputs: AsyncIterator[RequestOutput], call: tuple[_Episode, int, int],
                   stream: bool) -> AsyncIterator[RequestOutput]:
        """Pass the engine's outputs on, and record the call's choices once all are done."""
        episode, index, version = call
        prompt: list[int] = []
        got: dict[int, Call] = {}
        t0 = time.perf_counter()
        async for res in outputs:
            if res.prompt_token_ids is not None:
                prompt = list(res.prompt_token_ids)
            for o in res.outputs:
                c = got.setdefault(o.index, Call([], [], [], "", version, index, o.index))
                if not stream:  # a final output holds all of the choice's tokens so far, a stream's only the new
                    c.token_ids, c.logprobs = [], []
                c.token_ids += o.token_ids
                # vLLM types every position's logprobs as optional (a prompt's first has none): a
                # sampled token's are there, as _admit asked for them.
                sampled = cast("list[dict[int, Logprob]]", o.logprobs)
                c.logprobs += [lp[t].logprob for lp, t in zip(sampled, o.token_ids)]
                c.finish_reason = o.finish_reason or ""
            yield res
        with self._lock:
            self._timings["engine"] += time.perf_counter() - t0
        if got and all(c.finish_reason for c in got.values()):
            for c in got.values():
                c.prompt_ids = prompt
            with self._lock:
                episode.calls += got.values()


# Tool parsers of areal-kit's own, by the name agent.tool_parser takes.
PARSERS = {"calc": ("areal_kit.agents.calc_parser", "CalcToolParser")}


def register_parsers() -> None:
    """Make areal-kit's tool parsers known to vLLM by name (imported when first asked for)."""
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    for name, (module, cls) in PARSERS.items():
        ToolParserManager.register_lazy_module(name, module, cls)


def _recording_chat(endpoint: ChatEndpoint, **kwargs: Any) -> OpenAIServingChat:
    """vLLM's OpenAIServingChat (built with kwargs), each call admitted (or refused) by the endpoint
    and its engine outputs recorded; the class is made here, where vLLM is imported."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    class RecordingChat(OpenAIServingChat):
        def __init__(self) -> None:
            super().__init__(**kwargs)
            # Sampling is the request's and the endpoint's alone: a model's generation_config
            # defaults (top_k, top_p, repetition_penalty) would move the logprobs the engine
            # samples with away from those the trainer recomputes.
            self.default_sampling_params = {}
            self.override_max_tokens = None

        async def create_chat_completion(
                self, request: ChatCompletionRequest, raw_request: Request | None = None
        ) -> AsyncGenerator[str, None] | ChatCompletionResponse | ErrorResponse:
            assert raw_request is not None, "vLLM's route passes the request"
            episode = raw_request.state.episode
            version = endpoint.version()
            admitted = endpoint._admit(request, episode)
            if not isinstance(admitted, int):
                return admitted  # the error response
            endpoint._serve_adapter(request, version)
            token = _CURRENT.set((episode, admitted, version))
            try:
                return await super().create_chat_completion(request, raw_request)
            finally:
                _CURRENT.reset(token)

        async def render_chat_request(self, request: ChatCompletionRequest) -> Any:
            t0 = time.perf_counter()
            try:
                return await super().render_chat_request(request)
            finally:
                with endpoint._lock:
                    endpoint._timings["calls"] += 1
                    endpoint._timings["render"] += time.perf_counter() - t0

        def chat_completion_full_generator(
                self, request: ChatCompletionRequest, result_generator: AsyncIterator[RequestOutput], *args: Any,
                **kw: Any) -> Coroutine[Any, Any, ErrorResponse | ChatCompletionResponse]:
            return super().chat_completion_full_generator(
                request, endpoint._tap(result_generator, _CURRENT.get(), False), *args, **kw)

        def chat_completion_stream_generator(
                self, request: ChatCompletionRequest, result_generator: AsyncIterator[RequestOutput], *args: Any,
                **kw: Any) -> AsyncGenerator[str, None]:
            return super().chat_completion_stream_generator(
                request, endpoint._tap(result_generator, _CURRENT.get(), True), *args, **kw)

    return RecordingChat()
