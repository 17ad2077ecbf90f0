"""The Codex adapter child's lifecycle table (``actors.codex.lifecycle.step``), row by row, with no child and
no actor (RULES.md AD-04, AD-05, AD-17, AD-18). ``object()`` stands for a request context: the table only
carries contexts, it never answers them."""

from __future__ import annotations

from typing import Any

import pytest

from actors.codex import lifecycle as life
from actors.codex.lifecycle import (
    Abort,
    Answer,
    AnswerOpen,
    ChildExited,
    Closed,
    CloseStdin,
    Closing,
    Exited,
    Kill,
    Opened,
    Ready,
    Reap,
    ReapDue,
    SendInitialized,
    Spawning,
    StopActor,
    Stopped,
    Unheld,
    Unusable,
    step,
)
from actors.codex.types import AdapterError, ErrorKind

GONE = AdapterError(ErrorKind.UNAVAILABLE, "codex app-server exited (code 3)")
BAD = AdapterError(ErrorKind.PROTOCOL, "child wrote a line that is not JSON")
W1, W2 = object(), object()  # AwaitOpen contexts
A1, A2 = (object(), "ok-1"), (object(), "ok-2")  # (context, reply) answers
ALL_STATES: list[life.State] = [
    Spawning((W1,)),
    Ready(),
    life.Broken(BAD),
    Exited(GONE),
    Closing((A1,)),
    Closed(),
]


def test_the_handshake_answered_makes_ready_sends_initialized_and_answers_the_openers() -> None:
    """AD-04: ``initialized`` follows the ``initialize`` result, then each opener hears Ok."""
    assert step(Spawning((W1, W2)), Opened()) == (Ready(), (SendInitialized(), AnswerOpen((W1, W2))))


@pytest.mark.parametrize(
    ("event", "after"),
    [(Unusable(BAD), life.Broken(BAD)), (ChildExited(GONE), Exited(GONE))],
)
def test_a_failed_handshake_fails_the_openers_with_its_error_and_kills(event: Any, after: life.State) -> None:
    """AD-05: a handshake that fails (garbage, an error reply, an exit) raises at the opener, and the child is
    killed; the turns are aborted last."""
    error = event.error
    assert step(Spawning((W1,)), event) == (after, (Kill(), AnswerOpen((W1,), error), Abort(error)))


@pytest.mark.parametrize(
    ("event", "after"), [(Unusable(BAD), life.Broken(BAD)), (ChildExited(GONE), Exited(GONE))]
)
def test_a_ready_child_that_breaks_or_exits_aborts_every_turn(event: Any, after: life.State) -> None:
    """AD-18: every turn in flight ends with the failure; later starts see the failed state."""
    assert step(Ready(), event) == (after, (Kill(), Abort(event.error)))


def test_a_broken_child_keeps_its_first_failure_when_it_exits() -> None:
    """AD-18: the error turns and later starts see is why it broke, not the exit that followed."""
    assert step(life.Broken(BAD), ChildExited(GONE)) == (Exited(BAD), (Kill(),))
    assert step(life.Broken(BAD), Unusable(GONE)) == (life.Broken(BAD), (Kill(),))


def test_the_last_holder_gone_closes_stdin_and_waits_for_the_exit() -> None:
    """AD-17: the last release (or the last turn's terminal event) closes the child; its answer waits for
    the reap."""
    assert step(Ready(), Unheld(A1)) == (Closing((A1,)), (CloseStdin(),))
    assert step(Ready(), Unheld()) == (Closing(), (CloseStdin(),))
    assert step(life.Broken(BAD), Unheld(A1)) == (Closing((A1,), BAD), (CloseStdin(),))


def test_a_close_during_the_handshake_fails_the_openers() -> None:
    state, actions = step(Spawning((W1,)), Unheld(A1))
    assert state == Closing((A1,))
    assert actions == (AnswerOpen((W1,), life.closed_error()), CloseStdin())


def test_the_exit_while_closing_reaps_answers_and_stops_the_actor() -> None:
    """AD-17: reaped first, then every waiting answer, then the actor stops."""
    assert step(Closing((A1, A2)), ChildExited(GONE)) == (
        Closed(),
        (Kill(), Reap(), Answer((A1, A2)), StopActor()),
    )


def test_a_release_after_the_exit_reaps_and_stops_at_once() -> None:
    """AD-17: nothing to wait for: the child is gone already."""
    assert step(Exited(GONE), Unheld(A1)) == (Closed(), (Reap(), Answer((A1,)), StopActor()))
    assert step(Exited(GONE), Unheld()) == (Closed(), (Reap(), Answer(()), StopActor()))


def test_closing_gathers_later_answers_and_records_a_failure_once() -> None:
    assert step(Closing((A1,)), Unheld(A2)) == (Closing((A1, A2)), ())
    assert step(Closing((A1,)), Unusable(BAD)) == (Closing((A1,), BAD), (Kill(),))
    assert step(Closing((A1,), BAD), Unusable(GONE)) == (Closing((A1,), BAD), (Kill(),))


def test_the_reap_timer_kills_only_a_child_that_is_closing() -> None:
    """AD-17: a child that ignores the EOF on its stdin is killed once the reap timer is due."""
    assert step(Closing((A1,)), ReapDue()) == (Closing((A1,)), (Kill(),))
    for state in (Ready(), life.Broken(BAD), Exited(GONE), Closed()):
        assert step(state, ReapDue()) == (state, ())


@pytest.mark.parametrize("state", ALL_STATES[:-1], ids=lambda s: type(s).__name__)
def test_stopping_reaps_from_every_state_but_closed(state: life.State) -> None:
    assert step(state, Stopped()) == (Closed(), (Reap(),))


@pytest.mark.parametrize(
    "event", [Opened(), Unusable(BAD), ChildExited(GONE), ReapDue(), Stopped(), Unheld()], ids=repr
)
def test_closed_is_terminal(event: Any) -> None:
    assert step(Closed(), event) == (Closed(), ())


def test_a_late_answer_in_closed_is_sent_at_once_rather_than_never() -> None:
    assert step(Closed(), Unheld(A1)) == (Closed(), (Answer((A1,)),))


@pytest.mark.parametrize(
    "state", [Exited(GONE), life.Broken(BAD), Closing((A1,))], ids=lambda s: type(s).__name__
)
def test_a_late_handshake_reply_changes_nothing_once_the_child_broke_or_closes(state: life.State) -> None:
    assert step(state, Opened()) == (state, ())


def test_every_row_ends_with_abort_if_it_aborts() -> None:
    """Aborting ends turns, which may step the machine again: no action may follow it in a row."""
    events = [Opened(), Unusable(BAD), ChildExited(GONE), Unheld(A1), Unheld(), ReapDue(), Stopped()]
    for state in ALL_STATES:
        for event in events:
            _, actions = step(state, event)
            assert all(not isinstance(a, Abort) for a in actions[:-1]), (state, event, actions)


def test_failure_of_reads_the_failure_off_the_state() -> None:
    assert [life.failure_of(s) for s in ALL_STATES] == [None, None, BAD, GONE, None, None]
    assert life.failure_of(Closing((), BAD)) == BAD
