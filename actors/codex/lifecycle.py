"""The life of the adapter's one child as a table: frozen states, the events that move them, and ``step``,
one ``match`` row per (state, event) giving the next state and the actions the actor then carries out.

Pure: no child, no actor, no clock. The adapter actor (``actors.codex.actor``) turns what it sees into
events (the handshake answered, the child unusable, its exit, the last holder gone, the reap timer, the
actor stopping), sets the state ``step`` returns *before* it runs the actions (an action may end a turn,
which may release the last holder and step again), and answers wire messages with its own (state,
message) rows.

    Spawning --Opened--> Ready --Unheld--> Closing --ChildExited--> Closed
        \\                 |                  ^
         Unusable/ChildExited                 | Unheld
          v                v                  |
        Broken(failure) ---ChildExited--> Exited(failure) --Unheld--> Closed
        (Broken --Unheld--> Closing(failure);  any state --Stopped--> Closed)
"""

from __future__ import annotations

from typing import Any, TypeAlias

from actors.codex.types import AdapterError, ErrorKind
from transport.records import frozen

# --------------------------------------------------------------------------------------------- states


@frozen
class Spawning:
    """The child was started and ``initialize`` sent; ``waiters`` are the AwaitOpen requests (contexts)."""

    waiters: tuple[Any, ...] = ()


@frozen
class Ready:
    """The handshake is done (AD-04): turns may start."""


@frozen
class Broken:
    """The child is unusable and was killed; its exit has not arrived yet (AD-18)."""

    failure: AdapterError


@frozen
class Exited:
    """The child's exit arrived (or it never started) while handles are still held."""

    failure: AdapterError


@frozen
class Closing:
    """No handle and no unfinished turn is left (AD-17): stdin is closed, the exit is awaited.
    ``answers`` are (context, reply) pairs sent once the child is reaped; ``failure``, if the child broke
    before."""

    answers: tuple[tuple[Any, Any], ...] = ()
    failure: AdapterError | None = None


@frozen
class Closed:
    """Reaped; the actor is stopping."""


State: TypeAlias = Spawning | Ready | Broken | Exited | Closing | Closed

# --------------------------------------------------------------------------------------------- events


@frozen
class Opened:
    """``initialize`` was answered with a result."""


@frozen
class Unusable:
    """The child cannot be used (an ``initialize`` error, garbage during the handshake, a stuck stdin)."""

    error: AdapterError


@frozen
class ChildExited:
    """The child's exit was delivered; ``error`` is what its turns end with if nothing failed before."""

    error: AdapterError


@frozen
class Unheld:
    """The last handle was released and no turn holds the child; ``answer`` is sent once it is reaped."""

    answer: tuple[Any, Any] | None = None


@frozen
class ReapDue:
    """REAP_TIMEOUT passed since stdin was closed."""


@frozen
class Stopped:
    """The actor stops (node stop, or a bug)."""


LifeEvent: TypeAlias = Opened | Unusable | ChildExited | Unheld | ReapDue | Stopped

# -------------------------------------------------------------------------------------------- actions


@frozen
class SendInitialized:
    """Write the ``initialized`` notification."""


@frozen
class AnswerOpen:
    """Answer the AwaitOpen ``waiters``: ``Ok`` if ``error`` is None, else that error."""

    waiters: tuple[Any, ...]
    error: AdapterError | None = None


@frozen
class Kill:
    pass


@frozen
class Abort:
    """Forget every JSON-RPC continuation and end every turn in flight with ``error``. Always the last
    action of its row: ending a turn may step the machine again."""

    error: AdapterError


@frozen
class CloseStdin:
    """Close the child's stdin (its clean shutdown) and start the reap timer."""


@frozen
class Reap:
    """Wait for the child (bounded), kill it if it lingers, join its threads, remove its home."""


@frozen
class Answer:
    answers: tuple[tuple[Any, Any], ...]


@frozen
class StopActor:
    pass


Action: TypeAlias = SendInitialized | AnswerOpen | Kill | Abort | CloseStdin | Reap | Answer | StopActor


def closed_error() -> AdapterError:
    return AdapterError(ErrorKind.UNAVAILABLE, "the adapter is closed")


def failure_of(state: State) -> AdapterError | None:
    """Why the child cannot take work, if it broke; ``None`` while it can (or closes cleanly)."""
    match state:
        case Broken(failure=failure) | Exited(failure=failure):
            return failure
        case Closing(failure=failure):
            return failure
    return None


def step(state: State, event: LifeEvent) -> tuple[State, tuple[Action, ...]]:
    """The next state and what to do. Rows: closed first, then the failures, then the live states."""
    match state, event:
        # Closed: reaped, nothing moves; a late holder's answer is sent now rather than never.
        case Closed(), Unheld(answer=answer):
            return state, ((Answer((answer,)),) if answer is not None else ())
        case Closed(), _:
            return state, ()
        case _, Stopped():
            return Closed(), (Reap(),)
        # Closing: waiting for the exit (the reap timer kills a child that ignores the close).
        case Closing(answers=answers), ChildExited():
            return Closed(), (Kill(), Reap(), Answer(answers), StopActor())
        case Closing(answers=answers, failure=failure), Unheld(answer=answer):
            more = (answer,) if answer is not None else ()
            return Closing((*answers, *more), failure), ()
        case Closing(answers=answers, failure=None), Unusable(error=error):
            return Closing(answers, error), (Kill(),)
        case Closing(), Unusable() | ReapDue():
            return state, (Kill(),)
        case Closing(), Opened():
            return state, ()
        # Exited: the child is gone; the last holder's release ends the actor at once.
        case Exited(), Unheld(answer=answer):
            return Closed(), (Reap(), Answer((answer,) if answer is not None else ()), StopActor())
        case Exited(), _:
            return state, ()
        # Broken: killed, its exit still to come.
        case Broken(failure=failure), ChildExited():
            return Exited(failure), (Kill(),)
        case Broken(failure=failure), Unheld(answer=answer):
            return Closing((answer,) if answer is not None else (), failure), (CloseStdin(),)
        case Broken(), Unusable():
            return state, (Kill(),)
        case Broken(), Opened() | ReapDue():
            return state, ()
        # Spawning: the handshake is under way.
        case Spawning(waiters=waiters), Opened():
            return Ready(), (SendInitialized(), AnswerOpen(waiters))
        case Spawning(waiters=waiters), Unusable(error=error):
            return Broken(error), (Kill(), AnswerOpen(waiters, error), Abort(error))
        case Spawning(waiters=waiters), ChildExited(error=error):
            return Exited(error), (Kill(), AnswerOpen(waiters, error), Abort(error))
        case Spawning(waiters=waiters), Unheld(answer=answer):
            answers = (answer,) if answer is not None else ()
            return Closing(answers), (AnswerOpen(waiters, closed_error()), CloseStdin())
        # Ready: serving turns.
        case Ready(), Unusable(error=error):
            return Broken(error), (Kill(), Abort(error))
        case Ready(), ChildExited(error=error):
            return Exited(error), (Kill(), Abort(error))
        case Ready(), Unheld(answer=answer):
            return Closing((answer,) if answer is not None else ()), (CloseStdin(),)
        case Spawning() | Ready(), Opened() | ReapDue():
            return state, ()
    raise AssertionError(f"no row for {type(event).__name__} in {type(state).__name__}")  # pragma: no cover
