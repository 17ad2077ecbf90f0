"""Background jobs (RULES.md 9.8, BG-01..BG-07): the job runner actor, its ``BackgroundJobManager`` facade,
and the conversation's side of ``run_event_loop``.

``JobRunnerActor`` runs jobs, each on a thread of its own: a shell command (``/bin/sh -c`` in the job's
working directory, through ``run_bounded``: a new process group, a timeout, the last ``output_cap`` bytes of
stdout+stderr kept with the full size counted, and the whole group killed when the job ends, is stopped, or
the runner stops), or a Python callable registered on the runner by name. It may live in another process
than the conversation. When a job ends the runner tells its owner ``JobDone``; it keeps the completion, so an
owner that restarts asks again with ``AdoptJob``, which also makes it the owner of a job still running (a
resumed conversation may have another address).

The conversation (``JobsMixin``) gives the model ``start_job(command)``, ``job_status(job_id)`` and
``stop_job(job_id)`` (``RegisterJobTools``), journals ``job_started`` before asking the runner,
``job_finished`` when a completion arrives (a repeat is ignored: each completion counts once), and
``job_delivered`` just before the turn that injects it (consumed once that turn has started, like a wakeup).
``run_event_loop`` injects one completion per turn, in completion order, ahead of a wakeup (BG-05). Resumed
from its journal, the conversation asks the runner about each job it had started and not seen finish: a
finished one is delivered once; one the runner does not know (it died with the job) is reported once as
lost, outcome unknown. Cancelling the loop or closing the conversation stops its jobs (``StopJobs``,
answered once all have ended).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pykka

from actors.base import DEFER, BusActor, Context
from actors.conversation.journal import Journal, LoopsRestored, job_to_json
from actors.conversation.kernel import LocalResult
from actors.conversation.messages import (
    AdoptJob,
    ConversationError,
    CountJobs,
    GetJob,
    JobCount,
    JobDone,
    JobInfo,
    RegisterJobTools,
    StartJob,
    StopJob,
    StopJobs,
)
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import CompletedJob, JobFinished, JobStarted
from actors.effects import EffectRecord, unknown_text
from actors.subprocesses import run_bounded
from transport.capture import pack_payload, unpack_payload
from transport.errors import ProtocolError
from transport.node import Node
from transport.pending import Reply
from transport.replay import ReplayedMailbox, record_mailbox, recorded_clock, replaying

if TYPE_CHECKING:
    from actors.conversation.wakeups import _WakeLoop

log = logging.getLogger(__name__)

__all__ = ["OUTPUT_CAP", "BackgroundJobManager", "JobRunnerActor", "JobsMixin", "injected_text"]

OUTPUT_CAP = 16 * 1024
JOB_TIMEOUT = 3600.0
RUNNER_TIMEOUT = 30.0
JOB_TOOLS = ("start_job", "job_status", "stop_job")


def _job_id(key: str) -> str:
    """A start_job call's job id: from its idempotency key, so stable across a resume and a retry."""
    return "job-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def injected_text(job: CompletedJob) -> str:
    """BG-02: the user text of the turn that delivers ``job``."""
    if job.lost:
        return (
            f"[Background job {job.job_id} lost: its runner stopped while it ran; its outcome is unknown]\n"
            f"command: {job.command}"
        )
    status = f"exit {job.exit_code}" if job.exit_code is not None else "stopped"
    size = len(job.output.encode("utf-8", "replace"))
    note = f"\n[output: the last {size} of {job.output_size} bytes]" if job.output_size > size else ""
    return f"[Background job {job.job_id} completed ({status})]\n{job.output}{note}"


# ------------------------------------------------------------------------------------ the runner


@dataclass
class _Job:
    job_id: str
    command: str
    owner: str
    cancel: threading.Event = field(default_factory=threading.Event)
    pgid: int = 0
    done: CompletedJob | None = None
    thread: threading.Thread | None = None


@dataclass(frozen=True)
class _Exited:
    job_id: str
    exit_code: int | None
    output: str
    size: int


