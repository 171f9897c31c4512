"""The one narrow way into NVML: a session that every concern's queries go through.

`lib` is the pynvml module, or anything with its surface: same function names, same NVMLError
classes, so this code runs unchanged in tests. NVML is initialised once per process, and every
call runs on a worker thread with a timeout so a hung driver cannot hang the agent.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, TypeVar, cast

from gpu_agent.errors import AgentError
from gpu_agent.host.threads import daemon_thread
from gpu_agent.printable import printable

_T = TypeVar("_T")
log = logging.getLogger(__name__)

_INIT_REMEDIES = {
    "NVMLError_LibraryNotFound": "NVML library (libnvidia-ml.so.1) not found: the NVIDIA driver is not installed",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded (modprobe nvidia, or check dmesg)",
    "NVMLError_NoPermission": "no permission to open /dev/nvidiactl: run the agent as root",
    "NVMLError_LibRmVersionMismatch": (
        "NVML library and kernel module versions differ (half-finished driver upgrade): "
        "reload the nvidia modules or reboot"
    ),
}


class NvmlUnavailable(AgentError):
    """NVML cannot be initialised: no driver, driver not loaded, version mismatch."""

    def __init__(self, message: str, no_driver: bool = False) -> None:
        super().__init__(message)
        self.no_driver = no_driver


class NvmlHung(AgentError):
    """An NVML call did not return in time; the driver is presumed hung."""


class _TimedCalls:
    """Runs calls on worker threads; a call past its timeout marks NVML hung until it returns.

    The workers are daemon threads: one stuck in a hung driver must not keep the process from
    exiting on SIGTERM (a ThreadPoolExecutor's workers are joined at exit).
    """

    _WORKERS = 4

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_worker = threading.local()
        for n in range(self._WORKERS):
            daemon_thread(self._work, f"nvml-{n}").start()
        self._lock = threading.Lock()
        self._stuck: dict[Future[Any], tuple[str, float]] = {}
        self.timeouts = 0

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any, extra_timeout: float = 0.0) -> Any:
        batch = getattr(self._on_worker, "future", None)
        if batch is not None:  # a call within a batch (a sample): the batch's timeout covers it
            batch.current_call = name  # what a timeout of the batch names
            return fn(*args)
        with self._lock:
            if self._stuck:
                stuck_name, since = next(iter(self._stuck.values()))
                raise NvmlHung(
                    f"NVML call {stuck_name} has not returned for {time.monotonic() - since:.0f} s "
                    f"(the driver looks hung); {name} not attempted"
                )
        started = time.monotonic()
        future: Future[Any] = Future()
        self._queue.put((future, fn, args))
        try:
            return future.result(timeout=self.timeout + extra_timeout)
        except FutureTimeout:
            name = getattr(future, "current_call", name)
            with self._lock:
                self.timeouts += 1
                self._stuck[future] = (name, started)
            future.add_done_callback(self._unstick)
            raise NvmlHung(
                f"NVML call {name} did not return within {self.timeout + extra_timeout:g} s (the driver looks hung)"
            ) from None

    def _unstick(self, future: Future[Any]) -> None:
        with self._lock:
            name, since = self._stuck.pop(future, ("?", 0.0))
        log.warning("NVML call %s returned after %.1f s; NVML is usable again", name, time.monotonic() - since)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            self._on_worker.future = future
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)
            finally:
                self._on_worker.future = None

    def close(self) -> None:
        for _ in range(self._WORKERS):
            self._queue.put(None)


class NvmlSession:
    """NVML's initialisation, its timed calls, batches of calls and GPU handles, and two counters the
    concerns' caches follow: `generation` moves at each reconcile pass's start and each change this
    agent makes to the GPUs (a reading taken across one is not kept; 0: no pass has begun, so nothing
    is kept), `changes` at each such change and each initialisation (what is read once per GPU is
    read again)."""

    def __init__(self, lib: Any, call_timeout: float = 5.0) -> None:
        self.lib = lib
        self._call = _TimedCalls(call_timeout)
        self._init_lock = threading.Lock()
        self._initialised = False
        self._paused: Optional[str] = None  # why NVML is let go (the driver is being reloaded, the agent stops)
        self._gate = threading.Lock()  # _paused and _waits change together, so no wait slips past a pause
        self._waits: dict[object, float] = {}  # blocking waits in flight (XID events): when each must end
        self._batch = threading.local()  # `handles`: the GPU handles asked for in the batch running on this thread
        self._counters_lock = threading.Lock()
        self.generation = 0
        self.changes = 0

    @property
    def call_timeout(self) -> float:
        return self._call.timeout

    @call_timeout.setter
    def call_timeout(self, seconds: float) -> None:
        self._call.timeout = seconds

    @property
    def timeouts(self) -> int:
        return self._call.timeouts

    def call(self, name: str, *args: Any, extra_timeout: float = 0.0) -> Any:
        """lib.name(*args) on a worker, under the timeout (within a batch: on the batch's worker); refused
        with NvmlUnavailable while NVML is let go. A call given extra_timeout is a blocking wait."""
        token = object()
        with self._gate:
            if self._paused is not None and name != "nvmlShutdown":
                raise NvmlUnavailable(self._paused)
            if extra_timeout:
                self._waits[token] = time.monotonic() + self._call.timeout + extra_timeout
        try:
            result = self._call(name, getattr(self.lib, name), *args, extra_timeout=extra_timeout)
        except self.lib.NVMLError as exc:
            exc.call = name  # so a message can say which query failed
            raise
        finally:
            if extra_timeout:
                with self._gate:
                    del self._waits[token]
        return printable(result) if type(result) is str else result  # a name, UUID or version: shown everywhere

    def init(self) -> None:
        """Initialise NVML once per process; later calls are free. Raises NvmlUnavailable."""
        if self._initialised:
            return
        with self._init_lock:
            if self._initialised:
                return
            if self._paused is not None:
                raise NvmlUnavailable(self._paused)
            try:
                self.call("nvmlInit")
            except self.lib.NVMLError as exc:
                kind = type(exc).__name__
                reason = _INIT_REMEDIES.get(kind, f"NVML initialisation failed: {exc}")
                raise NvmlUnavailable(reason, no_driver=kind == "NVMLError_LibraryNotFound") from None
            with self._counters_lock:
                self.changes += 1
            self._initialised = True

    def close(self) -> None:
        """For good: no call is made after it. NVML holds nvmlShutdown until a blocking wait in flight
        returns (an H200 with driver 580: 4.5 s behind a 5 s nvmlEventSetWait), so with one in flight
        the shutdown is left to the process's exit, which releases NVML as well."""
        with self._init_lock:
            waiting = self._let_go("NVML is closed")
            if waiting and self._initialised:
                log.debug("nvmlShutdown left to the process exit: a blocking NVML wait ends in %.1f s", waiting)
                self._initialised = False
            self._shutdown()
        self._call.close()

    def _let_go(self, reason: str) -> float:
        """Refuse new calls with `reason`; the seconds until the last blocking wait in flight ends (0: none)."""
        with self._gate:
            self._paused = reason
            now = time.monotonic()
            return max([0.0, *(end - now for end in self._waits.values())])

    def _shutdown(self, wait_s: float = 0.0) -> None:
        """nvmlShutdown when initialised, given `wait_s` more than a call's timeout; with the init lock held."""
        if self._initialised:
            try:
                self.call("nvmlShutdown", extra_timeout=wait_s)
            except (self.lib.NVMLError, NvmlHung) as exc:
                log.debug("nvmlShutdown: %s", exc)
            self._initialised = False

    def pause(self, reason: str) -> None:
        """Let the driver go (nvmlShutdown: this process no longer holds the nvidia module) and refuse every
        call, with `reason`, until resume(). The shutdown waits for a blocking wait in flight to end (the
        XID watcher's, up to its timeout), which NVML makes it wait for, instead of calling NVML hung."""
        with self._init_lock:
            self._shutdown(self._let_go(reason))
        self.gpus_changed()

    def resume(self) -> None:
        self._paused = None
        self.gpus_changed()

    def forget_readings(self) -> None:
        """A pass begins, or the GPUs changed outside NVML's calls (a GPU reset): what was read is read again."""
        with self._counters_lock:
            self.generation += 1

    def gpus_changed(self) -> None:
        """This agent changed the GPUs' MIG geometry (even half-way): nothing read before is reused."""
        with self._counters_lock:
            self.generation += 1
            self.changes += 1

    def batch(self, name: str, fn: Callable[..., _T], *args: Any) -> _T:
        """fn(*args), whose NVML calls go to a worker together, under one timeout (a timeout names the
        call that hung): for many quick queries, a thread hop each costs more than the queries. Within
        it, each GPU's handle is asked for once."""
        self.init()
        return cast(_T, self._call(name, self._batched, fn, *args))

    def _batched(self, fn: Callable[..., _T], *args: Any) -> _T:
        if getattr(self._batch, "handles", None) is not None:  # a batch within a batch: the outer one's
            return fn(*args)
        self._batch.handles = {}
        try:
            return fn(*args)
        finally:
            self._batch.handles = None

    def handle(self, index: int) -> Any:
        """The GPU's NVML handle; within a batch, asked for once."""
        handles: Optional[dict[int, Any]] = getattr(self._batch, "handles", None)
        if handles is None:
            return self.call("nvmlDeviceGetHandleByIndex", index)
        handle = handles.get(index)
        if handle is None:
            handle = handles[index] = self.call("nvmlDeviceGetHandleByIndex", index)
        return handle

    def count(self) -> int:
        return int(self.call("nvmlDeviceGetCount"))


def describe(exc: Exception) -> str:
    """An NVMLError as `nvmlDeviceGetUUID: GPU is lost`; one pynvml has no words for by its name
    (`InsufficientResources (NVML error 23)`, not `NVML Error with code 23`)."""
    call = getattr(exc, "call", None)
    text = str(exc)
    if text.startswith("NVML Error with code"):
        text = f"{type(exc).__name__.removeprefix('NVMLError_')} (NVML error {getattr(exc, 'value', '?')})"
    return f"{call}: {text}" if call else text


def short_bus_id(bus_id: str) -> str:
    """NVML's 00000000:18:00.0 as the kernel and nvidia-smi write it: 0000:18:00.0."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower() if rest else bus_id.lower()


def text_of(value: Any) -> str:
    return printable(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
