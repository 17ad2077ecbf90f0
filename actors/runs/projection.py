"""The subagent's provider input, as plain values (seed 000 "Single-turn subagent loop"; RULES.md
SA-03..SA-18, C.4): the projection ``P = context ‖ task ‖ history ‖ state``, replaceable state with its
displayed-result markers, and ``ContextBudget``, the immutable snapshot a host sees. No threads, no bus:
the run actor (``subagent.py``) owns one ``Projection`` and re-renders it before every provider request.

Token estimates are sums over the projection's *pieces* (the context-and-task block, each call, each result,
each state value, the section frames), each counted once by the Router with the model's own tokenizer, or
with the conservative ``estimate_tokens`` for a provider that has none. A piece boundary is a line boundary,
so a sum of piece counts is never below the tokenizer's count of the whole (the test against the local
model's tokenizer checks it). Text the runtime has not counted yet (a state value a host asks
``fits_state`` about) is bounded from above: one token per UTF-8 byte under a tokenizer, the same
conservative estimate otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Final

from actors.router.providers.base import estimate_tokens
from transport.codec import JsonValue
from transport.records import frozen

# SA-12, the seed's exact text
UPDATED_MARKER: Final = (
    "[Tool output was displayed here, but has since been updated and now appears elsewhere in the context]"
)
# SA-13: a truthful removal marker; it never claims the value appears elsewhere
REMOVED_MARKER: Final = (
    "[Tool output was displayed here, but that state has since been removed from the context]"
)
PROTOCOL_RESERVE_TOKENS: Final = 1024  # SA-06: room for what the provider adds around P
INVALID_CALL: Final = "call_ktool(<invalid>)"  # SA-25
TRUNCATED: Final = "[truncated]"  # SA-18
# SA-27: fixed; the tool catalog itself reaches the model through the host's context sections
RUN_TOOL_DESCRIPTION: Final = (
    "Run one of the tools described in the context: name is the tool, arguments its JSON-object arguments."
)

HISTORY_OPEN: Final = "\n\n<history>\n"
HISTORY_CLOSE: Final = "</history>"
STATE_OPEN: Final = "\n\n<state>\n"
STATE_CLOSE: Final = "</state>"

__all__ = [
    "INVALID_CALL",
    "PROTOCOL_RESERVE_TOKENS",
    "REMOVED_MARKER",
    "RUN_TOOL_DESCRIPTION",
    "TRUNCATED",
    "UPDATED_MARKER",
    "ContextBudget",
    "Entry",
    "Projection",
    "StateUpdate",
    "ToolOutcome",
    "estimate_tokens",
    "manifest_hash",
    "rejection_text",
    "upper_bound",
]


def manifest_hash(projection: str) -> str:
    """EV-02: lowercase hex SHA-256 of the projection's UTF-8 bytes."""
    return hashlib.sha256(projection.encode("utf-8")).hexdigest()


def upper_bound(text: str, exact: bool) -> int:
    """Tokens ``text`` can take at most: a byte-level tokenizer never needs more than one per byte; without
    a tokenizer the estimate is the conservative ``estimate_tokens`` the runtime counts everything with."""
    return len(text.encode("utf-8")) if exact else estimate_tokens(text)


def rejection_text(needed: int, maximum: int) -> str:
    """SA-16: what the provider gets instead of a successful result that does not fit."""
    return (
        f"Tool result rejected: its exact output and state updates (~{needed} tokens) would exceed the "
        f"model input capacity ({maximum} tokens). Projected state is unchanged."
    )


def _attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


def call_piece(n: int, rendered: str) -> str:
    return f'<call n="{n}">\n{rendered}\n</call>\n'


def result_piece(n: int, ok: bool, text: str) -> str:
    return f'<result n="{n}" status="{"ok" if ok else "failed"}">\n{text}\n</result>\n'


def value_piece(key: str, text: str) -> str:
    return f'<value key="{_attribute(key)}">\n{text}\n</value>\n'


# ------------------------------------------------------------------------------------------ wire values


@frozen(kw_only=True)
class StateUpdate:
    """``key`` is a stable identity: a later update replaces its value, ``text=None`` removes it (SA-09)."""

    TAG: ClassVar[str] = "sa.state_update"
    key: str
    text: str | None


@frozen(kw_only=True)
class ToolOutcome:
    """``unknown``: the call may or may not have run (its host died while it ran); ``ok`` is then False,
    ``text`` says so, and the host does not run it again under the same idempotency key."""

    TAG: ClassVar[str] = "sa.tool_outcome"
    text: str
    ok: bool
    state_updates: tuple[StateUpdate, ...] = ()
    displayed_state_keys: tuple[str, ...] = ()
    capture: JsonValue | None = None
    unknown: bool = False

    @classmethod
    def success(cls, text: str) -> ToolOutcome:
        return cls(text=text, ok=True)

    @classmethod
    def failure(cls, text: str) -> ToolOutcome:
        return cls(text=text, ok=False)


