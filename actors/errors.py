"""The actor-side errors, by cause: what went wrong, named once and used the same way in every room.

The transport's tree (``transport/errors.py``) says how a request fared on the wire: not delivered, outcome
unknown, expired, refused as malformed. The classes here say why an actor's work ended, in one vocabulary
(as trio's ``ClosedResourceError`` / ``BrokenResourceError`` / ``BusyResourceError``)::

    BusError                              transport/errors.py
    └─ KbusError                          an actor's work ended; the class under it says why
       ├─ Closed                          used after its own end: nothing was sent, nothing ran
       │  ├─ HandleTerminated             the inference handle is used up (completed, accounted, closed)
       │  ├─ ProviderEndedError           the Router ended the turn under the handle
       │  └─ TurnTerminated               the Router turn ended already (receipt attached)
       │     └─ TurnInterrupted           ...without completing: the Router ended it on its own
       ├─ Cancelled                       a caller cancelled it; open turns were accounted for
       │  ├─ SessionCancelled             run_session (CancelSession)
       │  ├─ RunCancelled                 the subagent run
       │  └─ TurnCancelled                a Router turn
       ├─ TimedOut                        its own time bound ran out (a request's deadline is Expired)
       │  ├─ InferenceTimeout             the prepared round's timeout
       │  └─ TurnTimedOut                 the Router turn's timeout
       ├─ Broken                          something outside the caller's control failed
       │  ├─ ProviderFailed               the provider answered with an error
       │  ├─ ProviderUnavailable          the provider could not be reached, or went away
       │  ├─ LedgerUnavailable            the receipt ledger could not commit what it reports
       │  ├─ AdapterError                 the codex child (``kind`` says how; its stderr in diagnostics)
       │  ├─ EffectStoreError             the outcome store cannot be written (the effect did not run)
       │  ├─ SessionHostError             a session host aborted the run
       │  ├─ SubagentHostError            a subagent host broke the Host protocol
       │  ├─ CaptureFailedError           complete_capture failed (SA-24)
       │  ├─ EmptyAnswerError             the model's terminal answer is empty (SA-23)
       │  ├─ EmptyCaptureError            ...and a capture was designated (SA-22)
       │  └─ TurnFailed                   a conversation turn's kernel run raised (CV-10)
       ├─ Busy                            one at a time, and one is running (single active turn)
       │  └─ TurnBusy                     a Router turn already has a reader
       ├─ Exhausted                       a budget it was given is used up
       │  └─ SessionRoundLimitError       the cumulative round limit (RS-05)
       ├─ Invalid                         asked for something that cannot be done as asked: nothing ran
       │  ├─ InvalidSessionRequest        RS-02/RS-03
       │  ├─ InvalidRunRequest            a negative reserve, a second run on one run actor
       │  ├─ InvalidCallId                respond for a call id not surfaced, or answered already
       │  ├─ UnknownModel                 neither a model id nor an alias in the catalog
       │  ├─ ContextCapacityError         the projection does not fit the model's input (SA-06)
       │  └─ TurnNotFound                 no such Router turn
       └─ the families: one room's base, raised plainly where no cause above fits (``__cause__`` says more)
          ├─ ReceiptError                 carries the turn's canonical receipt (``actors/types.py``)
          │  ├─ RouterError               a Router failure
          │  │  └─ TurnNotStarted         StartTurn refused before any provider ran: also a NotDelivered
          │  └─ InferenceError            a provider start or stream error, under the handle
          └─ ConversationError            a command the conversation cannot carry out

A class with a cause may also belong to a family (``TurnCancelled`` is a ``RouterError`` and ``Cancelled``):
the family says which room raised it and what it carries, the cause why. ``TurnNotStarted`` is a transport
``NotDelivered`` (nothing ran, safe to retry) and a ``RouterError``. Each class keeps its own wire name
(``WIRE``): the cause is Python's to test with ``isinstance``, and the far side rebuilds the same class.
One ``busy`` outcome is still spelled as a ``kind``: codex's ``AdapterError(BUSY)`` (a ``Broken``; a
``Busy`` subclass of it would be both).

Where an error crosses from one room to another it is mapped once, by one function at that boundary, which
keeps the original as ``__cause__``:

    a provider's ProviderError -> the Router      RouterActor._on_finished: its ``kind`` picks the class
    the Router -> the inference handle            inference/handle.py ``inference_error``: an InferenceError
                                                  by cause; NotDelivered, Unavailable, Expired stay themselves
    the handle's actor -> SessionInference        inference/facade.py ``typed_handle_error``: NotDelivered
                                                  (the handle is gone) becomes Unavailable
    the Router's ResolveModel -> InferenceRuntime runs/runtime.py ``_resolve_error``: an InferenceError;
                                                  transport outcomes stay as they are
    a run's later hop -> the run's caller         types.py ``retry_class``: NotDelivered after progress
                                                  becomes Unavailable
    the codex adapter -> the Shim                 codex/shim.py ``as_adapter_error``: any other bus error
                                                  becomes AdapterError(UNAVAILABLE)
    the codex adapter -> the facade's caller      codex/facade.py ``_typed``: NotDelivered and Unavailable
                                                  become AdapterError(UNAVAILABLE)

Errors that never cross the bus are plain Python exceptions where they are raised: ``ToolRegistryError``,
``TodoError`` and ``ToolRefused`` (``ValueError``: a bad argument), ``CheckpointError``, ``LaunchRejected``,
``ProviderConfigError``, the providers' ``ProviderError`` (its ``kind`` maps onto the Router's errors in one
place, the Router), and the CLI's ``CliError`` (one line, a non-zero exit).
"""

from __future__ import annotations

from transport.errors import BusError

__all__ = ["Broken", "Busy", "Cancelled", "Closed", "Exhausted", "Invalid", "KbusError", "TimedOut"]


class KbusError(BusError):
    """An actor's work ended for one of the causes below. Not on the wire itself: its subclasses are."""


class Closed(KbusError):
    """Used after its own end (completed, accounted, closed): nothing was sent, nothing ran."""


class Cancelled(KbusError):
    """A caller cancelled it (or stopped waiting for it); what was open was accounted for."""


class TimedOut(KbusError):
    """Its own time bound ran out. A request whose deadline passed is the transport's ``Expired``."""


class Broken(KbusError):
    """Something outside the caller's control failed: a provider, a child process, a store, a host."""


class Busy(KbusError):
    """Only one at a time, and one is running (single active turn)."""


class Exhausted(KbusError):
    """A budget it was given is used up (rounds, steps, tokens)."""


class Invalid(KbusError):
    """Asked for something that cannot be done as asked; nothing ran."""
