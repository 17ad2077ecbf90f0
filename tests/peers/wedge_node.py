"""``kbus node`` (the real command, ``actors.app.cli.main``) with one test-only actor type more: ``wedge``.

Usage: ``wedge_node.py --config FILE [kbus node options]``. A ``[actors.NAME] type = "wedge"`` table starts a
``WedgedActor``: told or asked anything, its handler blocks for good (an ``Event`` nobody sets), as a handler
stuck in a C call or an endless loop would. Nothing else in the node differs from ``kbus node``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from actors.app import cli
from actors.app import wiring as nodes
from actors.base import BusActor, Context


class WedgedActor(BusActor):
    """A fake at a chosen point: the first message it handles never returns."""

    def handle(self, message: Any, ctx: Context) -> Any:
        print(f"WEDGED {self.address}", flush=True)
        threading.Event().wait()
        return None


def main() -> int:
    nodes.ACTOR_TYPES = {**nodes.ACTOR_TYPES, "wedge": lambda settings: WedgedActor.start}
    return cli.main(["node", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
