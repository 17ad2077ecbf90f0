"""A writer that commits in groups and says ``answered N`` only once record N is durable (when_durable).

Run as ``python -P tests/peers/group_commit_writer.py journal|ledger PATH GROUP``: it writes records 0, 1,
2... in groups of GROUP, forever, until it is killed; stdout gets one ``answered N`` line per record, flushed,
from inside the when_durable callback. The test SIGKILLs it mid-stream and checks that every answered record
is on disk (DESIGN.md 4a: durable before anyone hears of it, many per fsync).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.conversation.journal import Journal
from actors.router.receipts import Intent, ReceiptLedger
from actors.types import AgentProvider


def answer(n: int) -> object:
    def told(error: BaseException | None) -> None:
        if error is None:
            sys.stdout.write(f"answered {n}\n")
            sys.stdout.flush()

    return told


def main(kind: str, path: Path, group: int) -> None:
    n = 0
    if kind == "journal":
        journal = Journal(path)
        while True:
            with journal.group():
                for _ in range(group):
                    journal.write({"type": "note", "n": n}, durable=True)
                    journal.when_durable(answer(n))  # type: ignore[arg-type]
                    n += 1
    ledger = ReceiptLedger(path)
    ledger.begin_incarnation()
    while True:
        with ledger.group():
            for _ in range(group):
                ledger.open(
                    Intent(
                        operation_id=uuid.UUID(int=n + 1),
                        receipt_id=f"rcpt-{n}",
                        parent_operation_id=uuid.UUID(int=0),
                        user_id="writer",
                        provider=AgentProvider.OPENAI,
                        provider_model="m",
                        model="m",
                        round=None,
                        started_at_ms=n,
                    )
                )
                ledger.when_durable(answer(n))  # type: ignore[arg-type]
                n += 1


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