class JobRunnerActor(BusActor):
    """Runs background jobs; ``callables`` maps a name to a function with no arguments (its return value's
    text is the job's output; an exception makes exit 1)."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        callables: dict[str, Callable[[], Any]] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(node, address)
        self._callables = dict(callables or {})
        # None: the wall clock through the replay seam (transport/replay.py recorded_clock)
        self._clock = clock or (lambda: recorded_clock(self.node, self.address))
        self._jobs: dict[str, _Job] = {}
        self._stop_waiters: list[tuple[str, Context]] = []

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case StartJob():
                return self._start(message)
            case GetJob(job_id=job_id):
                return self._info(self._jobs.get(job_id), job_id)
            case AdoptJob(job_id=job_id, owner=owner):
                job = self._jobs.get(job_id)
                if job is not None and owner:
                    job.owner = owner  # a running job's JobDone now goes to the owner that is alive
                return self._info(job, job_id)
            case StopJob(job_id=job_id):
                job = self._jobs.get(job_id)
                if job is not None and job.done is None:
                    job.cancel.set()
                return self._info(job, job_id)
            case StopJobs(owner=owner):
                for job in self._jobs.values():
                    if job.owner == owner and job.done is None:
                        job.cancel.set()
                self._stop_waiters.append((owner, ctx))
                self._answer_stops()
                return DEFER
            case CountJobs(owner=owner):
                running = sum(1 for j in self._jobs.values() if j.done is None and owner in ("", j.owner))
                return JobCount(running=running)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _info(self, job: _Job | None, job_id: str) -> JobInfo:
        if job is None:
            return JobInfo(job_id=job_id, command="", state="unknown")
        if job.done is None:
            return JobInfo(job_id=job_id, command=job.command, state="running", pgid=job.pgid)
        done = job.done
        state = "stopped" if done.exit_code is None else "finished"
        return JobInfo(
            job_id=job_id,
            command=job.command,
            state=state,
            exit_code=done.exit_code,
            output=done.output,
            output_size=done.output_size,
            pgid=job.pgid,
        )

    def _start(self, m: StartJob) -> JobInfo:
        if m.job_id in self._jobs:
            return self._info(self._jobs[m.job_id], m.job_id)
        if bool(m.command) == bool(m.callable):
            raise ConversationError("a job needs exactly one of a command or a callable")
        if m.callable and m.callable not in self._callables:
            known = ", ".join(sorted(self._callables)) or "none"
            raise ConversationError(f"no job callable {m.callable!r} on this runner (callables: {known})")
        job = _Job(m.job_id, m.command or f"callable:{m.callable}", m.owner)
        ref = self.actor_ref
        started = threading.Event()

        def report(exit_code: int | None, output: str, size: int) -> None:
            try:
                ref.tell(_Exited(m.job_id, exit_code, output, size))
            except pykka.ActorDeadError:
                log.info("job %s ended after its runner stopped", m.job_id)

        def on_start(pid: int) -> None:
            job.pgid = pid
            started.set()

        def shell() -> None:
            try:
                done = run_bounded(
                    ["/bin/sh", "-c", "exec 2>&1\n" + m.command],
                    timeout=m.timeout_s,
                    limit=m.output_cap,
                    cwd=m.workdir or None,
                    cancel=job.cancel,
                    on_start=on_start,
                    keep_tail=True,
                )
            except OSError as exc:
                started.set()
                report(127, f"the job could not start: {exc}", 0)
                return
            text = done.stdout.decode("utf-8", "replace")
            if done.timed_out:
                text += f"\n[timed out after {m.timeout_s:g}s; its process group was killed]"
            report(done.returncode, text, done.stdout_size)

        def python() -> None:
            started.set()
            fn = self._callables[m.callable]
            try:
                value = fn()
                text, code = ("" if value is None else str(value)), 0
            except Exception as exc:  # noqa: BLE001 - the job's failure is its outcome
                text, code = f"{type(exc).__name__}: {exc}", 1
            data = text.encode("utf-8", "replace")
            tail = data[-m.output_cap :].decode("utf-8", "replace")
            report(None if job.cancel.is_set() else code, tail, len(data))

        self._jobs[m.job_id] = job
        if not replaying(self.node):  # a replay runs no process: its pgid and its end come from the log
            job.thread = threading.Thread(
                target=shell if m.command else python, name=f"job-{m.job_id}", daemon=True
            )
            job.thread.start()
            started.wait(RUNNER_TIMEOUT)  # the child is running (its pgid known) before the answer
        pgid = job.pgid
        job.pgid = int.from_bytes(self.node.effect(self.address, b"job.pgid", lambda: pgid.to_bytes(8)))
        return self._info(job, m.job_id)

    def on_local(self, message: Any) -> Any:
        # A job's end reaches the runner from the job's thread: recorded in mailbox order, served on a replay.
        if isinstance(message, ReplayedMailbox):
            row = unpack_payload(message.payload)
            message = _Exited(str(row[1]), row[2], str(row[3]), int(row[4]))
        elif isinstance(message, _Exited) and self.node.capture is not None:
            row = ["job.exited", message.job_id, message.exit_code, message.output, message.size]
            record_mailbox(self.node, self.address, pack_payload(row))
        if isinstance(message, _Exited):
            job = self._jobs.get(message.job_id)
            if job is None or job.done is not None:
                return None
            job.done = CompletedJob(
                job_id=job.job_id,
                command=job.command,
                exit_code=message.exit_code,
                output=message.output,
                completed_at_ms=int(self._clock() * 1000),
                output_size=message.size,
            )
            self.tell_to(job.owner, JobDone(job=job.done))
            self._answer_stops()
            return None
        return super().on_local(message)

    def _answer_stops(self) -> None:
        waiting, self._stop_waiters = self._stop_waiters, []
        for owner, ctx in waiting:
            if any(j.owner == owner and j.done is None for j in self._jobs.values()):
                self._stop_waiters.append((owner, ctx))
            elif not ctx.done:
                ctx.reply(JobCount(running=0))

    def on_tell_error(self, error: Any, tell_id: bytes | None) -> None:
        log.info(
            "%s: a job's owner could not be told (%r); it keeps the completion for GetJob",
            self.address,
            error,
        )

    def on_stop(self) -> None:
        jobs = [j for j in self._jobs.values() if j.done is None]
        for job in jobs:
            job.cancel.set()
        for job in jobs:  # run_bounded kills each whole group within its poll interval
            if job.thread is not None:
                job.thread.join(5.0)
        super().on_stop()


class BackgroundJobManager:
    """A facade on a ``JobRunnerActor`` (A.4 ``BackgroundJobManager``): ``address`` is what
    ``run_event_loop`` and ``register_job_tools`` use. ``spawn`` starts a runner on ``node``."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        workdir: str = "",
        output_cap: int = OUTPUT_CAP,
        timeout_s: float = JOB_TIMEOUT,
    ) -> None:
        if output_cap < 1:
            raise ValueError("output_cap must be >= 1")
        self.node = node
        self.address = address
        self.workdir = workdir
        self.output_cap = output_cap
        self.timeout_s = timeout_s

    @classmethod
    def spawn(
        cls,
        node: Node,
        name: str = "jobs",
        *,
        callables: dict[str, Callable[[], Any]] | None = None,
        **options: Any,
    ) -> BackgroundJobManager:
        node.spawn(JobRunnerActor, name, callables=callables)
        return cls(node, f"{node.name}/{name}", **options)

    def status(self, job_id: str, *, timeout: float = RUNNER_TIMEOUT) -> JobInfo:
        return self.node.request(self.address, GetJob(job_id=job_id), timeout=timeout)  # type: ignore[no-any-return]

    def stop(self, job_id: str, *, timeout: float = RUNNER_TIMEOUT) -> JobInfo:
        return self.node.request(self.address, StopJob(job_id=job_id), timeout=timeout)  # type: ignore[no-any-return]

    def running_count(self, owner: str = "", *, timeout: float = RUNNER_TIMEOUT) -> int:
        reply: JobCount = self.node.request(self.address, CountJobs(owner=owner), timeout=timeout)
        return reply.running


