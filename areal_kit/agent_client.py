"""An in-process HTTP client for agents that run beside the engine whose chat endpoint they call.

An agent (agent.fn) runs in the rollout engine's own process. Over HTTP each of its calls pays
twice for a transport it does not need: the client's connection pool (httpx scans every pooled
connection for each request, so N agents at once cost O(N) a call) and sockets, and the server's
HTTP parsing on the engine's event loop. http_client(base_url) is an HTTP client (of the httpx
the installed openai uses) whose requests go straight to the endpoint's ASGI app when this process
serves base_url, and None otherwise (an agent run elsewhere, or a URL of another server: the
`openai` client then builds its own):

    from openai import AsyncOpenAI
    from areal_kit.agent_client import http_client

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client(base_url))

The endpoint registers its app here when it starts (rl/engine/endpoint.py) and removes it when it
stops. The same requests, the same answers: only the transport differs. The app then runs on the
agent's event loop; EngineOnItsLoop keeps the engine's generation on the engine's own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from typing import Any

try:  # the HTTP library of the openai client it is for: httpx2 from openai 3, httpx before
    import httpx2 as httpx
except ImportError:  # pragma: no cover - an older openai
    import httpx  # type: ignore[no-redef]

_apps: dict[str, Any] = {}  # base URL (…/v1) -> the ASGI app that serves it in this process
_lock = threading.Lock()


def serve(base_url: str, app: Any) -> None:
    """Route this process's http_client(base_url) requests to `app` (an ASGI app)."""
    with _lock:
        _apps[base_url.rstrip("/")] = app


def unserve(base_url: str) -> None:
    with _lock:
        _apps.pop(base_url.rstrip("/"), None)


def http_client(base_url: str) -> httpx.AsyncClient | None:
    """A new httpx client, for AsyncOpenAI, that hands requests for base_url to its app in this
    process; None when no app here serves it. New each time (tens of microseconds: no pool, no
    SSL context), so an agent that closes its client closes only its own."""
    with _lock:
        app = _apps.get(base_url.rstrip("/"))
    if app is None:
        return None
    # No timeout of its own: the openai client's applies per request. trust_env off: a proxy set
    # in the environment has no say over a call that never leaves the process. An error the app
    # does not handle is its 500, as over HTTP, not an exception raised in the agent.
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False), timeout=None,
                             trust_env=False)


class EngineOnItsLoop:
    """An engine (vLLM's AsyncLLM) as the endpoint's app sees it from whichever event loop serves
    the call (an in-process agent's): its generate and abort run on the engine's own loop (its
    queues and sockets are that loop's), their outputs passed over to the caller's; everything
    else is the engine's."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._engine, self._loop = engine, loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def abort(self, *args: Any, **kw: Any) -> Any:
        if asyncio.get_running_loop() is self._loop:
            return await self._engine.abort(*args, **kw)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._engine.abort(*args, **kw), self._loop))

    async def generate(self, *args: Any, **kw: Any) -> AsyncGenerator[Any, None]:
        if asyncio.get_running_loop() is self._loop:
            async for out in self._engine.generate(*args, **kw):
                yield out
            return
        here = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        end = object()

        async def pump() -> None:  # on the engine's loop
            try:
                async for out in self._engine.generate(*args, **kw):
                    here.call_soon_threadsafe(queue.put_nowait, out)
            except BaseException as e:  # noqa: BLE001 - the caller's to raise (CancelledError included)
                here.call_soon_threadsafe(queue.put_nowait, e)
            here.call_soon_threadsafe(queue.put_nowait, end)

        # Cancelled when the caller stops reading (its call cancelled): generate's own cancellation
        # then aborts the request in the engine.
        pumping = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            pumping.cancel()
