"""The Router: the one owner of the model catalog, provider credentials, providers and canonical receipts.

- ``actor.py``: ``RouterActor``; ``turns.py``: one provider turn's bookkeeping under it.
- ``catalog.py``: ``ModelCatalog`` (models, aliases, prices, provider entries; ``UnknownModel``).
- ``receipts.py``: ``ReceiptLedger``, the durable intents and canonical receipts (RULES.md RT-*).
- ``messages.py``: what the Router is asked (``ResolveModel``, ``StartTurn``, ``NextTurnEvent``,
  ``RespondCall``, …), the turn events it answers with, and its errors.
- ``client.py``: ``RouterClient``, a blocking face for one process.
- ``providers/``: the clients behind it: ``local`` (llama.cpp, the embedded default), ``openai``, ``codex``,
  ``scripted``.
"""

from actors.router.actor import (
    RouterActor,
)
from actors.router.catalog import (
    ModelCatalog,
    ModelEntry,
    Prices,
    ProviderEntry,
    UnknownModel,
)
from actors.router.client import (
    RouterClient,
)
from actors.router.messages import (
    ROUTER_ERRORS,
    ROUTER_MESSAGES,
    CancelOperation,
    CountTokens,
    FinishUnavailable,
    GetReceipt,
    GetReceiptsFor,
    InvalidCallId,
    LedgerUnavailable,
    NextTurnEvent,
    ProviderFailed,
    ProviderUnavailable,
    ResolveModel,
    RespondCall,
    RouterError,
    StartTurn,
    SubmitInput,
    TokenCount,
    TurnBusy,
    TurnCancelled,
    TurnClosed,
    TurnCompleted,
    TurnInput,
    TurnInterrupted,
    TurnNotFound,
    TurnNotStarted,
    TurnStarted,
    TurnTerminated,
    TurnTextDelta,
    TurnTimedOut,
    TurnToolCall,
    TurnUsage,
)
from actors.router.receipts import (
    ReceiptLedger,
)

__all__ = [
    "ROUTER_ERRORS",
    "ROUTER_MESSAGES",
    "CancelOperation",
    "CountTokens",
    "FinishUnavailable",
    "GetReceipt",
    "GetReceiptsFor",
    "InvalidCallId",
    "LedgerUnavailable",
    "ModelCatalog",
    "ModelEntry",
    "NextTurnEvent",
    "Prices",
    "ProviderEntry",
    "ProviderFailed",
    "ProviderUnavailable",
    "ReceiptLedger",
    "ResolveModel",
    "RespondCall",
    "RouterActor",
    "RouterClient",
    "RouterError",
    "StartTurn",
    "SubmitInput",
    "TokenCount",
    "TurnBusy",
    "TurnCancelled",
    "TurnClosed",
    "TurnCompleted",
    "TurnInput",
    "TurnInterrupted",
    "TurnNotFound",
    "TurnNotStarted",
    "TurnStarted",
    "TurnTerminated",
    "TurnTextDelta",
    "TurnTimedOut",
    "TurnToolCall",
    "TurnUsage",
    "UnknownModel",
]
