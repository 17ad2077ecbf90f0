"""``ShadowRepo``: checkpoints of a working tree in a git repository kept outside it (RULES.md 9.9).

The real ``git`` binary does the work, always with this repository's own git dir and index
(``GIT_DIR``/``GIT_INDEX_FILE``/``GIT_WORK_TREE``) and its own configuration: no system or user
configuration is read (``GIT_CONFIG_NOSYSTEM=1``, ``GIT_CONFIG_GLOBAL=/dev/null``, ``HOME`` set to an empty
folder), hooks point at an empty folder, and ``info/attributes`` switches off every content filter, so a
file is stored and written back byte for byte. The user's own repository (its ``.git``: refs, index, config,
hooks) is never read or written; git never adds a ``.git`` entry. The ``.gitignore`` files of the working
tree are honoured (the user's ``.git/info/exclude`` and global excludes are not: they are not read).

- A checkpoint is a commit of the working tree (tracked and untracked files, ignored ones left out) on the
  ref ``refs/kbus/checkpoints/<session>``: one chain per session, which is all a session sees (CK-04).
- Each session keeps its own index (``<git dir>/kbus-index/``), so a later save re-hashes only what changed.
- Files over ``max_file_bytes`` (default 10 MiB), symlinks (never followed), other non-regular files and
  nested git repositories are skipped and listed in the checkpoint's record, never silently.
- ``restore`` makes the working tree the snapshot again: changed files are written back, files created
  since are removed, and paths the snapshot could not hold (skipped then, or skipped now) are left alone and
  named. Ignored files are never touched.
- Every git call has a deadline (``git_timeout``); a failure raises ``CheckpointError`` with one line.
- No lock here (MB-01): a session's calls come from its tool host, one at a time (its mailbox serialises
  them); two hosts or processes on one shadow repository each use their own session index, and git's own
  index lock and a compare-and-swap ref update refuse a concurrent loser with a ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import ClassVar, Final

from actors.subprocesses import run_bounded
from transport.records import frozen

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "WORKTREE",
    "CheckpointError",
    "CheckpointInfo",
    "RestoreReport",
    "ShadowRepo",
    "ShadowSpec",
    "Skipped",
]

DEFAULT_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
GIT_TIMEOUT: Final = 120.0  # seconds one git call may take
MAX_DIFF_BYTES: Final = 64_000
MAX_LISTED: Final = 200  # names kept in a checkpoint's record (the count is always complete)
WORKTREE: Final = "worktree"  # the name of the working tree as a side of a diff
REF_PREFIX: Final = "refs/kbus/checkpoints/"
_GIT_OUTPUT_LIMIT: Final = 256 * 1024 * 1024  # what a listing may print; the tree's size bounds it anyway
_MARK: Final = "kbus-checkpoint: "
_BATCH: Final = 500  # paths on one git command line
LOOSE_OBJECTS_TO_PACK: Final = 1000
_SESSION: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_EMPTY_TREE: Final = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
_ATTRIBUTES: Final = "* -text -filter -ident -working-tree-encoding\n"


class CheckpointError(Exception):
    """A checkpoint operation that failed: a bad id or session, or git failing (the message is one line)."""


# ------------------------------------------------------------------------------------------ records


@frozen(kw_only=True)
class Skipped:
    """A path a checkpoint could not hold, and why (``symbolic link``, ``larger than ...``, ...)."""

    TAG: ClassVar[str] = "conv.checkpoint_skipped"
    path: str
    reason: str


@frozen(kw_only=True)
class CheckpointInfo:
    """One checkpoint. ``files``: the paths it covered when a touched-file set was given, else the paths
    changed since the session's previous checkpoint (all of them for the first); at most ``MAX_LISTED``
    names, ``files_total`` counts them all. ``skipped``: what it could not hold."""

    TAG: ClassVar[str] = "conv.checkpoint_info"
    checkpoint_id: str
    session_id: str
    label: str
    created_at_ms: int
    files: tuple[str, ...]
    files_total: int
    skipped: tuple[Skipped, ...] = ()
    skipped_total: int = 0


@frozen(kw_only=True)
class RestoreReport:
    """What ``restore`` did: ``written`` (changed or deleted files brought back), ``removed`` (created since
    the checkpoint), ``left_alone`` (paths it did not touch, and why). ``text`` says it for the model."""

    TAG: ClassVar[str] = "conv.checkpoint_restored"
    checkpoint_id: str
    session_id: str
    label: str
    written: tuple[str, ...]
    removed: tuple[str, ...]
    left_alone: tuple[Skipped, ...]
    text: str


@frozen(kw_only=True)
class ShadowSpec:
    """Everything a ``ShadowRepo`` is made of: it can cross the bus and be rebuilt in another process."""

    TAG: ClassVar[str] = "conv.shadow_spec"
    work_tree: str
    git_dir: str
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    git_timeout: float = GIT_TIMEOUT


@frozen
class _Scan:
    paths: tuple[str, ...]  # what git may add (existing or deleted); empty with ``whole``
    skipped: tuple[Skipped, ...]
    whole: bool


def _split0(data: bytes) -> list[str]:
    return [p for p in data.decode("utf-8", "surrogateescape").split("\0") if p]


def _literal(path: str) -> str:
    return f":(literal){path}"


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def _names(paths: Sequence[str], limit: int = 50) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _skipped_names(items: Sequence[Skipped], limit: int = 50) -> str:
    shown = ", ".join(f"{s.path} ({s.reason})" for s in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class ShadowRepo:
    """The shadow repository of one working tree. Holds no state but its paths and limits: every fact is in
    the git dir, so any number of instances (in any processes) may share one."""

    def __init__(
        self,
        work_tree: str | os.PathLike[str],
        git_dir: str | os.PathLike[str],
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        git_timeout: float = GIT_TIMEOUT,
        clock: Callable[[], float] = time.time,
        git: str = "git",
    ) -> None:
        root = Path(work_tree)
        try:
            self.work_tree = root.resolve(strict=True)
        except OSError as exc:
            raise CheckpointError(f"the working tree {work_tree} does not exist: {exc.strerror}") from None
        if not self.work_tree.is_dir():
            raise CheckpointError(f"the working tree {work_tree} is not a directory")
        self.git_dir = Path(os.path.abspath(git_dir))
        resolved_git_dir = self.git_dir.resolve(strict=False)
        if resolved_git_dir.is_relative_to(self.work_tree) or self.work_tree.is_relative_to(resolved_git_dir):
            raise CheckpointError(f"the shadow repository {git_dir} must be outside the working tree")
        if max_file_bytes < 0 or git_timeout <= 0:
            raise CheckpointError("max_file_bytes must be >= 0 and git_timeout > 0")
        self.max_file_bytes = max_file_bytes
        self.git_timeout = git_timeout
        self.clock = clock
        self.git = git
        self._opened = False

    @classmethod
    def for_work_tree(
        cls,
        work_tree: str | os.PathLike[str],
        data_dir: str | os.PathLike[str],
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        git_timeout: float = GIT_TIMEOUT,
        clock: Callable[[], float] = time.time,
    ) -> ShadowRepo:
        """The default place: ``<data_dir>/checkpoints/<name>-<hash of the path>/shadow.git``."""
        return cls(
            work_tree,
            cls.default_folder(work_tree, data_dir) / "shadow.git",
            max_file_bytes=max_file_bytes,
            git_timeout=git_timeout,
            clock=clock,
        )

    @staticmethod
    def default_folder(work_tree: str | os.PathLike[str], data_dir: str | os.PathLike[str]) -> Path:
        """The folder that holds a working tree's shadow repository and its checkpoint logs."""
        root = Path(work_tree).resolve()
        digest = hashlib.sha256(os.fsencode(root)).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", root.name)[:40] or "root"
        return Path(data_dir) / "checkpoints" / f"{name}-{digest}"

    @property
    def spec(self) -> ShadowSpec:
        return ShadowSpec(
            work_tree=str(self.work_tree),
            git_dir=str(self.git_dir),
            max_file_bytes=self.max_file_bytes,
            git_timeout=self.git_timeout,
        )

    @classmethod
    def from_spec(cls, spec: ShadowSpec, *, clock: Callable[[], float] = time.time) -> ShadowRepo:
        return cls(
            spec.work_tree,
            spec.git_dir,
            max_file_bytes=spec.max_file_bytes,
            git_timeout=spec.git_timeout,
            clock=clock,
        )

    def __repr__(self) -> str:
        return f"ShadowRepo(work_tree={str(self.work_tree)!r}, git_dir={str(self.git_dir)!r})"

    # ------------------------------------------------------------------------------------ git calls
    def _env(self, index: Path | None) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.git_dir / "kbus-home"),  # never the user's: no ~/.config/git/{ignore,attributes}
            "LC_ALL": "C",
            "LANG": "C",
            "GIT_DIR": str(self.git_dir),
            "GIT_WORK_TREE": str(self.work_tree),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_AUTHOR_NAME": "kbus",
            "GIT_AUTHOR_EMAIL": "kbus@localhost",
            "GIT_COMMITTER_NAME": "kbus",
            "GIT_COMMITTER_EMAIL": "kbus@localhost",
        }
        env["GIT_INDEX_FILE"] = str(index if index is not None else self.git_dir / "kbus-index" / "none")
        return env

    def _run(
        self,
        *args: str,
        index: Path | None = None,
        stdin: bytes | None = None,
        limit: int = _GIT_OUTPUT_LIMIT,
        env: dict[str, str] | None = None,
        ok: Iterable[int] = (0,),
    ) -> tuple[int, bytes, int]:
        """Run one git command in the working tree; (returncode, stdout, full stdout size)."""
        try:
            done = run_bounded(
                [self.git, *args],
                timeout=self.git_timeout,
                limit=limit,
                cwd=self.work_tree,
                env=env if env is not None else self._env(index),
                stdin=stdin,
            )
        except OSError as exc:
            raise CheckpointError(f"cannot run {self.git}: {exc.strerror or exc}") from None
        if done.timed_out:
            raise CheckpointError(f"git {args[0]} did not finish within {self.git_timeout:g} s")
        if done.returncode not in tuple(ok):
            message = _one_line(done.stderr.decode("utf-8", "replace")) or f"exit code {done.returncode}"
            raise CheckpointError(f"git {args[0]} failed: {message}")
        assert done.returncode is not None
        return done.returncode, done.stdout, done.stdout_size

    def _out(self, *args: str, index: Path | None = None) -> str:
        return self._run(*args, index=index)[1].decode("utf-8", "surrogateescape").strip()

    # ------------------------------------------------------------------------------------- set-up
    def open(self) -> None:
        """Create the shadow repository if it does not exist yet (idempotent); refuse a folder that exists
        and is not one (so a user's own repository is never taken for it)."""
        if self._opened:
            return
        config = self.git_dir / "config"
        if self.git_dir.exists():
            if not config.is_file() or "kbus-shadow" not in config.read_text("utf-8", "replace"):
                raise CheckpointError(f"{self.git_dir} exists and is not a kbus shadow repository")
        else:
            try:
                self.git_dir.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(f"cannot create {self.git_dir.parent}: {exc.strerror}") from None
            staging = Path(tempfile.mkdtemp(prefix=".shadow-", dir=self.git_dir.parent))
            try:
                self._init(staging)
                os.rename(staging, self.git_dir)  # another process may have won: its repository serves
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
                if not config.is_file():
                    raise
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        self._opened = True

    def _init(self, git_dir: Path) -> None:
        env = self._env(None)
        env["GIT_DIR"] = str(git_dir)
        del env["GIT_WORK_TREE"]
        self._run("init", "--quiet", "--bare", "--template=", str(git_dir), env=env)
        settings = {
            "core.bare": "false",
            "core.hooksPath": str(self.git_dir / "kbus-no-hooks"),
            "core.autocrlf": "false",
            "core.safecrlf": "false",
            "core.symlinks": "true",
            "core.fsmonitor": "false",
            "core.untrackedCache": "true",
            "core.quotePath": "false",
            "core.logAllRefUpdates": "false",
            "gc.auto": "0",
            "commit.gpgSign": "false",
            "kbus.shadow": "kbus-shadow",
        }
        sections: dict[str, list[str]] = {}
        for key, value in settings.items():  # appended as text: git reads the last value of a key
            section, _, name = key.partition(".")
            sections.setdefault(section, []).append(f"\t{name} = {value}\n")
        with (git_dir / "config").open("a", encoding="utf-8") as f:
            f.writelines(f"[{section}]\n" + "".join(lines) for section, lines in sections.items())
        (git_dir / "kbus-no-hooks").mkdir()
        (git_dir / "kbus-index").mkdir()
        (git_dir / "info").mkdir(exist_ok=True)
        (git_dir / "info" / "attributes").write_text(_ATTRIBUTES)
        (git_dir / "kbus-worktree").write_text(str(self.work_tree) + "\n")

    # ------------------------------------------------------------------------------------ helpers
    @staticmethod
    def ref(session_id: str) -> str:
        if not _SESSION.match(session_id) or ".." in session_id or session_id.endswith((".lock", ".")):
            raise CheckpointError(
                f"session id {session_id[:60]!r}: use 1-100 letters, digits, '_', '.' and '-' (not '..')"
            )
        return REF_PREFIX + session_id

    def _index(self, session_id: str) -> Path:
        return self.git_dir / "kbus-index" / hashlib.sha256(session_id.encode()).hexdigest()[:24]

    def _head(self, ref: str) -> str | None:
        code, out, _ = self._run("rev-parse", "--verify", "--quiet", ref + "^{commit}", ok=(0, 1))
        return out.decode().strip() if code == 0 else None

    def _scan(self, index: Path, files: Sequence[str] | None) -> _Scan:
        """What a save may add: every path git sees (tracked in this index, or untracked and not ignored),
        with the ones it must not hold set apart."""
        args = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        if files is None:
            listed = sorted(set(_split0(self._run(*args, index=index)[1])))
        else:  # ls-files takes no pathspec file: the paths go on the command line, a bounded batch at a time
            found: set[str] = set()
            for start in range(0, len(files), _BATCH):
                batch = [_literal(f) for f in files[start : start + _BATCH]]
                found.update(_split0(self._run(*args, "--", *batch, index=index)[1]))
            listed = sorted(found)
        keep: list[str] = []
        skipped: list[Skipped] = []
        # git lists no fifo, socket or device at all: find them, so they are named and never silently gone
        specials = self._specials(index) if files is None else [f for f in files if self._special(f)]
        skipped.extend(Skipped(path=p, reason="not a regular file") for p in specials if p not in listed)
        for path in listed:
            reason = self._skip_reason(path)
            if reason is None:
                keep.append(path)
            else:
                skipped.append(Skipped(path=path.rstrip("/"), reason=reason))
        skipped.sort(key=lambda s: s.path)
        return _Scan(tuple(keep), tuple(skipped), whole=files is None)

    def _special(self, path: str) -> bool:
        try:
            mode = os.lstat(self.work_tree / path).st_mode
        except OSError:
            return False
        return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))

    def _specials(self, index: Path) -> list[str]:
        """The fifos, sockets and devices in the tree that .gitignore does not exclude (a walk that skips
        ignored folders, nested repositories and symlinks)."""
        args = ["ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"]
        ignored = set(_split0(self._run(*args, index=index)[1]))
        found: list[str] = []
        pending = [""]
        while pending:
            folder = pending.pop()
            try:
                entries = list(os.scandir(self.work_tree / folder))
            except OSError:
                continue
            if folder and any(e.name == ".git" for e in entries):
                continue  # a nested repository: ls-files names it
            for entry in entries:
                rel = f"{folder}{entry.name}"
                if entry.name == ".git" or rel in ignored or rel + "/" in ignored:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    pending.append(rel + "/")
                elif not (entry.is_file(follow_symlinks=False) or entry.is_symlink()):
                    found.append(rel)
        return found

    def _skip_reason(self, path: str) -> str | None:
        if path.endswith("/"):
            return "nested git repository"
        try:
            st = os.lstat(self.work_tree / path)
        except FileNotFoundError:
            return None  # deleted since: the save records that
        except OSError as exc:
            return f"cannot be read ({exc.strerror})"
        if stat.S_ISLNK(st.st_mode):
            return "symbolic link"
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size > self.max_file_bytes:
            return f"larger than {self.max_file_bytes} bytes ({st.st_size})"
        return None

    def _stage(self, index: Path, scan: _Scan) -> None:
        """Make ``index`` hold what ``scan`` found: skipped paths out, everything else as it is on disk."""
        if scan.skipped:
            removed = b"".join(os.fsencode(s.path) + b"\0" for s in scan.skipped)
            self._run("update-index", "-z", "--force-remove", "--stdin", index=index, stdin=removed)
        if scan.whole:
            specs = ["."] + [f":(exclude,literal){s.path}" for s in scan.skipped]
        else:
            specs = [_literal(p) for p in scan.paths]
        if not specs:
            return
        stdin = b"".join(os.fsencode(s) + b"\0" for s in specs)
        self._run("add", "-A", "--pathspec-from-file=-", "--pathspec-file-nul", index=index, stdin=stdin)

    def _prepare_index(self, index: Path, head: str | None) -> None:
        if not index.exists() and head is not None:  # a lost index starts again from the last checkpoint
            self._run("read-tree", head, index=index)

    def _worktree_tree(self, session_id: str) -> tuple[str, tuple[Skipped, ...]]:
        """A tree of the working tree as a save would see it, built in a copy of the session's index (so
        the session's own index and chain are untouched)."""
        index = self._index(session_id)
        head = self._head(self.ref(session_id))
        with tempfile.TemporaryDirectory(prefix="kbus-index-", dir=self.git_dir / "kbus-index") as folder:
            scratch = Path(folder) / "index"
            if index.exists():
                # copy2 keeps the index's mtime: git's racy-entry check (a file changed in the same tick as
                # the index was written) compares against it; a fresh mtime would hide such a change
                shutil.copy2(index, scratch)
            else:
                self._prepare_index(scratch, head)
            scan = self._scan(scratch, None)
            self._stage(scratch, scan)
            return self._out("write-tree", index=scratch), scan.skipped

    def _changed(self, before: str, after: str) -> list[str]:
        out = self._run("diff-tree", "-r", "-z", "--name-only", "--no-renames", before, after)[1]
        return _split0(out)

    # ------------------------------------------------------------------------------------- saves
    def snapshot(self, session_id: str, label: str, files: Sequence[str] | None = None) -> CheckpointInfo:
        """Commit the working tree (``files`` None) or just ``files`` (relative paths) on the session's
        chain; returns the new checkpoint. Always makes a checkpoint, even when nothing changed."""
        ref = self.ref(session_id)
        label = " ".join(label.split())[:200] or "checkpoint"
        self.open()
        index = self._index(session_id)
        head = self._head(ref)
        self._prepare_index(index, head)
        scan = self._scan(index, None if files is None else [_relative(f) for f in files])
        self._stage(index, scan)
        tree = self._out("write-tree", index=index)
        if files is not None:
            covered = sorted({*scan.paths, *(s.path for s in scan.skipped)})
        else:
            covered = self._changed(head if head is not None else _EMPTY_TREE, tree)
        now = self.clock()
        created_ms = int(now * 1000)
        record = {
            "session_id": session_id,
            "created_at_ms": created_ms,
            "files": covered[:MAX_LISTED],
            "files_total": len(covered),
            "skipped": [[s.path, s.reason] for s in scan.skipped[:MAX_LISTED]],
            "skipped_total": len(scan.skipped),
        }
        message = f"{label}\n\n{_MARK}{json.dumps(record, ensure_ascii=True)}\n"
        env = self._env(index)
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"@{int(now)} +0000"
        args = ["commit-tree", tree, *(["-p", head] if head is not None else []), "-F", "-"]
        commit = self._run(*args, env=env, stdin=message.encode("utf-8", "surrogateescape"))[1]
        checkpoint_id = commit.decode().strip()
        self._run("update-ref", ref, checkpoint_id, head or "0" * 40)
        self._pack_if_many()
        return _info(checkpoint_id, label, record)

    def _pack_if_many(self) -> None:
        """Pack the loose objects once there are many (a first save of a big tree): one file per object
        takes a disk block each (about 4 KiB for a 300-byte file)."""
        counts = dict(
            line.split(": ", 1) for line in self._out("count-objects", "-v").splitlines() if ": " in line
        )
        if int(counts.get("count", "0")) >= LOOSE_OBJECTS_TO_PACK:
            self._run("repack", "-d", "-q", "--no-write-bitmap-index")

    # ------------------------------------------------------------------------------------ reading
    def sessions(self) -> list[str]:
        """The sessions that have checkpoints here."""
        if not (self.git_dir / "config").is_file():
            return []
        self.open()
        out = self._out("for-each-ref", "--format=%(refname)", REF_PREFIX)
        return sorted(line[len(REF_PREFIX) :] for line in out.splitlines() if line.startswith(REF_PREFIX))

    def list(self, session_id: str, *, limit: int = 1000) -> list[CheckpointInfo]:
        """The session's checkpoints, newest first (at most ``limit``)."""
        ref = self.ref(session_id)
        if not (self.git_dir / "config").is_file():
            return []
        self.open()
        if self._head(ref) is None:
            return []
        raw = self._run("log", f"-n{limit}", "--format=%H%x1f%B%x1e", ref)[1]
        out = raw.decode("utf-8", "surrogateescape")
        found: list[CheckpointInfo] = []
        for entry in out.split("\x1e"):
            commit, sep, body = entry.strip("\n").partition("\x1f")
            if sep:
                found.append(_parse(commit, body))
        return found

    def resolve(self, session_id: str, checkpoint_id: str) -> CheckpointInfo:
        """The session's checkpoint that ``checkpoint_id`` (the id or a prefix of 4+ hex digits) names;
        CheckpointError if it is not one of this session's (CK-04)."""
        wanted = checkpoint_id.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{4,40}", wanted):
            raise CheckpointError(f"{checkpoint_id[:60]!r} is not a checkpoint id (4 to 40 hex digits)")
        matches = [c for c in self.list(session_id, limit=100_000) if c.checkpoint_id.startswith(wanted)]
        if not matches:
            raise CheckpointError(f"no checkpoint {wanted} in session {session_id}")
        if len(matches) > 1:
            raise CheckpointError(
                f"{wanted} names {len(matches)} checkpoints of session {session_id}; give more"
            )
        return matches[0]

    def find(self, checkpoint_id: str) -> CheckpointInfo:
        """A checkpoint of any session (for the ``kbus checkpoints`` command, which sees every session)."""
        found: list[CheckpointInfo] = []
        for session in self.sessions():
            try:
                found.append(self.resolve(session, checkpoint_id))
            except CheckpointError as exc:
                if "give more" in str(exc):
                    raise
        if not found:
            raise CheckpointError(f"no checkpoint {checkpoint_id.strip()[:40]} in {self.work_tree}")
        if len(found) > 1:
            raise CheckpointError(f"{checkpoint_id.strip()} names checkpoints of several sessions; give more")
        return found[0]

    def diff(self, session_id: str, a: str, b: str = WORKTREE, *, max_bytes: int = MAX_DIFF_BYTES) -> str:
        """The unified diff from ``a`` to ``b``: each a checkpoint of the session or ``WORKTREE``; at most
        ``max_bytes`` of it, with a last line saying how much was left out."""
        self.open()
        sides = []
        for side in (a, b):
            if side.strip().lower() in (WORKTREE, "", "working tree"):
                sides.append(self._worktree_tree(session_id)[0])
            else:
                sides.append(self.resolve(session_id, side).checkpoint_id)
        args = ["diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames", *sides, "--"]
        _, out, size = self._run(*args, limit=max_bytes, env=self._env(None))
        text = out.decode("utf-8", "replace")
        if size > len(out):
            text += f"\n[diff truncated: the first {len(out)} of {size} bytes]"
        return text or "(no differences)"

    # ------------------------------------------------------------------------------------ restore
    def restore(self, session_id: str, checkpoint_id: str) -> RestoreReport:
        """Make the working tree the checkpoint's snapshot again (see the module docstring)."""
        self.open()
        info = self.resolve(session_id, checkpoint_id)
        target = info.checkpoint_id
        current, skipped_now = self._worktree_tree(session_id)
        status = self._run("diff-tree", "-r", "-z", "--name-status", "--no-renames", current, target)[1]
        fields = _split0(status)
        changes = list(zip(fields[0::2], fields[1::2], strict=True))
        leave: dict[str, str] = {s.path: f"skipped by the checkpoint: {s.reason}" for s in info.skipped}
        leave.update({s.path: s.reason for s in skipped_now})
        listed = self._run("ls-tree", "-r", "-z", "--name-only", target)[1]
        target_dirs = {str(Path(p).parent) for p in _split0(listed)}
        removed: list[str] = []
        write: list[str] = []
        for kind, path in changes:
            if kind == "D":
                if _under(path, leave) is None:
                    removed.append(path)
            elif _under(path, leave) is None:
                write.append(path)
        for path in removed:
            self._remove(path)
        self._prune_dirs(removed, target_dirs)
        writable: list[str] = []
        blocked: set[str] = set()
        for path in write:
            blocker = self._blocked(path)
            if blocker is None:
                writable.append(path)
            else:
                leave.setdefault(path, f"{blocker} is in the way")
                blocked.add(path)
        if writable:
            with tempfile.TemporaryDirectory(prefix="kbus-index-", dir=self.git_dir / "kbus-index") as d:
                scratch = Path(d) / "index"
                self._run("read-tree", target, index=scratch)
                stdin = b"".join(os.fsencode(p) + b"\0" for p in writable)
                self._run("checkout-index", "-f", "-z", "--stdin", index=scratch, stdin=stdin)
        left = tuple(  # what is there to leave alone: the blocked, and the skipped that exist
            Skipped(path=p, reason=r)
            for p, r in sorted(leave.items())
            if p in blocked or os.path.lexists(self.work_tree / p)
        )
        return _report(info, tuple(sorted(writable)), tuple(sorted(removed)), left)

    def _remove(self, path: str) -> None:
        target = self.work_tree / path
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            return
        try:
            os.unlink(target)
        except OSError as exc:
            raise CheckpointError(f"cannot remove {path}: {exc.strerror}") from None

    def _prune_dirs(self, removed: Iterable[str], keep: set[str]) -> None:
        """Remove the folders that only held removed files (never one the snapshot has files in)."""
        folders = {str(p) for r in removed for p in Path(r).parents if str(p) != "."}
        parents = sorted(folders, key=len, reverse=True)
        for parent in parents:
            if any(k == parent or k.startswith(parent + "/") for k in keep):
                continue
            with contextlib.suppress(OSError):  # only an empty folder goes
                os.rmdir(self.work_tree / parent)

    def _blocked(self, path: str) -> str | None:
        """A leading component of ``path`` that is not a real folder (a symlink, a file): writing through it
        could leave the working tree, so the path is left alone."""
        here = self.work_tree
        for part in Path(path).parts[:-1]:
            here = here / part
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return str(here.relative_to(self.work_tree))
        return None


