"""Private ``CODEX_HOME`` folders: made per child, removed when it is reaped, and swept at start when their
owner died without removing them (a SIGKILLed owner never runs its clean-up).

A folder is ``<tmp>/kbus-codex-<pid>-<random>`` holding ``OWNER`` (JSON: the owner's pid and its start time
from ``/proc``, so a reused pid is not taken for the owner). A sweep removes only folders of this user
that are real folders (not symlinks), carry that file, and whose owner is gone; a folder without the file
(being made right now, or from another program) is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kbus-codex-"
OWNER = "OWNER"

_swept: set[str] = set()  # folders swept by this process (two children starting at once may both sweep:
# harmless, a folder is removed once and the other sweep skips it)


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[19]


def make_home(root: str | None = None) -> str:
    """A new private folder (mode 0700) owned by this process, with its ``OWNER`` file written."""
    home = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
    owner = {"pid": os.getpid(), "start": start_time(os.getpid())}
    Path(home, OWNER).write_text(json.dumps(owner), encoding="utf-8")
    return home


def _owner_alive(owner: dict[str, object]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # not a file this module wrote: leave the folder alone
    now = start_time(pid)
    return now is not None and now == owner.get("start")


def remove_stale_homes(root: str | None = None) -> list[str]:
    """Remove the folders of owners that are gone (see the module docstring); returns the removed paths."""
    base = Path(root or tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for folder in entries:
        if not folder.name.startswith(PREFIX):
            continue
        try:
            info = folder.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            owner = json.loads(Path(folder, OWNER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or _owner_alive(owner):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(str(folder))
    if removed:
        log.info("removed %d CODEX_HOME folder(s) of owners that are gone: %s", len(removed), removed[:5])
    return removed


def sweep_once(root: str | None = None) -> None:
    """``remove_stale_homes`` once per process and folder (the first child started sweeps); never raises."""
    key = root or tempfile.gettempdir()
    if key in _swept:
        return
    _swept.add(key)
    with contextlib.suppress(Exception):
        remove_stale_homes(root)
