"""The queue and the worker thread that runs the engines' batches.

An Engine holds up to n_seq sequences ("slots", serve -np N) in one target context, and
one worker thread runs its steps, so N concurrent requests read the target's weights once
per step (engine/scheduler.py). Requests wait in one bounded FIFO (full: 429 at once,
rather than piling up) and go to the idle slot whose cache holds most of their prompt
within their own cache scope (--slot-prompt-similarity, Engine.enter_scope), so a chat's
next turn finds its history and a slot says nothing of another tenant's prompts. The HTTP
side never blocks: a Job carries an asyncio queue fed through `call_soon_threadsafe`, and a
job whose client went away is cancelled, which frees its slot after the current step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specwire.backend.base import BackendError
from specwire.config import ConfigError
from specwire.drafters.base import LinkStatus
from specwire.engine.engine import Engine, Generation, Request
from specwire.engine.sequence import adapter_scales
from specwire.engine.stats import Stats
from specwire.server.errors import ApiError
from specwire.server.limits import LORA_SCALE_MAX
from specwire.server.metrics import Metrics
from specwire.server.schemas import lora_adapter_scales
from specwire.server.speculation import SpeculationWatch
from specwire.server.stops import StopMatcher
from specwire.text.stream import TextStream

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TextChunk:
    """New text and the tokens it came from (streaming only)."""

    text: str
    tokens: list[int]
    probs: list = field(default_factory=list)    # TokenProb per token, when asked for


@dataclass(slots=True)
class Result:
    """A finished generation, in llama-server's terms."""

    content: str
    tokens: list[int]
    stop_type: str                  # eos | limit | word
    stopping_word: str
    truncated: bool
    tokens_evaluated: int           # prompt length
    tokens_predicted: int
    timings: dict
    slot: int
    drafter: str
    stats: Stats | None = None      # the whole measurement, for the live page
    probs: list = field(default_factory=list)    # TokenProb per token, when asked for


@dataclass(slots=True)
class Progress:
    """Prompt processing so far (return_progress, streaming only): llama-server's
    prompt_progress object."""

    total: int          # prompt tokens
    cache: int          # of them found in the cache
    processed: int      # of them in the cache now (cache included)
    time_ms: float      # since the job began

    def to_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": round(self.time_ms, 3)}


@dataclass(slots=True)
class Done:
    result: Result


@dataclass(slots=True)
class Failed:
    error: ApiError


Event = TextChunk | Progress | Done | Failed


class QueueFull(Exception):
    """No room to wait: the caller answers 429."""


class Draining(Exception):
    """The server is shutting down: the caller answers 503 with Retry-After."""


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry shortly (another instance, or "
                    "this one once restarted)", "unavailable_error", retry_after=5)


