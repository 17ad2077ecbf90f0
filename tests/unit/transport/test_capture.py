"""Tests for transport.capture: writing, reading, torn tails, verify and hostile files."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from transport.capture import (
    FORMAT,
    MAX_FRAMES,
    VERSION,
    CaptureError,
    CaptureWriter,
    TornTail,
    iter_records,
    read_log,
    verify,
)

WAIT = 10.0  # upper bound on every wait in this file; a healthy run needs milliseconds


def _header(**overrides: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "created": 1700000000.5,
        "node": "n1",
        "schema": "schema-hash",
        "seed": 7,
    }
    header.update(overrides)
    return header


def _write_log(path: Path, count: int, *, actor: str = "n1/echo") -> None:
    with CaptureWriter(path, node="n1", schema="schema-hash", seed=7) as writer:
        for i in range(count):
            # Varying sizes, so truncation tests cut records of different lengths.
            writer.record("deliver", actor, [f"PAYLOAD-{i:04d}".encode(), b"x" * i], mono_ns=1000 + i)


def _spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every msgpack object in data: the header first, then each record."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    spans = []
    start = 0
    for _ in unpacker:
        spans.append((start, unpacker.tell()))
        start = unpacker.tell()
    assert start == len(data)
    return spans


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive()


# ----------------------------------------------------------------------------- writing and reading


def test_round_trip_from_four_threads_keeps_every_record_and_each_threads_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "logs" / "run.buslog"
    per_thread = 500
    start = threading.Barrier(4, timeout=WAIT)

    with CaptureWriter(path, node="n1", schema="schema-hash") as writer:

        def produce(t: int) -> None:
            start.wait()
            for j in range(per_thread):
                writer.record("send", f"n1/t{t}", [f"{t}:{j}".encode(), b"body"])

        threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        _join_all(threads)
    assert writer.records_written == 4 * per_thread

    log = read_log(path)
    assert log.torn is None
    assert [r.n for r in log.records] == list(range(4 * per_thread))
    for t in range(4):
        mine = [r for r in log.records if r.actor == f"n1/t{t}"]
        assert [r.frames for r in mine] == [(f"{t}:{j}".encode(), b"body") for j in range(per_thread)]
        assert all(r.at == "send" for r in mine)
    report = verify(path)
    assert report.ok, report.problems
    assert report.records == 4 * per_thread


def test_header_and_record_fields_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    with CaptureWriter(path, node="n9", schema="abc123", seed=42, created=1234.5) as writer:
        writer.record("effect", "n9/tool", [b"", b"\x00\xff"], mono_ns=17)
        writer.record("clock", "n9/clock", [], mono_ns=18)

    log = read_log(path)
    assert log.path == str(path)
    assert (log.header.format, log.header.version) == (FORMAT, VERSION)
    assert (log.header.created, log.header.node, log.header.schema, log.header.seed) == (
        1234.5,
        "n9",
        "abc123",
        42,
    )
    first, second = log.records
    assert (first.n, first.at, first.actor, first.mono_ns, first.frames) == (
        0,
        "effect",
        "n9/tool",
        17,
        (b"", b"\x00\xff"),
    )
    assert (second.n, second.at, second.frames) == (1, "clock", ())


def test_records_are_packed_exactly_as_the_format_says(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "a.buslog"
    with CaptureWriter(path, node="n1", schema="s", created=5.0) as writer:
        writer.record("send", "n1/a", [b"one", b"two"], mono_ns=10)
        writer.record("deliver", "n1/b", [b"three"], mono_ns=11)
    data = path.read_bytes()
    header_bytes = msgpack.packb(
        {"format": FORMAT, "version": 1, "created": 5.0, "node": "n1", "schema": "s", "seed": None},
        use_bin_type=True,
    )
    expected = header_bytes
    prev = hashlib.sha256(header_bytes).digest()
    for n, (at, actor, frames, mono) in enumerate(
        [("send", "n1/a", [b"one", b"two"], 10), ("deliver", "n1/b", [b"three"], 11)]
    ):
        body = {"n": n, "at": at, "actor": actor, "mono_ns": mono, "frames": frames}
        prev = hashlib.sha256(prev + msgpack.packb(body, use_bin_type=True)).digest()
        expected += msgpack.packb({**body, "hash": prev}, use_bin_type=True)
    assert data == expected


def test_flush_makes_records_readable_while_the_writer_is_open(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    with CaptureWriter(path, node="n1", schema="s") as writer:
        for i in range(10):
            writer.record("send", "n1/a", [bytes([i])])
        writer.flush(WAIT)
        assert writer.records_written == 10
        log = read_log(path)
        assert [r.frames for r in log.records] == [(bytes([i]),) for i in range(10)]
        assert log.torn is None


def test_mono_ns_defaults_to_the_monotonic_clock_at_the_call(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    before = time.monotonic_ns()
    with CaptureWriter(path, node="n1", schema="s") as writer:
        writer.record("send", "n1/a", [b"x"])
    after = time.monotonic_ns()
    (record,) = read_log(path).records
    assert before <= record.mono_ns <= after


def test_frames_are_copied_so_the_caller_may_reuse_its_buffer(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    buffer = bytearray(b"before")
    with CaptureWriter(path, node="n1", schema="s") as writer:
        writer.record("send", "n1/a", [buffer, memoryview(b"view")])
        buffer[:] = b"after!"
    (record,) = read_log(path).records
    assert record.frames == (b"before", b"view")


def test_a_burst_costs_one_write(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    writer = CaptureWriter(path, node="n1", schema="s")
    gated = GatedCountingFile(writer._file)
    writer._file = gated  # type: ignore[assignment]  # the writer thread is idle on its queue here
    try:
        writer.record("send", "n1/a", [b"first"])
        assert gated.entered.wait(WAIT)  # the writer thread is now blocked inside its first write
        for i in range(999):
            writer.record("send", "n1/a", [str(i).encode()])
        gated.gate.set()
        writer.flush(WAIT)
    finally:
        gated.gate.set()
        writer.close(WAIT)
    assert gated.writes == 2
    assert len(read_log(path).records) == 1000


# ------------------------------------------------------------------------------------ writer rules


def test_refuses_to_overwrite_a_non_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    path.write_bytes(b"someone's log")
    with pytest.raises(CaptureError, match="non-empty"):
        CaptureWriter(path, node="n1", schema="s")
    assert path.read_bytes() == b"someone's log"


def test_an_existing_empty_file_is_used(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    path.touch()
    with CaptureWriter(path, node="n1", schema="s") as writer:
        writer.record("send", "n1/a", [b"x"])
    assert len(read_log(path).records) == 1


def test_record_after_close_raises_and_close_is_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    writer = CaptureWriter(path, node="n1", schema="s")
    writer.record("send", "n1/a", [b"x"])
    writer.close(WAIT)
    writer.close(WAIT)
    writer.flush(WAIT)  # nothing left to flush
    with pytest.raises(CaptureError, match="closed"):
        writer.record("send", "n1/a", [b"y"])
    assert writer.records_written == 1
    assert len(read_log(path).records) == 1


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("bogus", "n1/a", [b"x"]), ValueError),
        (("send", 5, [b"x"]), TypeError),
        (("send", "n1/a", b"not-a-list-of-frames"), TypeError),
        (("send", "n1/a", [3]), TypeError),
        (("send", "n1/a", ["text"]), TypeError),
        (("send", "n1/a", [b"x"], 1.5), TypeError),
        (("send", "n1/a", [b"x"], True), TypeError),
        (("send", "n1/a", [b""] * (MAX_FRAMES + 1)), ValueError),
    ],
)
def test_record_rejects_bad_arguments_at_the_call(
    tmp_path: Path, args: tuple[Any, ...], error: type[Exception]
) -> None:
    with CaptureWriter(tmp_path / "a.buslog", node="n1", schema="s") as writer:
        with pytest.raises(error):
            writer.record(*args)
        writer.record("send", "n1/a", [b"ok"])
    assert writer.records_written == 1


# -------------------------------------------------------------------------- writer-thread failures


class DiskFullFile:
    """Fake: stands in for the writer's file and fails every write the way a full disk does."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "fake: no space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._real.close()


