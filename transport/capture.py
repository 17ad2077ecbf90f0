"""Capture logs (``.buslog``): append-only, hash-chained records of the frames a node handles."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Final, Literal, TypeGuard, get_args

import msgpack

from transport.records import frozen

FORMAT: Final = "kbus-buslog"
VERSION: Final = 1

RecordKind = Literal["send", "deliver", "effect", "clock"]
RECORD_KINDS: Final[frozenset[str]] = frozenset(get_args(RecordKind))

# The reader's default bound on one record; the writer refuses records that could exceed it, so
# every log it writes is readable with the defaults.
MAX_RECORD_BYTES: Final = 64 << 20
# msgpack allocates a declared array up front, so a hostile 5-byte array header could cost
# gigabytes; the bound on frames per record keeps that allocation small.
MAX_FRAMES: Final = 1 << 16

_HEADER_KEYS: Final = ("format", "version", "created", "node", "schema", "seed")
_RECORD_KEYS: Final = ("n", "at", "actor", "mono_ns", "frames", "hash")
_RECORD_KEY_SET: Final = frozenset(_RECORD_KEYS)
_HASH_BYTES: Final = 32
_MAX_MAP_LEN: Final = 16
_READ_SIZE: Final = 1 << 16
_BATCH_BYTES: Final = 1 << 20
_MAX_PROBLEMS: Final = 1000
# A record body is a 5-key map (fixmap 0x85); adding "hash" makes it a 6-key fixmap (0x86), so the
# writer splices the hash onto the packed body instead of packing the frames a second time.
_FIXMAP6: Final = b"\x86"
_HASH_FIELD: Final = b"\xa4hash\xc4\x20"  # "hash" as fixstr, then a bin8 header for 32 bytes
# Upper bound on a record's packed size beyond its frames (map, keys, ints, hash).
_RECORD_OVERHEAD: Final = 256


class CaptureError(Exception):
    """A capture log that cannot be read or written.

    Raised for: not a buslog, bad header, unknown version, malformed record (the message names the
    record's index and offset), and a writer that is closed or whose thread failed.
    """


@frozen
class LogHeader:
    """The first object of every buslog; its packed bytes seed the hash chain."""

    format: str
    version: int
    created: float
    node: str
    schema: str
    seed: int | None


@frozen
class Record:
    """One captured event.

    ``hash`` = sha256(prev + packed record without ``hash``), where prev is the previous record's
    hash, or for n=0 the sha256 of the packed header.
    """

    n: int
    at: RecordKind
    actor: str
    mono_ns: int
    frames: tuple[bytes, ...]
    hash: bytes


@frozen
class TornTail:
    """``size`` bytes from ``offset`` to the end of the file that are not a whole record.

    ``after_record`` is the ``n`` of the last whole record, or None if there is none.
    """

    offset: int
    size: int
    after_record: int | None


@frozen
class CaptureLog:
    """A whole buslog in memory: every whole record in file order, and the torn tail if any."""

    path: str
    header: LogHeader
    records: tuple[Record, ...]
    torn: TornTail | None


@frozen
class VerifyReport:
    """The outcome of ``verify``.

    ``ok`` exactly when ``problems`` is empty; ``records`` counts the whole records read before any
    unreadable one.
    """

    ok: bool
    records: int
    problems: tuple[str, ...]
    torn: TornTail | None


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _header_map(header: LogHeader) -> dict[str, object]:
    return {
        "format": header.format,
        "version": header.version,
        "created": header.created,
        "node": header.node,
        "schema": header.schema,
        "seed": header.seed,
    }


def _chain(prev_hash: bytes, body: bytes) -> bytes:
    digest = hashlib.sha256(prev_hash)
    digest.update(body)
    return digest.digest()


def _record_hash(prev_hash: bytes, record: Record) -> bytes:
    body = {
        "n": record.n,
        "at": record.at,
        "actor": record.actor,
        "mono_ns": record.mono_ns,
        "frames": record.frames,
    }
    return _chain(prev_hash, _pack(body))


def _is_int(value: object) -> TypeGuard[int]:
    # bool is an int subclass but packs differently, so it would break the hash chain.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_kind(value: object) -> TypeGuard[RecordKind]:
    return isinstance(value, str) and value in RECORD_KINDS


# ------------------------------------------------------------------------------------------- writer


class CaptureWriter:
    """Append-only writer of one buslog; ``record`` never touches the disk.

    Invariants: the file is only ever appended to, and starts empty; the header is on disk when
    the constructor returns; one daemon thread owns the file and assigns ``n`` in queue order, so
    records put by one thread keep their order (and ``mono_ns`` is non-decreasing per actor as long
    as each actor records from one thread at a time, as pykka actors do); everything recorded
    before ``flush``/``close`` is called is written and handed to the OS when it returns. A
    writer-thread failure is final and sticky: every later ``record``/``flush``/``close`` raises
    ``CaptureError`` from it. A ``record`` racing with ``close`` on another thread may be dropped;
    stop producers before closing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        node: str,
        schema: str,
        seed: int | None = None,
        created: float | None = None,
    ) -> None:
        if not isinstance(node, str) or not isinstance(schema, str):
            raise TypeError("node and schema must be str")
        if seed is not None and not _is_int(seed):
            raise TypeError(f"seed must be an int or None, not {type(seed).__name__}")
        self._path = Path(path)
        header = LogHeader(
            format=FORMAT,
            version=VERSION,
            created=time.time() if created is None else float(created),
            node=node,
            schema=schema,
            seed=seed,
        )
        header_bytes = _pack(_header_map(header))
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND without O_TRUNC: opening can never destroy an existing log, even one created
        # between a check and the open.
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            if os.fstat(fd).st_size > 0:
                raise CaptureError(f"{self._path}: refusing to write into an existing non-empty file")
        except BaseException:
            os.close(fd)
            raise
        self._file: BinaryIO = os.fdopen(fd, "ab")
        try:
            self._file.write(header_bytes)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        self._packer = msgpack.Packer(use_bin_type=True)
        self._prev_hash = hashlib.sha256(header_bytes).digest()
        self._next_n = 0
        self._written = 0
        self._closed = False
        self._failure: BaseException | None = None
        # None asks the thread to stop; an Event is a flush barrier, set once everything before it
        # is written; anything else is a record.
        self._queue: queue.SimpleQueue[tuple[str, str, int, tuple[bytes, ...]] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._waiters: list[threading.Event] = []
        self._stop_seen = False  # the writer thread's own: close() has been queued and taken
        self._thread = threading.Thread(target=self._run, name=f"kbus-capture {self._path.name}", daemon=True)
        self._thread.start()

    @property
    def records_written(self) -> int:
        """Records written and handed to the OS so far."""
        return self._written

    def record(
        self,
        at: RecordKind,
        actor: str,
        frames: Sequence[bytes],
        mono_ns: int | None = None,
    ) -> None:
        """Queue one record; ``frames`` are copied, so the caller may reuse its buffers at once."""
        if mono_ns is None:
            mono_ns = time.monotonic_ns()
        self._raise_if_unusable()
        if not _is_kind(at):
            raise ValueError(f"record kind must be one of {sorted(RECORD_KINDS)}, not {at!r}")
        if not isinstance(actor, str):
            raise TypeError(f"actor must be str, not {type(actor).__name__}")
        if not _is_int(mono_ns):
            raise TypeError(f"mono_ns must be an int, not {type(mono_ns).__name__}")
        copied = tuple(_frame_bytes(frame) for frame in frames)
        if len(copied) > MAX_FRAMES:
            raise ValueError(f"a record holds at most {MAX_FRAMES} frames, got {len(copied)}")
        size = sum(map(len, copied)) + 5 * len(copied) + 4 * len(actor) + _RECORD_OVERHEAD
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"record of about {size} bytes exceeds MAX_RECORD_BYTES ({MAX_RECORD_BYTES})")
        self._queue.put((at, actor, mono_ns, copied))

    def flush(self, timeout: float = 5.0) -> None:
        """Return once everything recorded before this call is written and flushed to the OS."""
        self._raise_if_failed()
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(done)
        finished = done.wait(timeout)
        self._raise_if_failed()
        if not finished:
            raise CaptureError(f"{self._path}: flush did not finish within {timeout} s")

    def close(self, timeout: float = 5.0) -> None:
        """Flush, stop the writer thread and close the file. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CaptureError(f"{self._path}: writer thread did not stop within {timeout} s")
        self._raise_if_failed()

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _raise_if_failed(self) -> None:
        failure = self._failure
        if failure is not None:
            raise CaptureError(f"{self._path}: capture writer failed: {failure!r}") from failure

    def _raise_if_unusable(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise CaptureError(f"{self._path}: capture writer is closed")

    def _run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's next call, never lost
            self._failure = exc
            self._release_until_stop()
        finally:
            try:
                self._file.close()
            except BaseException as exc:  # noqa: BLE001 - same: the caller's close() raises it
                if self._failure is None:
                    self._failure = exc

    def _drain(self) -> None:
        batch: list[bytes | memoryview] = []
        while not self._stop_seen:
            item = self._queue.get()
            count = size = 0
            # Take everything already queued, then write it with one write and one flush: a burst
            # costs one syscall, not one per record.
            while True:
                if item is None:
                    self._stop_seen = True
                elif isinstance(item, threading.Event):
                    self._waiters.append(item)
                else:
                    size += self._encode(item, batch)
                    count += 1
                    if size >= _BATCH_BYTES:
                        break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._file.write(b"".join(batch))
                self._file.flush()
                batch.clear()
                self._written += count
            for waiter in self._waiters:
                waiter.set()
            self._waiters.clear()

    def _encode(self, item: tuple[str, str, int, tuple[bytes, ...]], batch: list[bytes | memoryview]) -> int:
        at, actor, mono_ns, frames = item
        body = self._packer.pack(
            {"n": self._next_n, "at": at, "actor": actor, "mono_ns": mono_ns, "frames": frames}
        )
        digest = _chain(self._prev_hash, body)
        self._prev_hash = digest
        self._next_n += 1
        batch.extend((_FIXMAP6, memoryview(body)[1:], _HASH_FIELD, digest))
        return len(body) + len(_HASH_FIELD) + _HASH_BYTES

    def _release_until_stop(self) -> None:
        # A failed writer still has to wake every flush() waiting on it, now and until close().
        for waiter in self._waiters:
            waiter.set()
        self._waiters.clear()
        while not self._stop_seen:
            item = self._queue.get()
            if item is None:
                self._stop_seen = True
            elif isinstance(item, threading.Event):
                item.set()


def _frame_bytes(frame: object) -> bytes:
    # bytes(x) would also accept an int (making zero bytes) or a str; only real buffers are frames.
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    raise TypeError(f"frames must be bytes, not {type(frame).__name__}")


# ------------------------------------------------------------------------------------------- reader


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed in a buslog")


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a map repeats a key")
    return result


class _End:
    """The scan reached the end of the file; ``leftover`` bytes after the last whole object."""

    __slots__ = ("leftover",)

    def __init__(self, leftover: int) -> None:
        self.leftover = leftover


class _Scanner:
    """One forward pass over an open buslog: ``header()`` once, then ``records()``.

    ``torn`` is set when ``records()`` is exhausted. The scan ends at the first error, so a failed
    Unpacker is never used again.
    """

    def __init__(self, fh: BinaryIO, path: str, max_record_bytes: int) -> None:
        if not _is_int(max_record_bytes) or max_record_bytes <= 0:
            raise ValueError(f"max_record_bytes must be a positive int, not {max_record_bytes!r}")
        self._fh = fh
        self._path = path
        self._limit = max_record_bytes
        self._unpacker = msgpack.Unpacker(
            fh,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            object_pairs_hook=_unique_keys,
            max_buffer_size=max_record_bytes,
            max_array_len=MAX_FRAMES,
            max_map_len=_MAX_MAP_LEN,
            read_size=min(_READ_SIZE, max_record_bytes),
        )
        # End of the last whole object. Unpacker.tell() moves into a partial object when unpack()
        # fails, so it cannot say where a torn tail starts.
        self.offset = 0
        self.torn: TornTail | None = None

    def _next(self, what: str) -> object:
        start = self.offset
        try:
            obj: object = self._unpacker.unpack()
        except msgpack.OutOfData:
            return _End(self._fh.tell() - start)
        except msgpack.BufferFull as exc:
            raise CaptureError(
                f"{self._path}: {what} at offset {start}: larger than max_record_bytes ({self._limit})"
            ) from exc
        except (ValueError, msgpack.UnpackException) as exc:
            reason = str(exc) or type(exc).__name__
            raise CaptureError(f"{self._path}: {what} at offset {start}: malformed: {reason}") from exc
        self.offset = self._unpacker.tell()
        return obj

    def header(self) -> LogHeader:
        obj = self._next("header")
        if isinstance(obj, _End):
            if obj.leftover == 0:
                raise CaptureError(f"{self._path}: not a buslog: the file is empty")
            raise CaptureError(f"{self._path}: not a buslog: the file ends inside its header")
        if not isinstance(obj, dict):
            raise CaptureError(
                f"{self._path}: not a buslog: starts with a msgpack {type(obj).__name__}, not a header map"
            )
        if obj.get("format") != FORMAT:
            raise CaptureError(f"{self._path}: not a buslog: format is {obj.get('format')!r}")
        version = obj.get("version")
        if not _is_int(version) or version != VERSION:
            raise CaptureError(
                f"{self._path}: unknown buslog version {version!r} (this reader knows {VERSION})"
            )
        _check_keys(obj, _HEADER_KEYS, f"{self._path}: bad header")
        created, node, schema, seed = obj["created"], obj["node"], obj["schema"], obj["seed"]
        if not isinstance(created, float):
            raise CaptureError(f"{self._path}: bad header: created must be a float, not {created!r}")
        if not isinstance(node, str) or not isinstance(schema, str):
            raise CaptureError(f"{self._path}: bad header: node and schema must be str")
        if seed is not None and not _is_int(seed):
            raise CaptureError(f"{self._path}: bad header: seed must be an int or nil, not {seed!r}")
        return LogHeader(FORMAT, VERSION, created, node, schema, seed)

    def records(self) -> Iterator[Record]:
        index = 0
        last_n: int | None = None
        while True:
            start = self.offset
            obj = self._next(f"record #{index}")
            if isinstance(obj, _End):
                if obj.leftover:
                    self.torn = TornTail(offset=start, size=obj.leftover, after_record=last_n)
                return
            record = _to_record(obj, self._path, index, start)
            yield record
            last_n = record.n
            index += 1


def _check_keys(obj: dict[Any, Any], expected: tuple[str, ...], where: str) -> None:
    if obj.keys() == set(expected):
        return
    if len(obj) != len(expected) or not all(key in obj for key in expected):
        missing = [key for key in expected if key not in obj]
        extra = [key for key in obj if key not in expected]
        raise CaptureError(f"{where}: missing keys {missing}, unexpected keys {extra}")


def _to_record(obj: object, path: str, index: int, offset: int) -> Record:
    if (
        type(obj) is dict
        and obj.keys() == _RECORD_KEY_SET
        and type(n := obj["n"]) is int
        and obj["at"] in RECORD_KINDS
        and type(actor := obj["actor"]) is str
        and type(mono_ns := obj["mono_ns"]) is int
        and type(frames := obj["frames"]) is list
        and all(type(frame) is bytes for frame in frames)
        and type(digest := obj["hash"]) is bytes
        and len(digest) == _HASH_BYTES
    ):  # the common case, checked without building a message
        return Record(n, obj["at"], actor, mono_ns, tuple(frames), digest)
    return _to_record_checked(obj, f"{path}: record #{index} at offset {offset}")


def _to_record_checked(obj: object, where: str) -> Record:
    if not isinstance(obj, dict):
        raise CaptureError(f"{where}: a msgpack {type(obj).__name__}, not a record map")
    _check_keys(obj, _RECORD_KEYS, where)
    n, at, actor, mono_ns = obj["n"], obj["at"], obj["actor"], obj["mono_ns"]
    frames, digest = obj["frames"], obj["hash"]
    if not _is_int(n):
        raise CaptureError(f"{where}: n must be an int, not {n!r}")
    if not _is_kind(at):
        raise CaptureError(f"{where}: at must be one of {sorted(RECORD_KINDS)}, not {at!r}")
    if not isinstance(actor, str):
        raise CaptureError(f"{where}: actor must be str, not {type(actor).__name__}")
    if not _is_int(mono_ns):
        raise CaptureError(f"{where}: mono_ns must be an int, not {mono_ns!r}")
    if not isinstance(frames, list) or not all(isinstance(frame, bytes) for frame in frames):
        raise CaptureError(f"{where}: frames must be an array of bin")
    if not isinstance(digest, bytes) or len(digest) != _HASH_BYTES:
        raise CaptureError(f"{where}: hash must be {_HASH_BYTES} bytes of bin")
    return Record(n=n, at=at, actor=actor, mono_ns=mono_ns, frames=tuple(frames), hash=digest)


def _describe_torn(torn: TornTail) -> str:
    after = "before any whole record" if torn.after_record is None else f"after record n={torn.after_record}"
    return f"torn tail: {torn.size} bytes at offset {torn.offset}, {after}, are not a whole record"


def read_log(path: str | os.PathLike[str], *, max_record_bytes: int = MAX_RECORD_BYTES) -> CaptureLog:
    """Read a whole buslog.

    A torn tail is reported in ``torn``, not raised; anything else that is not a well-formed
    version-1 buslog raises ``CaptureError``. OS errors propagate as ``OSError``.
    """
    name = os.fspath(path)
    with open(path, "rb") as fh:
        scan = _Scanner(fh, name, max_record_bytes)
        header = scan.header()
        records = tuple(scan.records())
        return CaptureLog(path=name, header=header, records=records, torn=scan.torn)


def iter_records(
    path: str | os.PathLike[str], *, max_record_bytes: int = MAX_RECORD_BYTES
) -> Iterator[Record]:
    """Stream a buslog's records; a torn tail raises ``CaptureError`` after every whole record."""
    name = os.fspath(path)
    with open(path, "rb") as fh:
        scan = _Scanner(fh, name, max_record_bytes)
        scan.header()
        yield from scan.records()
        if scan.torn is not None:
            raise CaptureError(f"{name}: {_describe_torn(scan.torn)}")


