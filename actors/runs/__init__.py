"""Runs: the round machine and the loops built on it (run_session, the subagent run)."""
