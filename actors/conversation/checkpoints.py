"""The checkpoint tools of one session (RULES.md 9.9, CK-01..07) and ``TouchedFiles``.

``bind_checkpoints(registry, shadow, session_id, log_path, touched)`` registers ``checkpoint_list``,
``checkpoint_diff`` and ``checkpoint_save`` (and, when asked, ``checkpoint_restore``, registered as
mutating) on a tool registry, all scoped to ``session_id`` (CK-04): they see and name only that session's
checkpoints. Nothing saves on its own (CK-03): a checkpoint is made only when ``checkpoint_save`` runs.

- With ``touched`` (a ``TouchedFiles``), a save covers the paths recorded in it and then clears it (CK-07);
  a tool that cannot know what it changed (``run_command``) marks it "everything", and the next save covers
  the whole tree. Without it, every save covers the whole working tree.
- Each save appends one JSON line (``"event": "save"``) to ``log_path``, flushed and fsynced before the tool
  answers; a restore appends an ``"event": "restore"`` line.
- ``bind_checkpoints`` checks everything first (the session id, the shadow repository, that ``log_path`` can
  be appended to) and registers nothing if a check fails (CK-05); binding again replaces the tools (CK-06).
"""

from __future__ import annotations

import json
import os
import uuid
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

from actors.conversation.shadow import (
    WORKTREE,
    CheckpointError,
    CheckpointInfo,
    RestoreReport,
    ShadowRepo,
)
from actors.conversation.tools import ToolRegistry

__all__ = [
    "CHECKPOINT_TOOLS",
    "RESTORE_TOOL",
    "CheckpointBinding",
    "TouchedFiles",
    "append_restore_line",
    "bind_checkpoints",
    "checkpoint_lines",
]

CHECKPOINT_TOOLS: Final = ("checkpoint_list", "checkpoint_diff", "checkpoint_save")
RESTORE_TOOL: Final = "checkpoint_restore"
_LISTED: Final = 50  # checkpoints checkpoint_list shows (newest first)
_SLOTS: weakref.WeakValueDictionary[str, TouchedFiles] = weakref.WeakValueDictionary()


class TouchedFiles:
    """A set of paths (relative to the working tree) that tools wrote, plus an "everything" mark for a tool
    that may have written anywhere. ``slot_id`` names it to a tool host in this process. It is used from the
    tool host's thread (the tools and the saves run there, one at a time): no lock (MB-01); ``take`` swaps
    the set out in one step, so an ``add`` from elsewhere is never lost, only left for the next save."""

    def __init__(self) -> None:
        self._paths: set[str] = set()
        self._everything = False
        self.slot_id = uuid.uuid4().hex
        _SLOTS[self.slot_id] = self

    @staticmethod
    def lookup(slot_id: str) -> TouchedFiles | None:
        """The set with this ``slot_id`` in this process (None if there is none)."""
        return _SLOTS.get(slot_id)

    def add(self, path: str) -> None:
        self._paths.add(path)

    def add_all(self) -> None:
        """Something changed, paths unknown: the next save covers the whole tree."""
        self._everything = True

    def update(self, paths: Iterable[str]) -> None:
        self._paths.update(paths)

    def take(self) -> tuple[tuple[str, ...], bool]:
        """The recorded paths (sorted) and the "everything" mark; the set is empty afterwards."""
        paths, self._paths = self._paths, set()
        everything, self._everything = self._everything, False
        return tuple(sorted(paths)), everything

    def put_back(self, paths: Iterable[str], everything: bool) -> None:
        """Undo a ``take`` whose save failed: nothing recorded is lost."""
        self._paths.update(paths)
        self._everything = self._everything or everything

    def snapshot(self) -> frozenset[str]:
        return frozenset(self._paths)

    @property
    def everything(self) -> bool:
        return self._everything

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, path: object) -> bool:
        return path in self._paths

    def __repr__(self) -> str:
        return f"TouchedFiles({len(self)} paths{', everything' if self.everything else ''})"