def verify(path: str | os.PathLike[str], *, max_record_bytes: int = MAX_RECORD_BYTES) -> VerifyReport:
    """Check a buslog without trusting it.

    Checks the header, consecutive ``n``, per-actor ``mono_ns`` order, the hash chain and a torn
    tail. Never raises for a bad or unreadable file: each finding is a problem.

    Each record is checked against the *stored* hash of the one before it, so an edited record is
    reported once, while a removed or moved record breaks the chain where it was. Whole records
    cut off the end leave no trace in a chain without a trailer; ``records`` says how many remain.
    """
    problems: list[str] = []
    unlisted = 0

    def problem(text: str) -> None:
        nonlocal unlisted
        if len(problems) < _MAX_PROBLEMS:
            problems.append(text)
        else:
            unlisted += 1

    name = os.fspath(path)
    count = 0
    torn: TornTail | None = None
    try:
        with open(path, "rb") as fh:
            scan = _Scanner(fh, name, max_record_bytes)
            prev_hash = hashlib.sha256(_pack(_header_map(scan.header()))).digest()
            expected_n = 0
            last_mono: dict[str, int] = {}
            for index, record in enumerate(scan.records()):
                count += 1
                if record.n != expected_n:
                    problem(
                        f"{name}: record #{index} (n={record.n}): n is not consecutive, expected {expected_n}"
                    )
                expected_n = record.n + 1
                previous = last_mono.get(record.actor)
                if previous is not None and record.mono_ns < previous:
                    problem(
                        f"{name}: record #{index} (n={record.n}): mono_ns of {record.actor} went backwards "
                        f"({record.mono_ns} < {previous})"
                    )
                last_mono[record.actor] = record.mono_ns
                if _record_hash(prev_hash, record) != record.hash:
                    problem(
                        f"{name}: record #{index} (n={record.n}): hash mismatch (this record was edited, "
                        "or one before it was removed or moved)"
                    )
                prev_hash = record.hash
            torn = scan.torn
            if torn is not None:
                problem(f"{name}: {_describe_torn(torn)}")
    except CaptureError as exc:
        problem(str(exc))
    except OSError as exc:
        problem(f"{name}: cannot read: {exc}")
    if unlisted:
        problems.append(f"... and {unlisted} more problems")
    return VerifyReport(ok=not problems, records=count, problems=tuple(problems), torn=torn)