class GatedCountingFile:
    """Fake: forwards to the real file, counts writes, holds the first write until `gate` is set."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.writes = 0
        self.entered = threading.Event()
        self.gate = threading.Event()

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes == 1:
            self.entered.set()
            assert self.gate.wait(WAIT)
        return int(self._real.write(data))

    def flush(self) -> None:
        self._real.flush()

    def close(self) -> None:
        self._real.close()


def close_file_underneath(writer: CaptureWriter) -> None:
    """Fake failure: close the writer's file behind its back, as a buggy neighbour might."""
    writer._file.close()


def test_file_closed_underneath_surfaces_on_the_next_calls(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    writer = CaptureWriter(path, node="n1", schema="s")
    writer.record("send", "n1/a", [b"kept"])
    writer.flush(WAIT)  # the writer thread is idle on its queue after this
    close_file_underneath(writer)

    writer.record("send", "n1/a", [b"lost"])  # queued before the failure is known
    with pytest.raises(CaptureError, match="failed") as caught:
        writer.flush(WAIT)
    assert isinstance(caught.value.__cause__, ValueError)
    with pytest.raises(CaptureError, match="failed"):
        writer.record("send", "n1/a", [b"more"])
    with pytest.raises(CaptureError, match="failed"):
        writer.close(WAIT)
    with pytest.raises(CaptureError, match="failed"):  # sticky: never silently cleared
        writer.close(WAIT)
    assert writer.records_written == 1
    assert [r.frames for r in read_log(path).records] == [(b"kept",)]


def test_disk_full_surfaces_on_close(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    writer = CaptureWriter(path, node="n1", schema="s")
    writer._file = DiskFullFile(writer._file)  # type: ignore[assignment]  # writer thread is idle
    writer.record("send", "n1/a", [b"x"])
    with pytest.raises(CaptureError, match=r"(?i)no space") as caught:
        writer.close(WAIT)
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC


# -------------------------------------------------------------------------------------- torn tails


def test_torn_tail_is_reported_with_offset_and_last_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 5)
    data = path.read_bytes()
    record_spans = _spans(data)[1:]
    last_len = record_spans[-1][1] - record_spans[-1][0]

    for cut in range(1, last_len + 4):  # into the last record, exactly it, then into the one before
        length = len(data) - cut
        cut_path = tmp_path / f"cut{cut}.buslog"
        cut_path.write_bytes(data[:length])
        whole = [i for i, (_, end) in enumerate(record_spans) if end <= length]
        end_of_whole = record_spans[whole[-1]][1]

        log = read_log(cut_path)
        assert [r.n for r in log.records] == whole
        report = verify(cut_path)
        assert report.records == len(whole)
        if end_of_whole == length:
            assert log.torn is None
            assert report.ok, report.problems
        else:
            expected = TornTail(offset=end_of_whole, size=length - end_of_whole, after_record=whole[-1])
            assert log.torn == expected
            assert report.torn == expected
            assert not report.ok
            assert any("torn tail" in p for p in report.problems)


def test_torn_first_record_has_no_record_before_it(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 1)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    header_end = _spans(data)[0][1]
    assert read_log(path).torn == TornTail(
        offset=header_end, size=len(data) - 3 - header_end, after_record=None
    )


def test_iter_records_raises_on_a_torn_tail_after_every_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 4)
    path.write_bytes(path.read_bytes()[:-1])
    seen = []
    with pytest.raises(CaptureError, match="torn tail"):
        for record in iter_records(path):
            seen.append(record.n)
    assert seen == [0, 1, 2]