# ---------------------------------------------------------------------------- the conversation side


class JobsMixin:
    """The conversation's background-job state, tools and ``run_event_loop`` deliveries."""

    address: str
    _journal: Journal | None

    if TYPE_CHECKING:
        node: Node

        def _emit(self, event: Any) -> None: ...
        def _write(self, what: str, write: Callable[[Journal], None]) -> None: ...
        def _start_turn(
            self, text: str, answer: Callable[[Any], None], *, goal: str | None = ...
        ) -> None: ...
        def _loop_turned(self, loop: _WakeLoop, result: Any) -> None: ...
        def ask(self, dst: str, message: Any, then: Callable[[Reply], None], **kwargs: Any) -> bytes: ...

    def _init_jobs(self, restored: LoopsRestored | None) -> None:
        r = restored or LoopsRestored()
        self._job_tools: RegisterJobTools | None = None
        self._jobs_running: dict[str, str] = dict(r.jobs_running)  # job id -> runner
        self._job_queue: deque[CompletedJob] = deque(r.undelivered)
        # jobs asked to start whose answer has not come: a JobDone that overtakes it (the runner's tell and
        # its reply travel on different sockets) waits here, so JobStarted always comes before JobFinished
        self._jobs_starting: dict[str, CompletedJob | None] = {}

    def _reconcile_jobs(self) -> None:
        """After a resume: ask each job's runner about the jobs started and not seen finish."""
        for job_id, runner in list(self._jobs_running.items()):

            def known(reply: Reply, job_id: str = job_id) -> None:
                info = reply.message if reply.error is None else None
                if isinstance(info, JobInfo) and info.state == "running":
                    return  # its JobDone will come
                if isinstance(info, JobInfo) and info.state in ("finished", "stopped"):
                    job = CompletedJob(
                        job_id=job_id,
                        command=info.command,
                        exit_code=info.exit_code,
                        output=info.output,
                        completed_at_ms=0,
                        output_size=info.output_size,
                    )
                else:  # the runner died with it (or does not answer): outcome unknown, reported once
                    job = CompletedJob(
                        job_id=job_id, command="", exit_code=None, output="", completed_at_ms=0, lost=True
                    )
                self._job_done(job)

            self.ask(runner, AdoptJob(job_id=job_id, owner=self.address), known, timeout=RUNNER_TIMEOUT)

    def _job_done(self, job: CompletedJob) -> None:
        """A completion (from the runner, or found on resume): counted once, journaled, queued (BG-06)."""
        if job.job_id not in self._jobs_running:
            return  # a repeat, or not this conversation's
        if job.job_id in self._jobs_starting:
            self._jobs_starting[job.job_id] = job  # taken up once its start is answered
            return
        del self._jobs_running[job.job_id]
        self._write("the job's completion", lambda j: j.loop_record("job_finished", job=job_to_json(job)))
        self._job_queue.append(job)
        self._emit(JobFinished(job_id=job.job_id, exit_code=job.exit_code, lost=job.lost))

    def _loop_ended(self, loop: _WakeLoop, why: str) -> None:
        if why == "cancelled" and loop.jobs is not None:  # cancelling the loop ends its jobs
            self._stop_jobs(lambda: None)

    def _deliver_job(self, loop: _WakeLoop) -> bool:
        if not self._job_queue:
            return False
        job = self._job_queue.popleft()  # BG-06: one per turn, in completion order
        self._write("the job's delivery", lambda j: j.loop_record("job_delivered", job_id=job.job_id))
        self._start_turn(injected_text(job), lambda r: self._loop_turned(loop, r))  # BG-02
        return True

    def _stop_jobs(self, then: Callable[[], None]) -> None:
        """End every job this conversation started (whole process groups); ``then()`` once they ended."""
        tools = self._job_tools
        runners = set(self._jobs_running.values()) | ({tools.runner} if tools is not None else set())
        if not runners:
            then()
            return
        left = [len(runners)]

        def stopped(reply: Reply) -> None:
            if reply.error is not None:
                self.node.log_limit.log(
                    log,
                    logging.WARNING,
                    (self.address, "stop jobs"),
                    "%s: stopping the jobs failed: %r",
                    self.address,
                    reply.error,
                )
            left[0] -= 1
            if left[0] == 0:
                then()

        for runner in runners:
            self.ask(runner, StopJobs(owner=self.address), stopped, timeout=RUNNER_TIMEOUT)

    def _job_specs(self) -> tuple[ToolSpec, ...]:
        if self._job_tools is None:
            return ()

        def spec(name: str, description: str, props: dict[str, Any]) -> ToolSpec:
            return ToolSpec(
                name=name,
                description=description,
                parameters={"type": "object", "properties": props, "required": list(props)},
                mutating=name == "stop_job",  # plan mode denies it; job_status only reads
            )

        return (
            ToolSpec(
                name="start_job",
                mutating=True,
                description=(
                    "Start a shell command (command) in the background, in the working directory, or a job "
                    "the runner offers by name (callable); you are told when it ends."
                ),
                parameters={
                    "type": "object",
                    "properties": {"command": {"type": "string"}, "callable": {"type": "string"}},
                    "required": [],
                },
            ),
            spec(
                "job_status",
                "A background job's state, exit status and output so far.",
                {"job_id": {"type": "string"}},
            ),
            spec(
                "stop_job", "Stop a background job (its whole process group).", {"job_id": {"type": "string"}}
            ),
        )

    def _job_unknown(self, key: str, record: EffectRecord, finished: Callable[[ToolExecution], None]) -> None:
        """A ``start_job`` whose earlier run was cut off: its runner knows the job (it started: say so), or
        the outcome is unknown (it is never started a second time)."""
        job_id = _job_id(key)
        tools = self._job_tools
        runner = self._jobs_running.get(job_id) or (tools.runner if tools is not None else "")

        def known(reply: Reply) -> None:
            info = reply.message if reply.error is None else None
            if isinstance(info, JobInfo) and info.state != "unknown":
                finished(ToolExecution(ok=True, text=f"started background job {job_id}"))
            else:
                text = f"{unknown_text(record)} (its job id would be {job_id}: check it with job_status)"
                finished(ToolExecution(ok=False, unknown=True, text=text))

        if not runner:
            known(Reply(None, None, True))
            return
        self.ask(runner, AdoptJob(job_id=job_id, owner=self.address), known, timeout=RUNNER_TIMEOUT)

    def _job_tool(
        self, name: str, arguments: dict[str, Any], key: str, *, probe: bool = False
    ) -> LocalResult:
        tools = self._job_tools
        if tools is None or name not in JOB_TOOLS:
            return None
        if probe:
            return ToolExecution(ok=True, text="")
        if name == "start_job" and set(arguments) == {"callable"}:
            field_name = "callable"
        else:
            field_name = "command" if name == "start_job" else "job_id"
        value = arguments.get(field_name)
        if set(arguments) != {field_name} or not isinstance(value, str) or not value.strip():
            wanted = "command or callable" if name == "start_job" else field_name
            return ToolExecution(ok=False, text=f"{name} needs one string argument {wanted}")
        if name == "start_job":
            label = value if field_name == "command" else f"callable:{value}"
            job_id = _job_id(key)

            def start(finished: Callable[[ToolExecution], None]) -> None:
                if job_id not in self._jobs_running:
                    self._write(
                        "the job's start",
                        lambda j: j.loop_record(
                            "job_started", job_id=job_id, command=label, runner=tools.runner
                        ),
                    )
                    self._jobs_running[job_id] = tools.runner

                def started(reply: Reply) -> None:
                    early = self._jobs_starting.pop(job_id, None)
                    if reply.error is not None and early is None:  # ended at once: told now, not again later
                        self._jobs_running.pop(job_id, None)
                        lost = CompletedJob(
                            job_id=job_id,
                            command=label,
                            exit_code=None,
                            output="",
                            completed_at_ms=0,
                            lost=True,
                        )

                        def ended(j: Journal) -> None:
                            j.loop_record("job_finished", job=job_to_json(lost))
                            j.loop_record("job_delivered", job_id=job_id)

                        self._write("the job's failed start", ended)
                        finished(
                            ToolExecution(ok=False, text=f"start_job: the job did not start: {reply.error}")
                        )
                        return
                    self._emit(JobStarted(job_id=job_id, command=label))
                    finished(ToolExecution(ok=True, text=f"started background job {job_id}"))
                    if early is not None:
                        self._job_done(early)

                message = StartJob(
                    job_id=job_id,
                    owner=self.address,
                    command=value if field_name == "command" else "",
                    callable=value if field_name == "callable" else "",
                    workdir=tools.workdir,
                    timeout_s=tools.timeout_s,
                    output_cap=tools.output_cap,
                )
                self._jobs_starting[job_id] = None
                self.ask(tools.runner, message, started, timeout=RUNNER_TIMEOUT)

            return start

        request = GetJob(job_id=value) if name == "job_status" else StopJob(job_id=value)

        def query(finished: Callable[[ToolExecution], None]) -> None:
            def answered(reply: Reply) -> None:
                info = reply.message
                if reply.error is not None or not isinstance(info, JobInfo):
                    finished(ToolExecution(ok=False, text=f"{name}: the job runner failed: {reply.error}"))
                    return
                if info.state == "unknown":
                    finished(ToolExecution(ok=False, text=f"{name}: no job {value!r}"))
                    return
                status = f"exit {info.exit_code}" if info.exit_code is not None else ""
                text = f"job {value}: {info.state} {status}".rstrip()
                if info.output:
                    text += f"\n{info.output}"
                finished(ToolExecution(ok=True, text=text))

            self.ask(tools.runner, request, answered, timeout=RUNNER_TIMEOUT)

        return query
