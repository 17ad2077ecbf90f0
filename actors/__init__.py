"""Actors of the bus, laid out in rooms, lowest first; a room imports only the rooms below it (the table is
``ACTOR_ROOMS`` in ``tests/test_layering.py``, which checks every import):

- the shared floor, at the top of this folder: ``base.py`` (``BusActor``, the bridge between pykka mailboxes
  and the node), ``types.py`` (values every room shares: tool calls, receipts, model contexts),
  ``effects.py`` (the idempotent outcome store), ``subprocesses.py`` (child processes, ended by PID);
- ``codex/``: the Codex adapter over a real ``codex app-server`` child, and the Shim;
- ``router/``: the Router, the one owner of the model catalog, the providers and the receipts;
- ``inference/``: the inference handle, one provider turn, single use;
- ``runs/``: what runs on handles: ``InferenceRuntime``, ``run_session`` and the subagent ``run``;
- ``conversation/``: the stateful conversation runtime (transcript, queue, compaction, loops, gates, todos);
- ``app/``: the ``kbus`` command, the chat agent, the built-in tools and the node wiring.

Each room's ``__init__`` is its face: it says what the room offers and exports it in ``__all__``. This module
imports nothing, so importing any room costs only that room.
"""

__all__: list[str] = []