def test_iter_records_streams_a_clean_log(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 4)
    assert [r.n for r in iter_records(path)] == [0, 1, 2, 3]


def test_a_file_cut_inside_its_header_is_not_a_buslog(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 1)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(CaptureError, match="inside its header"):
        read_log(path)


# ------------------------------------------------------------------------------------------ verify


def test_verify_catches_a_flipped_byte_in_a_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 8)
    data = bytearray(path.read_bytes())
    at = data.index(b"PAYLOAD-0005")
    data[at + 3] ^= 0x01
    path.write_bytes(bytes(data))

    report = verify(path)
    assert not report.ok
    assert report.records == 8
    assert len(report.problems) == 1
    assert "record #5" in report.problems[0]
    assert "hash mismatch" in report.problems[0]


def test_verify_catches_a_deleted_record(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 8)
    data = path.read_bytes()
    start, end = _spans(data)[1 + 3]
    path.write_bytes(data[:start] + data[end:])

    report = verify(path)
    assert not report.ok
    assert report.records == 7
    assert all("record #3 (n=4)" in p for p in report.problems)
    assert any("not consecutive" in p for p in report.problems)
    assert any("hash mismatch" in p for p in report.problems)


def test_verify_catches_swapped_records(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 8, actor="n1/a")
    data = path.read_bytes()
    spans = _spans(data)
    (s2, e2), (s3, e3) = spans[1 + 2], spans[1 + 3]
    path.write_bytes(data[:s2] + data[s3:e3] + data[s2:e2] + data[e3:])

    report = verify(path)
    assert not report.ok
    assert report.records == 8
    text = "\n".join(report.problems)
    assert "record #2 (n=3): n is not consecutive" in text
    assert "record #2 (n=3): hash mismatch" in text
    assert "record #3 (n=2): hash mismatch" in text
    assert "went backwards" in text


