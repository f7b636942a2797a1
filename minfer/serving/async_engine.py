"""The engine behind an HTTP server: requests arrive one by one, while the batch is running.

`LLM.generate` knows every request before it starts. A server does not: a request can arrive
at any moment, and it should join the running batch at the very next step, not wait for the
batch to end. So one background task steps the engine for as long as anything is unfinished, and
each HTTP handler only adds its request and then awaits that request's outputs on a queue of
its own:

    handler A ──add──┐                    ┌──> queue A ──> handler A streams its tokens
    handler B ──add──┼──> engine thread ──┼──> queue B ──> handler B
    (later) C ──add──┘   step, step, ...  └──> queue C

The engine is not thread-safe, and a step takes tens of milliseconds of CPU: run on the event
loop it would freeze every connection meanwhile. So all engine work (tokenizing and adding
requests, steps, aborts) runs on one worker thread, in the order it was handed over; the event
loop only hands work over and routes each step's outputs to the queues. The one thing that
crosses back is a frozen snapshot of the engine's state (`minfer.engine.snapshot.EngineSnapshot`),
taken on the engine thread after each step, add and abort: the event loop never reads the
scheduler's lists while the engine thread changes them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Protocol, Union

from minfer.engine.snapshot import EngineSnapshot
from minfer.llm import LLM, PromptType
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams

log = logging.getLogger("minfer.serving")


class QueueFull(Exception):
    """More requests wait than the server admits (HTTP 503 with Retry-After)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests (HTTP 503)."""


class RequestFailed(Exception):
    """The engine could not finish a request (its step raised); the message says why."""


@dataclass
class RequestGroup:
    """The requests of one HTTP call (one per prompt) and the queue their outputs arrive on."""

    request_ids: list[str]
    queue: asyncio.Queue


class OutputListener(Protocol):
    """Told of every output routed to a queue, and of requests that end without one (the server's metrics)."""

    def observe(self, output: RequestOutput, now: float) -> None: ...

    def forget(self, request_id: str) -> None: ...


class AsyncEngine:
    """Steps `llm.engine` in the background while requests come and go.

    max_waiting_requests: how many sequences may wait for a place in the batch before new
    requests are refused with `QueueFull` (None: no bound). max_request_tokens: the most tokens of
    KV cache one call's sequences may hold, prompts and max_tokens (None: no bound; see
    `LLM.add_requests`). listener: told, on the event loop, of every output routed to a queue
    (the server's metrics listen here).
    """

    def __init__(self, llm: LLM, max_waiting_requests: Optional[int] = None,
                 listener: Optional[OutputListener] = None, max_request_tokens: Optional[int] = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests!r}")
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        self.max_request_tokens = max_request_tokens
        self.listener = listener
        self.accepting = True
        self.snapshot: EngineSnapshot = llm.engine.snapshot()
        self._adding = 0  # sequences admitted on the event loop whose add no snapshot shows yet
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minfer-engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake: Optional[asyncio.Event] = None
        self._loop_task: Optional[asyncio.Task] = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="minfer-engine-loop")

    async def shutdown(self) -> None:
        """Stop taking requests, abort what is left, stop the loop and the engine thread."""
        self.accepting = False
        self.end_all("the server shut down before the request finished")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._thread.shutdown(wait=True)

    def end_all(self, reason: str) -> None:
        """End every unfinished request now: its reader gets `RequestFailed(reason)`, the engine aborts it."""
        for request_id in list(self._queues):
            self._end(request_id, RequestFailed(reason))
            self._abort_soon(request_id)

    # ---------------------------------------------------------------- what the server sees
    @property
    def num_running(self) -> int:
        return self.snapshot.num_running

    @property
    def num_waiting(self) -> int:
        return self.snapshot.num_waiting

    @property
    def num_unfinished_requests(self) -> int:
        """Requests whose outputs someone still awaits."""
        return len(self._queues)

    def _install(self, snapshot: EngineSnapshot) -> None:
        if snapshot.version > self.snapshot.version:  # results may resume their awaiters out of order
            self.snapshot = snapshot

    async def run_on_engine_thread(self, fn: Callable, *args):
        """Run fn(*args) on the engine's thread, between steps (e.g. tokenizer work)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def add_requests(self, prompts: list[PromptType], params: Union[SamplingParams, list[SamplingParams]],
                           refuse_beyond_context: bool = False) -> RequestGroup:
        """Check and queue the prompts (all or none); their outputs arrive on one queue.

        Raises ValueError for a bad prompt or parameter (refuse_beyond_context: see `LLM.add_requests`),
        QueueFull or ShuttingDown. The waiting count is checked and the new sequences reserved in one
        go on the event loop, so a burst of requests cannot all pass the check before any is queued."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and takes no new requests")
        params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        sequences = sum(p.n if isinstance(p, SamplingParams) else 1 for p in params_list)  # n completions wait apart
        if self.max_waiting_requests is not None:
            if sequences > self.max_waiting_requests:
                raise ValueError(f"this request would add {sequences} sequences (prompts x n), more than may ever wait "
                                 f"at once ({self.max_waiting_requests}, the server's --max-waiting-requests): send "
                                 "fewer prompts or a smaller n")
            waiting = self.snapshot.num_waiting + self._adding
            if waiting + sequences > self.max_waiting_requests:
                raise QueueFull(f"{waiting} sequences are waiting already and this request adds {sequences} "
                                f"(the limit is {self.max_waiting_requests}): try again shortly")
        queue: asyncio.Queue = asyncio.Queue()

        def add() -> tuple[list[str], EngineSnapshot]:  # on the engine thread: the queue is known before any step
            request_ids = self.llm.add_requests(prompts, params, refuse_beyond_context=refuse_beyond_context,
                                                max_request_tokens=self.max_request_tokens)
            self._queues.update(dict.fromkeys(request_ids, queue))
            return request_ids, self.llm.engine.snapshot()

        self._adding += sequences
        try:
            request_ids, snapshot = await self.run_on_engine_thread(add)
        finally:
            self._adding -= sequences
        self._install(snapshot)
        self._wake.set()
        return RequestGroup(request_ids, queue)

    async def stream(self, group: RequestGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, until every request of the group has finished.

        Outputs are cumulative (vLLM's convention: the text so far). If the reader stops early (a
        client that went away cancels its handler), the unfinished requests are aborted and
        their KV blocks go back to the pool at the next step."""
        index = {request_id: i for i, request_id in enumerate(group.request_ids)}
        unfinished = set(group.request_ids)
        try:
            while unfinished:
                output = await group.queue.get()
                if isinstance(output, Exception):
                    raise output
                if output.finished:
                    unfinished.discard(output.request_id)
                yield index[output.request_id], output
        finally:
            for request_id in unfinished:
                self._queues.pop(request_id, None)
                self._abort_soon(request_id)

    async def generate(self, prompt: PromptType, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """One request's outputs as they come, the last one finished (see `stream`)."""
        group = await self.add_requests([prompt], params)
        async for _, output in self.stream(group):
            yield output

    # ---------------------------------------------------------------- the loop
    def _step(self) -> tuple[list[RequestOutput], EngineSnapshot]:
        return self.llm.step(), self.llm.engine.snapshot()

    async def _run(self) -> None:
        while True:
            if not self.snapshot.has_unfinished:  # (an add or abort installs a newer snapshot, then wakes us)
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs, snapshot = await self.run_on_engine_thread(self._step)
            except Exception as exc:  # a step that raised: its requests end, the server goes on
                await self._fail_all(exc)
                continue
            self._install(snapshot)
            now = time.perf_counter()
            for output in outputs:
                self._route(output, now)
            await asyncio.sleep(0)  # let the handlers stream what just arrived before the next step

    def _route(self, output: RequestOutput, now: float) -> None:
        queue = self._queues.get(output.request_id)
        if queue is None:  # aborted meanwhile
            return
        if self.listener is not None:
            self.listener.observe(output, now)
        errors = [c.stop_reason for c in output.outputs if c.finish_reason == "error"]
        if errors:  # the engine ended this request alone (see Engine._fail)
            log.error("request %s failed: %s", output.request_id, errors[0])
            self._end(output.request_id, RequestFailed(str(errors[0])))
            return
        queue.put_nowait(output)
        if output.finished:
            self._queues.pop(output.request_id, None)

    async def _fail_all(self, exc: Exception) -> None:
        log.error("an engine step failed; ending the requests in flight (%s)", ", ".join(self._queues) or "none",
                  exc_info=exc)
        for request_id in list(self._queues):
            self._end(request_id, RequestFailed(f"the engine step failed: {type(exc).__name__}: {exc}"))
            await self.run_on_engine_thread(self.llm.abort_request, request_id)
        self._install(await self.run_on_engine_thread(self.llm.engine.snapshot))

    def _end(self, request_id: str, exc: Exception) -> None:
        if self.listener is not None:
            self.listener.forget(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(exc)

    def _abort_soon(self, request_id: str) -> None:
        """Queue an abort on the engine thread without awaiting it: callable from a cancelled task."""
        if self.listener is not None:
            self.listener.forget(request_id)
        def abort() -> EngineSnapshot:
            self.llm.abort_request(request_id)
            return self.llm.engine.snapshot()

        def install(done: asyncio.Future) -> None:
            if done.cancelled():
                return
            if done.exception() is not None:
                log.error("aborting request %s failed", request_id, exc_info=done.exception())
            else:
                self._install(done.result())

        try:
            asyncio.get_running_loop().run_in_executor(self._thread, abort).add_done_callback(install)
        except RuntimeError:  # the thread is already shut down (abort during shutdown): nothing runs anymore
            pass