def _when(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _line(info: CheckpointInfo) -> str:
    skipped = f", {info.skipped_total} skipped" if info.skipped_total else ""
    when = _when(info.created_at_ms)
    return f"{info.checkpoint_id[:12]}  {when}  {info.files_total} files{skipped}  {info.label}"


def checkpoint_lines(found: Iterable[CheckpointInfo]) -> list[str]:
    """One line per checkpoint: id, time, file count, message."""
    return [_line(c) for c in found]


def _append_line(path: Path, record: dict[str, Any]) -> None:
    line = json.dumps(record, ensure_ascii=True) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def append_restore_line(path: str | os.PathLike[str], report: RestoreReport, now: float) -> None:
    """The ``"event": "restore"`` line of a checkpoint log (creating its folder if needed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _append_line(
        target,
        {
            "event": "restore",
            "checkpoint_id": report.checkpoint_id,
            "session_id": report.session_id,
            "written": list(report.written[:200]),
            "removed": list(report.removed[:200]),
            "left_alone": [{"path": s.path, "reason": s.reason} for s in report.left_alone[:200]],
            "at_ms": int(now * 1000),
        },
    )


class CheckpointBinding:
    """One ``enable_checkpoints``: the session's checkpoint chain on a shadow repository, and its tools."""

    def __init__(
        self, shadow: ShadowRepo, session_id: str, log_path: Path, touched: TouchedFiles | None
    ) -> None:
        shadow.ref(session_id)  # a bad session id fails here, before anything is registered
        self.shadow = shadow
        self.session_id = session_id
        self.log_path = Path(log_path)
        self.touched = touched

    def check(self) -> None:
        """Everything a save needs: the shadow repository exists (or is made) and the log can be appended."""
        self.shadow.open()
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise CheckpointError(
                f"cannot append to the checkpoint log {self.log_path}: {exc.strerror}"
            ) from None

    def _log(self, record: dict[str, Any]) -> None:
        _append_line(self.log_path, record)

    # -------------------------------------------------------------------------------- operations
    def save(self, message: str) -> CheckpointInfo:
        files: tuple[str, ...] | None = None
        taken: tuple[tuple[str, ...], bool] | None = None
        if self.touched is not None:
            taken = self.touched.take()
            files = None if taken[1] else taken[0]
        try:
            info = self.shadow.snapshot(self.session_id, message, files)
            self._log(
                {
                    "event": "save",
                    "checkpoint_id": info.checkpoint_id,
                    "session_id": info.session_id,
                    "label": info.label,
                    "created_at_ms": info.created_at_ms,
                    "scope": "whole tree" if files is None else "touched files",
                    "files": list(info.files),
                    "files_total": info.files_total,
                    "skipped": [{"path": s.path, "reason": s.reason} for s in info.skipped],
                    "skipped_total": info.skipped_total,
                }
            )
        except BaseException:
            if taken is not None and self.touched is not None:
                self.touched.put_back(*taken)
            raise
        return info

    def checkpoints(self) -> list[CheckpointInfo]:
        return self.shadow.list(self.session_id)

    def diff(self, a: str = "", b: str = "") -> str:
        if not a.strip():
            latest = self.shadow.list(self.session_id, limit=1)
            if not latest:
                raise CheckpointError(
                    f"session {self.session_id} has no checkpoint yet; checkpoint_save makes one"
                )
            a = latest[0].checkpoint_id
        return self.shadow.diff(self.session_id, a, b.strip() or WORKTREE)

    def restore(self, checkpoint_id: str) -> RestoreReport:
        report = self.shadow.restore(self.session_id, checkpoint_id)
        append_restore_line(self.log_path, report, self.shadow.clock())
        if self.touched is not None:
            self.touched.update([*report.written, *report.removed])
        return report

    # ------------------------------------------------------------------------------------- tools
    def tools(self, *, restore: bool = False) -> list[tuple[Callable[..., str], bool]]:
        """The tool functions and whether each is mutating."""

        def checkpoint_save(message: str) -> str:
            """Save a checkpoint of the working tree's files now, to return to later.

            Args:
                message: what the checkpoint is, e.g. "before refactoring parser".
            """
            info = self.save(message)
            text = f"Saved checkpoint {info.checkpoint_id[:12]} ({info.label!r}): {info.files_total} file(s)"
            text += " covered." if self.touched is not None else " changed since the last checkpoint."
            if info.skipped_total:
                names = ", ".join(f"{s.path} ({s.reason})" for s in info.skipped[:20])
                text += f" Skipped, not saved ({info.skipped_total}): {names}."
            return text

        def checkpoint_list() -> str:
            """List this session's checkpoints, newest first: id, time, files, message."""
            found = self.checkpoints()
            if not found:
                return "No checkpoints in this session yet."
            lines = [_line(c) for c in found[:_LISTED]]
            if len(found) > _LISTED:
                lines.append(f"[and {len(found) - _LISTED} older checkpoints]")
            return "\n".join(lines)

        def checkpoint_diff(a: str = "", b: str = "") -> str:
            """Show a unified diff between two checkpoints, or a checkpoint and the working tree (bounded).

            Args:
                a: a checkpoint id (or its first digits); empty for the latest checkpoint; "worktree" for the
                    working tree.
                b: a checkpoint id; empty or "worktree" for the working tree.
            """
            return self.diff(a, b)

        def checkpoint_restore(checkpoint_id: str) -> str:
            """Restore the working tree to a checkpoint: changed files come back, files created since are
            removed.

            Args:
                checkpoint_id: the checkpoint's id (or its first digits), from checkpoint_list.
            """
            return self.restore(checkpoint_id).text

        tools: list[tuple[Callable[..., str], bool]] = [
            (checkpoint_list, False),
            (checkpoint_diff, False),
            (checkpoint_save, False),
        ]
        if restore:
            tools.append((checkpoint_restore, True))
        return tools


def bind_checkpoints(
    registry: ToolRegistry,
    shadow: ShadowRepo,
    session_id: str,
    log_path: str | os.PathLike[str],
    touched: TouchedFiles | None = None,
    *,
    restore_tool: bool = False,
) -> CheckpointBinding:
    """Register the session's checkpoint tools on ``registry``, replacing an earlier binding (CK-06). Raises
    ``CheckpointError`` and registers nothing when a check fails (CK-05)."""
    binding = CheckpointBinding(shadow, session_id, Path(log_path), touched)
    binding.check()
    for name in (*CHECKPOINT_TOOLS, RESTORE_TOOL):
        registry.unregister(name)
    for fn, mutating in binding.tools(restore=restore_tool):
        # a save run twice makes two checkpoints; the others end the same however often they run
        registry.register(fn, mutating=mutating, rerun_safe=fn.__name__ != "checkpoint_save")
    return binding