def test_verify_catches_an_edited_header(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    _write_log(path, 3)
    data = path.read_bytes()
    header_end = _spans(data)[0][1]
    header = msgpack.unpackb(data[:header_end], raw=False)
    header["node"] = "n2"
    path.write_bytes(msgpack.packb(header, use_bin_type=True) + data[header_end:])

    report = verify(path)
    assert not report.ok
    assert len(report.problems) == 1
    assert "record #0" in report.problems[0]
    assert "hash mismatch" in report.problems[0]


def test_verify_catches_mono_ns_going_backwards_for_one_actor(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    with CaptureWriter(path, node="n1", schema="s") as writer:
        writer.record("send", "n1/a", [b"1"], mono_ns=100)
        writer.record("send", "n1/b", [b"2"], mono_ns=50)  # another actor: no order between actors
        writer.record("send", "n1/a", [b"3"], mono_ns=99)

    report = verify(path)
    assert not report.ok
    assert len(report.problems) == 1
    assert "record #2" in report.problems[0]
    assert "n1/a went backwards (99 < 100)" in report.problems[0]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "empty"),
        (b"hello, this is a text file\n", "not a buslog"),
        (msgpack.packb({"format": "something-else", "version": 1}), "not a buslog"),
        (msgpack.packb([1, 2, 3]), "not a buslog"),
    ],
)
def test_a_file_that_is_not_a_buslog(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "a.buslog"
    path.write_bytes(content)
    with pytest.raises(CaptureError, match=match):
        read_log(path)
    report = verify(path)
    assert not report.ok
    assert report.records == 0
    assert match in report.problems[0]


def test_an_unknown_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.buslog"
    path.write_bytes(msgpack.packb(_header(version=2), use_bin_type=True))
    with pytest.raises(CaptureError, match="unknown buslog version 2"):
        read_log(path)
    report = verify(path)
    assert not report.ok
    assert "unknown buslog version 2" in report.problems[0]


def test_verify_of_a_missing_file_reports_instead_of_raising(tmp_path: Path) -> None:
    report = verify(tmp_path / "nope.buslog")
    assert not report.ok
    assert "cannot read" in report.problems[0]


# ----------------------------------------------------------------------------------- hostile files


def _record_map(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "n": 0,
        "at": "send",
        "actor": "n1/a",
        "mono_ns": 1,
        "frames": [b"x"],
        "hash": b"\x00" * 32,
    }
    record.update(overrides)
    return record


def _packed_record(**overrides: Any) -> bytes:
    return bytes(msgpack.packb(_record_map(**overrides), use_bin_type=True))


# The record's map up to its "frames" value, for splicing in hand-made msgpack.
_BEFORE_FRAMES = (
    b"\x86"
    + msgpack.packb("n")
    + msgpack.packb(0)
    + msgpack.packb("at")
    + msgpack.packb("send")
    + msgpack.packb("actor")
    + msgpack.packb("n1/a")
    + msgpack.packb("mono_ns")
    + msgpack.packb(1)
    + msgpack.packb("frames")
)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        (_packed_record(frames=[msgpack.ExtType(5, b"boom")]), "ext type 5"),
        (_packed_record(frames=[msgpack.Timestamp(1, 0)]), "frames"),
        (msgpack.packb({1: "int key"}), "map key"),
        (_BEFORE_FRAMES + b"\xdd\xff\xff\xff\xff", "max_array_len"),  # 4-billion-frame array
        (_BEFORE_FRAMES + b"\x91" * 5000, "malformed"),  # nesting deeper than the unpacker's stack
        (b"\xc1", "malformed"),  # a byte msgpack never uses
        (b"\x86\xa1n\x00\xa1n\x01" + _packed_record()[1:], "repeats a key"),
        (_packed_record(n="0"), "n must be an int"),
        (_packed_record(n=True), "n must be an int"),
        (_packed_record(at="teleport"), "at must be one of"),
        (_packed_record(actor=b"n1/a"), "actor must be str"),
        (_packed_record(mono_ns=1.5), "mono_ns must be an int"),
        (_packed_record(frames=["text"]), "frames must be an array of bin"),
        (_packed_record(hash=b"short"), "hash must be 32 bytes"),
        (msgpack.packb({**_record_map(), "extra": 1}, use_bin_type=True), "unexpected keys"),
        (msgpack.packb("just a string"), "not a record map"),
    ],
)
def test_hostile_records_raise_capture_error_naming_the_record(
    tmp_path: Path, record: bytes, match: str
) -> None:
    path = tmp_path / "hostile.buslog"
    good = _packed_record()
    path.write_bytes(msgpack.packb(_header(), use_bin_type=True) + good + record + good)
    with pytest.raises(CaptureError, match=match) as caught:
        read_log(path)
    assert "record #1 at offset" in str(caught.value)
    with pytest.raises(CaptureError, match="record #1"):
        list(iter_records(path))
    report = verify(path)
    assert not report.ok
    assert report.records == 1
    assert any("record #1" in p for p in report.problems)


