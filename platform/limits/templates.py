"""Chat templates rendered off the event loop, in processes that are killed at the limit.

A Jinja template is a program: ``{% for a in range(99999) %}{% for b in range(99999) %}``
runs for hours and a thread cannot be stopped. :class:`TemplateRenderer` keeps up to
``workers`` worker processes (``template_worker.py``; started through the
``forkserver``, sandboxed Jinja, address space capped); each render goes to an idle one and
the event loop waits on the pipe without blocking. A render that passes
``chat_template_render_timeout_s`` gets its worker killed (SIGKILL) and replaced; one whose
text passes ``max_rendered_prompt_chars`` is refused. Used by the chat route for templates
a caller supplied (after :func:`~loramux.platform.limits.request.check_chat_template`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
from collections.abc import Mapping
from typing import Any

from loramux.platform.limits import template_worker
from loramux.platform.limits.request import RequestLimitError, RequestLimits

WORKER_MODULE = "loramux.platform.limits.template_worker"


def template_variables(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None):
    """What ``tokenizer.apply_chat_template`` shows a template besides the messages: the
    special tokens (``bos_token``, ``eos_token``, …) and the request's extra kwargs."""
    return {**tokenizer.special_tokens_map, **(chat_template_kwargs or {})}


class _Worker:
    def __init__(self, process: Any, conn: multiprocessing.connection.Connection) -> None:
        self.process = process
        self.conn = conn

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()


class TemplateRenderer:
    """Renders chat templates in killable worker processes. One per process.

    ``limits`` gives the time limit and the output cap; ``workers`` bounds how many
    renders run at once (others wait for a free worker, and that wait is not timed);
    ``extra_memory_bytes`` caps what one render may allocate.
    """

    def __init__(
        self,
        limits: RequestLimits | None = None,
        *,
        workers: int = 1,
        extra_memory_bytes: int = 512 << 20,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.limits = limits or RequestLimits()
        self.extra_memory_bytes = extra_memory_bytes
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload([WORKER_MODULE])
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._closed = False

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=template_worker.serve,
            args=(child, self.extra_memory_bytes),
            name="loramux-template",
            daemon=True,
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    async def render(
        self,
        template: str,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
        param: str = "chat_template",
    ) -> str:
        """The text of ``conversation`` rendered with ``template`` (a Jinja source), as
        ``tokenizer.apply_chat_template(..., tokenize=False)`` would render it, given
        ``variables`` from :func:`template_variables`. Raises :class:`RequestLimitError`
        (``param``) for a timeout, an oversized result or a template error."""
        if self._closed:
            raise RuntimeError("the template renderer is closed")
        job = (template, conversation, add_generation_prompt, dict(variables or {}),
               self.limits.max_rendered_prompt_chars)  # fmt: skip
        async with self._slots:
            worker = self._idle.pop() if self._idle else await asyncio.to_thread(self._start)
            try:
                reply = await self._ask(worker, job, param)
            except BaseException:
                await asyncio.to_thread(self._dispose, worker)
                raise
            self._idle.append(worker)
        kind, value = reply
        if kind == "ok":
            return value
        if kind == "too_long":
            raise RequestLimitError(
                param, f"the chat template rendered {value} characters, more than this server "
                f"allows ({self.limits.max_rendered_prompt_chars}, max_rendered_prompt_chars)",
            )  # fmt: skip
        raise RequestLimitError(param, f"the chat template failed: {value}")

    async def _ask(self, worker: _Worker, job: tuple, param: str) -> tuple[str, Any]:
        timeout = self.limits.chat_template_render_timeout_s
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            worker.conn.send(job)
            await asyncio.wait_for(ready, timeout)
            return worker.conn.recv()
        except asyncio.TimeoutError:
            raise RequestLimitError(
                param, f"the chat template took longer than {timeout:g} s to render "
                "(chat_template_render_timeout_s)",
            ) from None  # fmt: skip
        except (EOFError, OSError):
            raise RequestLimitError(
                param, "the chat template stopped its worker (memory limit?)"
            ) from None
        finally:
            loop.remove_reader(fd)

    @staticmethod
    def _dispose(worker: _Worker) -> None:
        worker.kill()
        worker.process.join(5)

    def close(self) -> None:
        """Stop the idle workers without an event loop (shutdown from synchronous code);
        a render in flight ends at its time limit."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            self._dispose(worker)

    async def aclose(self) -> None:
        """Stop the workers. Called at shutdown."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            await asyncio.to_thread(self._dispose, worker)
