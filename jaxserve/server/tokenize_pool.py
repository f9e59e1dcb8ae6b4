"""Tokenization and chat templating for the server, in worker processes.

  event loop (gRPC handlers)                 worker processes (spawned at start-up)
  --------------------------                 --------------------------------------
  small text: tokenizer.encode inline        each holds a copy of the tokenizer and
  large text or chat: await pool.encode ───▶ returns token ids (a pickled list)
    (text pickled to a pipe, ids back)

Why processes and not threads: ``tokenizers`` releases the GIL while it
encodes, but freeing the ``Encoding`` of a long text (its tokens, offsets
and masks) runs with the GIL held. On the dev machine (AMD EPYC, 2 cores,
AVX-512) two threads tokenizing 1.2 MB texts held it for up to 0.5 s at a
time and a health check on the event loop waited up to 1.4 s; with workers
in other processes the event loop only pickles the text and unpickles the
ids (about 5 ms for 240,000 ids). Workers are spawned, never forked: the
server process runs JAX and gRPC threads. They ignore SIGINT (a Ctrl-C in
the terminal reaches the whole process group; the server itself shuts them
down), and each exits within half a second of the server process ending,
however it ends (the server leaves with ``os._exit``, and a worker's own
copy of the task pipe would keep it waiting forever).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time

_TOKENIZER = None  # the worker's copy


def _init_worker(tokenizer) -> None:
    global _TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _TOKENIZER = tokenizer
    parent = os.getppid()

    def watch_parent():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch_parent, name="jaxserve-watch-parent", daemon=True).start()


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return _TOKENIZER.encode(text, add_special_tokens=add_special_tokens)


def _chat_ids(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    import jinja2  # the worker imported it with the tokenizer's chat template module
    try:
        return _TOKENIZER.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, tools=tools)
    except (ValueError, jinja2.TemplateError) as e:
        raise ValueError(str(e)) from None  # a plain ValueError pickles back


def _ready() -> bool:
    return _TOKENIZER is not None


class TokenizerPool:
    """``workers`` processes that tokenize for the event loop.

    Args:
      tokenizer: a picklable ``checkpoints.tokenizer.Tokenizer``.
      workers: processes (each costs about its tokenizer's size in memory).
    """

    def __init__(self, tokenizer, workers: int = 2):
        self._tokenizer = tokenizer
        self.workers = workers
        self.num_restarts = 0
        self._pool = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(self._tokenizer,))

    async def _run(self, fn, *args):
        """``fn(*args)`` in a worker. A pool whose worker died (killed, out of
        memory) is broken for good in ``concurrent.futures``: it is replaced
        by a new one and the call tried once more there.

        Raises:
          concurrent.futures.process.BrokenProcessPool: the new pool broke too.
        """
        loop = asyncio.get_running_loop()
        pool = self._pool
        try:
            return await loop.run_in_executor(pool, fn, *args)
        except concurrent.futures.process.BrokenProcessPool:
            if self._pool is pool:  # the first caller to notice replaces it
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
                self.num_restarts += 1
            return await loop.run_in_executor(self._pool, fn, *args)

    def start(self) -> None:
        """Start every worker now and wait until each holds the tokenizer
        (a second or so), so the first large prompt does not pay for it."""
        for f in [self._pool.submit(_ready) for _ in range(self.workers)]:
            f.result()

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``Tokenizer.encode`` in a worker)."""
        return await self._run(_encode, text, add_special_tokens)

    async def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the chat template and the
        generation prompt (``tools``: the template's ``tools`` variable).

        Raises:
          ValueError: the template rejected the conversation (its message).
        """
        return await self._run(_chat_ids, messages, tools)

    def close(self) -> None:
        """Stop the workers: queued work is dropped, work in progress ends
        first (the wait also releases the pool's semaphores, which the
        multiprocessing resource tracker would otherwise report as leaked)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["TokenizerPool"]