def pack_payload(obj: object) -> bytes:
    """msgpack for the payload of an effect record an actor writes itself (``record_mailbox``)."""
    return _pack(obj)


def unpack_payload(data: bytes) -> Any:
    """The inverse of ``pack_payload``, as strict as the reader: no ext types, no repeated map keys."""
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, ext_hook=_refuse_ext, object_pairs_hook=_unique_keys
    )


CAPTURE_ENV: Final = "KBUS_CAPTURE"


def capture_from_env(node: str, schema: str) -> CaptureWriter | None:
    """With ``KBUS_CAPTURE=DIR`` set, a writer of ``DIR/<node>.buslog`` (``<node>.<pid>.<k>.buslog`` when that
    exists: a log is never written into twice); None when it is not set."""
    folder = os.environ.get(CAPTURE_ENV)
    if not folder:
        return None
    base = Path(folder)
    candidates = [
        base / f"{node}.buslog",
        *(base / f"{node}.{os.getpid()}.{k}.buslog" for k in range(1, 1000)),
    ]
    for path in candidates:
        if path.exists():
            continue
        try:
            return CaptureWriter(path, node=node, schema=schema)
        except CaptureError:  # made by another node between the check and the open: take the next name
            continue
    raise CaptureError(f"{base}: no free capture file name for node {node}")
