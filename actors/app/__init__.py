"""The application: the ``kbus`` command, the chat agent, the built-in tools and the node wiring.

- ``cli.py``: the ``kbus`` command (``node``, ``run``, ``chat``, ``ping``, ``keys``, ``stats``, ``log``, …).
- ``chat.py``: ``kbus run`` and ``kbus chat``: their commands, the REPL and the failure lines and codes.
- ``agent.py``: ``Agent``, the agent behind them (an agent on the bus: Router, conversation, tools).
- ``options.py``: what they are given, checked before anything starts (config, catalog, credentials, limits).
- ``output.py``: what a turn shows (the spinner, tool lines, the streamed answer, ``--json`` events).
- ``people_cli.py``: asking a person at the terminal (permissions, plans).
- ``builtin_tools.py``: the tools every turn gets (``calculate``, the workspace tools).
- ``wiring.py``: the message registry of every package, and the actors a node's config names.
- ``echo.py``: the echo actor (ping, echo, streams; for checks and benchmarks).
- ``replay_plugin.py``: the pytest plugin (``kbus_replay``): record a capture once, replay it offline.

The face exports nothing: these are entry points, not a library API, and importing ``actors.app`` must stay
cheap because the ``kbus`` command and the pytest plugin start from it.
"""

__all__: list[str] = []