@frozen(kw_only=True)
class ContextBudget:
    """An immutable snapshot of the projection's size (SA-07), usable in any process.

    ``estimated`` is the estimate of P plus the reserve. For ``fits_state`` it keeps the token count of
    everything apart from the state section (``base``; for a budget handed to ``execute_tool`` that
    includes the pending call's history entry with an empty result, so the prediction is the projection
    after this call's outcome with that one update), each state value's count and the state frame's.
    """

    TAG: ClassVar[str] = "sa.budget"
    estimated: int
    maximum: int
    reserve: int
    exact: bool  # counts from the model's own tokenizer
    base: int
    state_keys: tuple[str, ...] = ()
    state_tokens: tuple[int, ...] = ()
    frame: int = 0

    def estimated_tokens(self) -> int:
        return self.estimated

    def max_input_tokens(self) -> int:
        return self.maximum

    def fits_state(self, key: str, text: str) -> bool:
        """SA-08: whether the complete projection fits after ``state[key] = text``, all else unchanged
        (displayed-result markers included). Under a tokenizer the new value is bounded from above, so
        ``True`` always means the runtime accepts it."""
        blocks = dict(zip(self.state_keys, self.state_tokens, strict=True))
        blocks[key] = upper_bound(value_piece(key, text), self.exact)
        return self.base + self.frame + sum(blocks.values()) + self.reserve <= self.maximum


# ------------------------------------------------------------------------------------------- projection


@frozen
class Entry:
    """One executed call: its rendering, the exact text the provider received, and which state it showed."""

    call: str
    text: str
    ok: bool
    displayed: tuple[str, ...] = ()
    superseded: frozenset[str] = frozenset()  # displayed keys a later accepted outcome updated or removed

    def shown(self, state: Mapping[str, str]) -> str:
        """SA-12/SA-13: the exact text, or the marker once a displayed key was superseded (the "updated"
        marker while any superseded key is live, the removal marker otherwise)."""
        if not self.superseded:
            return self.text
        return UPDATED_MARKER if any(k in state for k in self.superseded) else REMOVED_MARKER


@dataclass(slots=True)
class Projection:
    context: tuple[str, ...]
    task: str
    entries: list[Entry] = field(default_factory=list)
    state: dict[str, str] = field(default_factory=dict)  # insertion order is first-set order (SA-11)

    def copy(self) -> Projection:
        return Projection(self.context, self.task, list(self.entries), dict(self.state))

    @property
    def prefix(self) -> str:
        """SA-04: the context sections and the task, verbatim: the same prefix in every round."""
        return "".join(f"{c}\n\n" for c in self.context) + f"<task>\n{self.task}\n</task>"

    def history_pieces(self) -> list[str]:
        pieces = [self.prefix]
        if self.entries:
            pieces.append(HISTORY_OPEN)
            for n, entry in enumerate(self.entries, 1):
                pieces.append(call_piece(n, entry.call))
                pieces.append(result_piece(n, entry.ok, entry.shown(self.state)))
            pieces.append(HISTORY_CLOSE)
        return pieces

    def state_pieces(self) -> list[tuple[str, str]]:
        return [(key, value_piece(key, text)) for key, text in self.state.items()]

    def pieces(self) -> list[str]:
        """P in pieces whose concatenation is ``render()`` (C.4)."""
        pieces = self.history_pieces()
        if self.state:
            pieces += [STATE_OPEN, *(piece for _, piece in self.state_pieces()), STATE_CLOSE]
        return pieces

    def render(self) -> str:
        return "".join(self.pieces())

    def add(self, call: str, text: str, ok: bool, displayed: Sequence[str] = ()) -> None:
        self.entries.append(Entry(call, text, ok, tuple(displayed)))

    def apply(self, updates: Iterable[StateUpdate]) -> None:
        """SA-09..SA-14: apply in list order; earlier entries that displayed a key are superseded (the
        newest entry is the outcome's own and never is)."""
        own = len(self.entries) - 1
        for update in updates:
            if update.text is None:
                self.state.pop(update.key, None)
            else:
                self.state[update.key] = update.text
            for i in range(own):
                entry = self.entries[i]
                if update.key in entry.displayed:
                    self.entries[i] = replace(entry, superseded=entry.superseded | {update.key})

    def budget(
        self,
        count: Callable[[str], int],
        *,
        reserve: int,
        maximum: int,
        exact: bool,
        pending: str | None = None,
    ) -> ContextBudget:
        """The snapshot of this projection; ``pending`` is the rendering of a call about to execute."""
        estimated = sum(count(p) for p in self.pieces()) + reserve
        with_pending = self
        if pending is not None:
            with_pending = self.copy()
            with_pending.add(pending, "", True)
        states = self.state_pieces()
        return ContextBudget(
            estimated=estimated,
            maximum=maximum,
            reserve=reserve,
            exact=exact,
            base=sum(count(p) for p in with_pending.history_pieces()),
            state_keys=tuple(key for key, _ in states),
            state_tokens=tuple(count(piece) for _, piece in states),
            frame=count(STATE_OPEN) + count(STATE_CLOSE),
        )


def truncated(text: str, room: int, exact: bool) -> str:
    """SA-18: the longest prefix of ``text`` that, with the ``[truncated]`` suffix, is bounded by ``room``
    tokens (empty when not even the suffix fits)."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if upper_bound(text[:mid] + TRUNCATED, exact) <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + TRUNCATED