@dataclass(eq=False)
class Job:
    """One request on its way through a slot; created on the event loop."""

    request: Request
    stops: Sequence[str] = ()
    stream: bool = False
    special: bool = False   # --special: special tokens print their text
    slot: int | None = None  # id_slot: the slot it must run on (None: any, pick_slot's)
    progress: bool = False   # return_progress: stream Progress while the prompt is read
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cut: bool = False          # cancelled by the shutdown: the client gets a 503, not silence
    finished: bool = False
    created: float = field(default_factory=time.perf_counter)

    def emit(self, event: Event) -> None:
        """From the worker thread: deliver an event to the waiting request."""
        with contextlib.suppress(RuntimeError):   # the loop is gone (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class JobQueue:
    """A bounded FIFO that a waiting job can also leave (its client disconnected).

    The job at its head goes to the idle slot `pick_slot` chooses for it: the one whose
    cache holds most of its prompt, else the least recently used.
    """

    def __init__(self, capacity: int, similarity: float = 0.1) -> None:
        self.capacity = capacity
        self.similarity = similarity
        self._jobs: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._idle = 0          # workers blocked in get(): a job for them does not wait
        self._idle_slots: list[Slot] = []   # those of them that are slots
        self._free = 0          # free slots of the batch worker: it takes a job at its next step

    def has_room(self) -> bool:
        """Whether a job put now would be taken (racy: put decides; this saves the work
        of parsing a request that would be refused)."""
        with self._cv:
            return not self._closed and self._would_wait() <= self.capacity

    def _would_wait(self) -> int:
        """Jobs left waiting, this one included, if one more were put now."""
        n = len(self._jobs) + 1
        return n - min(n, self._idle + self._free)

    def put(self, job: Job) -> None:
        with self._cv:
            if self._closed or self._would_wait() > self.capacity:
                raise QueueFull
            self._jobs.append(job)
            self._cv.notify_all()   # the slot picked for it may be any idle one

    def get(self, slot: Slot | None = None) -> Job | None:
        """The oldest job, once `slot` is the idle slot picked for it; blocks until then;
        None once closed."""
        with self._cv:
            self._idle += 1
            if slot is not None:
                self._idle_slots.append(slot)
            try:
                while not self._closed:
                    if self._jobs and (slot is None or pick_slot(
                            self._jobs[0].request, self._idle_slots,
                            self.similarity) is slot):
                        return self._jobs.popleft()
                    self._cv.wait()
                return None
            finally:
                self._idle -= 1
                if slot is not None:
                    self._idle_slots.remove(slot)
                self._cv.notify_all()   # the next job's pick among those left

    def take(self, idle: Sequence[Slot]) -> tuple[Job, Slot] | None:
        """Without blocking: the oldest job and the idle slot `pick_slot` chooses for it;
        None if no job waits or no slot is idle. Records how many slots are free."""
        with self._cv:
            self._free = len(idle)
            if not self._jobs or not idle or self._closed:
                return None
            for job in self._jobs:      # the oldest job that can run now: one asking for a
                if job.slot is None:    # busy slot (id_slot) waits, the others go on
                    slot = pick_slot(job.request, idle, self.similarity)
                else:
                    slot = next((s for s in idle if s.index == job.slot), None)
                if slot is not None:
                    self._jobs.remove(job)
                    self._free -= 1
                    return job, slot
            return None

    def set_free(self, n: int) -> None:
        """How many slots of the batch worker are free (it takes their jobs at once)."""
        with self._cv:
            self._free = n

    def wait(self) -> bool:
        """Block until a job waits or the queue closes; False once closed."""
        with self._cv:
            while not self._closed and not self._jobs:
                self._cv.wait()
            return not self._closed

    def _waiting(self) -> int:
        """Jobs that no idle worker or free slot is about to take."""
        return len(self._jobs) - min(len(self._jobs), self._idle + self._free)

    def remove(self, job: Job) -> bool:
        with self._cv:
            try:
                self._jobs.remove(job)
                return True
            except ValueError:
                return False

    def close(self) -> list[Job]:
        """Stop handing out jobs; return those still waiting."""
        with self._cv:
            self._closed = True
            left = list(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
            return left

    def __len__(self) -> int:
        with self._cv:
            return self._waiting()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_slot(request: Request, idle: Sequence[Slot], similarity: float) -> Slot | None:
    """llama-server's choice of a slot for a request (--slot-prompt-similarity): the idle
    slot whose cached tokens share the longest prefix with its prompt, if that prefix is
    more than `similarity` of the prompt; otherwise (or with similarity 0) the least
    recently used. Only slots whose cache holds the request's own cache scope count."""
    best, best_n = None, 0
    prompt, scope = request.prompt, request.draft.cache_scope
    if similarity > 0 and prompt:
        for s in idle:
            if s.scope != scope:
                continue
            n = common_prefix(s.target.tokens, prompt)
            if n > best_n and n / len(prompt) > similarity:
                best, best_n = s, n
    if best is None:
        best = min(idle, key=lambda s: (s.last_used, s.index), default=None)
    return best


class Slot:
    """One sequence of an engine's batch, and the job it serves."""

    def __init__(self, index: int, engine: Engine, seq: int, metrics: Metrics,
                 watch: SpeculationWatch | None = None) -> None:
        self.index, self.engine, self.seq, self.metrics = index, engine, seq, metrics
        self.watch = watch
        self.target = engine.batch.seq(seq)
        self.drafter = engine.drafters[seq]
        self.job: Job | None = None
        self.gen: Generation | None = None
        self.last_used = 0.0  # time.monotonic() when its last job ended
        self.last_prompt: list[int] = []  # the prompt of its last job (--prompt-cache)
        self._text: TextStream | None = None
        self._stops = StopMatcher(())
        self._clock: _Clock | None = None
        self._done = 0        # tokens whose probabilities were sent
        self._prefilled = -1  # prompt tokens the last Progress reported

    @property
    def scope(self) -> str:
        """The cache scope of the tokens this slot's caches hold."""
        return self.engine.scopes[self.seq]

    def start(self, job: Job) -> None:
        """The job joins the engine's batch in this slot's sequence (at the next step)."""
        self.job = job
        self.last_prompt = job.request.prompt
        target = self.target
        self._text = TextStream(
            (lambda t: target.detokenize(t, special=True)) if job.special else target.detokenize)
        self._stops = StopMatcher(job.stops)
        self._clock = _Clock(self.metrics, job.created)
        self._done = 0
        self._prefilled = -1
        try:
            self.gen = self.engine.generate(job.request, seq=self.seq)
        except Exception as e:  # noqa: BLE001 - the job fails, the slot goes on
            self._fail(e)
            self._end()

    def pump(self) -> None:
        """After a step: hand the job its new text, and its result once the generation
        ended; close it if its client is gone. Never raises."""
        job, gen = self.job, self.gen
        if job is None or gen is None:
            return
        try:
            if job.progress and job.stream:
                self._progress(job, gen)
            new = gen.pending()
            if new:
                self._clock.tick(len(new))
                if job.cancelled.is_set():
                    self._cancelled(job)
                    return
                piece = self._stops.push(self._text.push(new))
                if self._stops.stopped:
                    gen.stop("word")
                    gen.close()
                probs = gen.probs[self._done:self._done + len(new)]
                self._done += len(new)
                if job.stream and (piece or new):
                    job.emit(TextChunk(piece, list(new), probs))
            elif job.cancelled.is_set():
                self._cancelled(job)
                return
            if gen.error is not None:
                self._fail(gen.error)
                self._end()
            elif gen.done:
                self._finish(job, gen)
                self._end()
        except Exception as e:  # noqa: BLE001 - a bug must not kill the worker
            self._fail(e)
            self._end()

    def _progress(self, job: Job, gen: Generation) -> None:
        """return_progress: a Progress each step the prompt advanced, the last one when it
        is all in the cache (before the first token)."""
        done, total = gen.state.prefilled, len(job.request.prompt)
        if done != self._prefilled and self._prefilled < total:
            self._prefilled = done
            job.emit(Progress(total, gen.stats.cache_n, done,
                              (time.perf_counter() - job.created) * 1000))

    def _finish(self, job: Job, gen: Generation) -> None:
        stops = self._stops
        tail = stops.push(self._text.flush())
        tail += stops.finish()
        if job.stream and tail:
            job.emit(TextChunk(tail, []))
        st = gen.stats
        job.emit(Done(Result(
            content=stops.text, tokens=list(gen.tokens), stop_type=gen.stop_type,
            stopping_word=stops.word or "", truncated=gen.truncated,
            tokens_evaluated=len(job.request.prompt), tokens_predicted=len(gen.tokens),
            timings=st.timings(), slot=self.index, drafter=self.drafter.name,
            stats=st, probs=gen.probs[:len(gen.tokens)])))
        self.metrics.outcome(gen.stop_type)

    def _cancelled(self, job: Job) -> None:
        """The client left (or the shutdown cut the job, which tells the client): close the
        generation now, freeing its drafter state."""
        self.metrics.outcome("cancelled")
        if job.cut:
            job.emit(Failed(shutting_down()))
        self._end()

    def _fail(self, e: Exception) -> None:
        self.metrics.outcome("failed")
        if isinstance(e, ConfigError):
            self.job.emit(Failed(ApiError(400, str(e))))
        elif isinstance(e, BackendError):
            log.error("slot %d: %s", self.index, e)
            self.job.emit(Failed(ApiError(500, str(e), "server_error")))
        else:
            log.error("slot %d: generation failed", self.index, exc_info=e)
            self.job.emit(Failed(ApiError(500, f"generation failed: {type(e).__name__}: {e}",
                                          "server_error")))

    def _watch(self, gen: Generation, job: Job) -> None:
        """Tell the speculation watch how this generation drafted (never raises)."""
        try:
            links = self.link_state()
            req = job.request
            self.watch.after(self.index, self.drafter.name, gen.stats, gen.policy,
                             req.draft.enabled and req.draft.n_max > 0, links)
        except Exception:  # noqa: BLE001 - a report must not break the slot
            log.debug("speculation watch failed", exc_info=True)

    def links(self) -> tuple[LinkStatus, ...] | None:
        """Its drafter's links to draft nodes, where it declares them (else None). Never
        raises: a report must not fail a page, a scrape or a slot."""
        if not self.drafter.capabilities.links:
            return None
        try:
            return tuple(self.drafter.status())
        except Exception:  # noqa: BLE001
            log.debug("slot %d: the drafter's status failed", self.index, exc_info=True)
            return ()

    def link_state(self) -> dict[str, float] | None:
        """Up (1) or not, per link URL, where its drafter declares links (else None)."""
        links = self.links()
        return None if links is None else {st.url: float(st.up) for st in links}

    def _end(self) -> None:
        """The job is over: its sequence leaves the batch, the slot is free."""
        gen, job = self.gen, self.job
        self.gen, self.job = None, None
        if gen is not None:
            try:
                gen.close()
            except Exception:  # noqa: BLE001 - a drafter failing to end must not kill the slot
                log.exception("slot %d: closing the generation failed", self.index)
            self.metrics.record(self.index, gen.stats, len(gen.tokens))
            if job is not None:
                self.metrics.context_used(len(job.request.prompt) + len(gen.tokens))
            if self.watch is not None and job is not None:
                self._watch(gen, job)
        if self._clock is not None:
            self._clock.finish()
            self._clock = None
        if job is not None:
            job.finished = True
        self.last_used = time.monotonic()


class _Clock:
    """Times a generation for the histograms: its first tokens (from the job's arrival),
    each round after them, and at the end the mean time per token after the first."""

    __slots__ = ("metrics", "start", "first", "last", "n_first", "n")

    def __init__(self, metrics: Metrics, arrived: float) -> None:
        self.metrics, self.start = metrics, arrived
        self.first = self.last = 0.0
        self.n_first = self.n = 0

    def tick(self, n_new: int) -> None:
        now = time.perf_counter()
        if not self.n:
            self.metrics.ttft.observe(now - self.start)
            self.first, self.n_first = now, n_new
        else:
            self.metrics.round_time.observe(now - self.last)
        self.last, self.n = now, self.n + n_new

    def finish(self) -> None:
        if self.n > self.n_first:
            self.metrics.tpot.observe((self.last - self.first) / (self.n - self.n_first))


class SlotPool:
    """The slots (every sequence of every engine), their shared queue, and the worker."""

    def __init__(self, engines: Sequence[Engine], queue_size: int, metrics: Metrics,
                 similarity: float = 0.1) -> None:
        if not engines:
            raise ValueError("the server needs at least one engine")
        self.metrics = metrics
        self.engines = list(engines)
        self.queue = JobQueue(queue_size, similarity)
        self.watch = SpeculationWatch()
        self.slots = [Slot(i, e, seq, metrics, self.watch) for i, (e, seq) in
                      enumerate((e, seq) for e in self.engines for seq in range(e.n_seq))]
        self.queue.set_free(len(self.slots))
        self.thread = threading.Thread(target=self._loop, name="batch", daemon=True)
        self._started = False
        self._stopping = False
        self._draining = False
        #: held by the worker for each admit-step-pump; a slot action takes it to run
        #: while no engine steps
        self.lock = threading.Lock()

    def _loop(self) -> None:
        while not self._stopping:
            with self.lock:         # slot actions (slot_files.py) run between iterations
                self._admit()
                busy = [s for s in self.slots if s.job is not None]
                if busy:
                    for e in self.engines:
                        if e.scheduler.running:
                            e.step()
                            self.metrics.step(sum(s.engine is e for s in busy))
                    for s in busy:
                        s.pump()
            if not busy and not self.queue.wait():
                break
        for s in self.slots:
            if s.job is not None:
                s.job.cancelled.set()
                s.pump()

    def _admit(self) -> None:
        """Waiting jobs into idle slots: they join the batch at the next step."""
        while (got := self.queue.take([s for s in self.slots if s.job is None])) is not None:
            job, slot = got
            if job.cancelled.is_set():      # its client left while it was being handed over
                job.finished = True
                self.metrics.outcome("cancelled")
                continue
            slot.start(job)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull if there is no room, Draining once shutting down."""
        if self._draining:
            raise Draining
        try:
            self.queue.put(job)
        except QueueFull:
            self.metrics.reject()
            raise

    def check_room(self) -> None:
        """QueueFull (counted) if a job submitted now would be refused; Draining."""
        if self._draining:
            raise Draining
        if not self.queue.has_room():
            self.metrics.reject()
            raise QueueFull

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if waiting, else close it after this step."""
        if job.finished or job.cancelled.is_set():
            return
        job.cancelled.set()
        if self.queue.remove(job):
            job.finished = True
            self.metrics.outcome("cancelled")

    def drain(self) -> None:
        """The shutdown begins: no new jobs, and those waiting for a slot get a 503 with
        Retry-After now; running ones go on (see cut)."""
        self._draining = True
        for job in self.queue.close():
            job.finished = True
            self.metrics.outcome("cancelled")
            job.emit(Failed(shutting_down()))

    def cut(self) -> None:
        """The drain's time is over: running jobs end now with a 503 (a stream gets it as
        an error event), at their next step."""
        for s in self.slots:
            job = s.job
            if job is not None and not job.finished:
                job.cut = True
                job.cancelled.set()

    def slot_for(self, id_slot: int) -> int | None:
        """A request's id_slot, as llama-server reads it: -1 any slot, else that slot (400
        if there is none)."""
        if id_slot == -1:
            return None
        if not 0 <= id_slot < len(self.slots):
            raise ApiError(400, f"id_slot: no slot {id_slot}; this server has "
                           f"{len(self.slots)} (0..{len(self.slots) - 1}, or -1: any)")
        return id_slot

    def running(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        for job in self.queue.close():
            job.cancelled.set()
        for s in self.slots:
            if s.job is not None:
                s.job.cancelled.set()
        if self._started:
            self.thread.join(timeout)

    def state(self) -> dict[str, int]:
        return {"processing": sum(s.job is not None for s in self.slots),
                "deferred": len(self.queue), "capacity": self.queue.capacity,
                "slots": len(self.slots)}

    def slot_action(self, index: int, action: str, folder: str | None, body: object,
                    scope: str = "", quota: object = None) -> dict:
        """POST /slots/{id}?action=...: run it on the idle slot between steps, for a client
        of cache scope `scope` (its API key's), whose files are within `quota`
        (slot_files.Quota; None: the default)."""
        from specwire.server import slot_files
        if not 0 <= index < len(self.slots):
            raise ApiError(404, f"no slot {index}; this server has {len(self.slots)}",
                           "not_found_error")
        with self.lock:
            return slot_files.run(self.slots[index], action, folder, body, scope,
                                  quota or slot_files.Quota())

    def lora_adapters(self) -> list[dict]:
        """GET /lora-adapters: the target's adapters (llama-server's id, path, scale)."""
        target = self.engines[0].target
        paths = [p for p, _ in getattr(getattr(target, "params", None), "loras", ())]
        scales = getattr(target, "lora_scales", [])
        return [{"id": i, "path": p, "scale": s} for i, (p, s) in enumerate(zip(paths, scales,
                                                                               strict=True))]

    def set_lora_adapters(self, body: object,
                          scale_max: float = LORA_SCALE_MAX) -> list[dict]:
        """POST /lora-adapters [{"id", "scale"}]: new scales, each within +-scale_max
        (--lora-scale-max), applied between steps (a running request goes on with them);
        an adapter not named keeps its scale."""
        with self.lock:
            current = [a["scale"] for a in self.lora_adapters()]
            scales = lora_adapter_scales(body, current, scale_max)
            for e in self.engines:
                e.target.set_lora_scales(scales)
        return self.lora_adapters()

    def slot_states(self, scope: str | None = None) -> list[dict]:
        """GET /slots: each slot as llama-server lists it (id, n_ctx, is_processing,
        speculative, the running request's settings with its n_keep, n_discard and LoRA
        scales), plus its drafter and cached tokens. scope: the caller's cache scope, with
        API keys (None: none): a slot whose cache holds another scope's tokens shows
        neither their count nor the request's settings (its seed, its prompt's length),
        only that it is busy."""
        out = []
        for s in self.slots:
            job = s.job
            req = job.request if job is not None else None
            entry = {"id": s.index, "n_ctx": s.target.n_ctx, "is_processing": job is not None,
                     "speculative": s.drafter.name != "none", "drafter": s.drafter.name}
            if scope is not None and s.scope != scope:
                out.append(entry)
                continue
            entry["n_cached"] = s.target.n_past
            if req is not None:
                entry["params"] = {"n_predict": req.n_predict, **req.sampling.to_dict(),
                                   "speculative.n_max": req.draft.n_max,
                                   "speculative.n_min": req.draft.n_min,
                                   "speculative.p_min": req.draft.p_min,
                                   "n_keep": req.n_keep, "n_discard": req.n_discard,
                                   "lora": [{"id": i, "scale": x} for i, x in enumerate(
                                       req.lora if req.lora is not None
                                       else adapter_scales(s.target))]}
                entry["n_prompt_tokens"] = len(req.prompt)
            out.append(entry)
        return out

    def link_states(self) -> list[tuple[int, dict]]:
        out = []
        for s in self.slots:
            if (state := s.link_state()) is not None:
                out.append((s.index, state))
        return out
