"""The daemon's worker threads (asyncio.to_thread): stages, sampling, config loads.

A stage can be blocked in a call that does not return soon: an API request to a hung server, an
NVML call into a hung driver. ThreadPoolExecutor joins its workers at interpreter exit (and
asyncio.run waits for them), so SIGTERM would wait for that call. These workers are daemon
threads and shutdown() never waits: the process exits with the call abandoned, which is safe
because every file write is atomic.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from gpu_agent.host.threads import daemon_thread


class DaemonThreadPool(ThreadPoolExecutor):
    """Same contract as ThreadPoolExecutor's submit(); its own threads and queue.

    It subclasses ThreadPoolExecutor only because loop.set_default_executor() accepts nothing
    else (Python 3.9+); none of the parent's machinery (which joins threads at exit) is used.
    """

    def __init__(self, max_workers: int, name: str = "worker") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=name)
        self._limit = max_workers
        self._name = name
        self._jobs: queue.SimpleQueue[Optional[tuple[Future[Any], Callable[..., Any], tuple[Any, ...],
                                                      dict[str, Any]]]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._workers = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            future: Future[Any] = Future()
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._workers < self._limit:
                self._workers += 1
                daemon_thread(self._work, f"{self._name}-{self._workers}").start()
            return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # the caller handles it, through the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Queued work is dropped; work under way is abandoned, never waited for."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            for _ in range(self._workers):
                self._jobs.put(None)