def _relative(path: str) -> str:
    p = Path(path)
    if p.is_absolute() or ".." in p.parts:
        raise CheckpointError(f"{path!r}: a touched file must be a path inside the working tree")
    return p.as_posix()


def _under(path: str, leave: dict[str, str]) -> str | None:
    """The left-alone path equal to ``path`` or a folder above it."""
    if path in leave:
        return path
    for parent in Path(path).parents:
        if str(parent) in leave:
            return str(parent)
    return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _info(checkpoint_id: str, label: str, record: dict[str, object]) -> CheckpointInfo:
    files = record.get("files")
    skipped = record.get("skipped")
    return CheckpointInfo(
        checkpoint_id=checkpoint_id,
        session_id=str(record.get("session_id", "")),
        label=label,
        created_at_ms=_int(record.get("created_at_ms")),
        files=tuple(str(f) for f in files) if isinstance(files, list) else (),
        files_total=_int(record.get("files_total")),
        skipped=tuple(
            Skipped(path=str(s[0]), reason=str(s[1]))
            for s in (skipped if isinstance(skipped, list) else [])
            if isinstance(s, list) and len(s) == 2
        ),
        skipped_total=_int(record.get("skipped_total")),
    )


def _parse(commit: str, body: str) -> CheckpointInfo:
    label, _, rest = body.partition("\n")
    record: dict[str, object] = {}
    for line in rest.splitlines():
        if line.startswith(_MARK):
            try:
                loaded = json.loads(line[len(_MARK) :])
            except ValueError:
                loaded = {}
            record = loaded if isinstance(loaded, dict) else {}
    return _info(commit, label.strip(), record)


def _report(
    info: CheckpointInfo, written: tuple[str, ...], removed: tuple[str, ...], left: tuple[Skipped, ...]
) -> RestoreReport:
    parts = [
        f'Restored checkpoint {info.checkpoint_id[:12]} ("{info.label}") of session {info.session_id}: '
        "the working tree's files are as they were at that checkpoint."
    ]
    if written:
        parts.append(f"Written back ({len(written)}): {_names(written)}.")
    else:
        parts.append("No file needed writing back.")
    if removed:
        parts.append(f"Removed, created after the checkpoint ({len(removed)}): {_names(removed)}.")
    if left:
        parts.append(f"Left alone, not held by the checkpoint ({len(left)}): {_skipped_names(left)}.")
    parts.append("Files ignored by .gitignore were not touched.")
    return RestoreReport(
        checkpoint_id=info.checkpoint_id,
        session_id=info.session_id,
        label=info.label,
        written=written,
        removed=removed,
        left_alone=left,
        text=" ".join(parts),
    )