def test_huge_declared_length_is_refused_not_allocated(tmp_path: Path) -> None:
    path = tmp_path / "hostile.buslog"
    huge_bin = b"\x91\xc6\xff\xff\xff\xff"  # one frame claiming 4 GiB
    path.write_bytes(msgpack.packb(_header(), use_bin_type=True) + _BEFORE_FRAMES + huge_bin + b"j" * 20_000)
    with pytest.raises(CaptureError, match=r"record #0 .*larger than max_record_bytes"):
        read_log(path, max_record_bytes=4096)
    assert not verify(path, max_record_bytes=4096).ok


def test_huge_declared_length_at_the_end_is_a_torn_tail_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "hostile.buslog"
    prefix = msgpack.packb(_header(), use_bin_type=True) + _packed_record()
    path.write_bytes(prefix + _BEFORE_FRAMES + b"\x91\xc6\xff\xff\xff\xff" + b"j" * 100)
    log = read_log(path)
    assert [r.n for r in log.records] == [0]
    assert log.torn == TornTail(offset=len(prefix), size=len(path.read_bytes()) - len(prefix), after_record=0)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (_header(created=5), "created must be a float"),
        (_header(node=1), "node and schema must be str"),
        (_header(seed="7"), "seed must be an int"),
        (_header(version=True), "unknown buslog version"),
        ({k: v for k, v in _header().items() if k != "schema"}, "missing keys"),
    ],
)
def test_bad_headers_are_refused(tmp_path: Path, header: dict[str, Any], match: str) -> None:
    path = tmp_path / "a.buslog"
    path.write_bytes(msgpack.packb(header, use_bin_type=True))
    with pytest.raises(CaptureError, match=match):
        read_log(path)
