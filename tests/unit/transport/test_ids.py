"""Message ids (``transport.envelope.id_source``): 16 bytes, a random prefix per source, then a counter."""

from __future__ import annotations

import threading

from transport.envelope import id_source, new_id


def test_ids_are_16_bytes_unique_and_share_their_sources_prefix() -> None:
    ids = id_source()
    taken = [ids() for _ in range(10_000)]
    assert all(type(i) is bytes and len(i) == 16 for i in taken)
    assert len(set(taken)) == len(taken)
    assert {i[:8] for i in taken} == {taken[0][:8]}  # one prefix per source
    assert [int.from_bytes(i[8:], "big") for i in taken[:3]] == [1, 2, 3]  # then the counter


def test_two_sources_do_not_share_a_prefix() -> None:
    assert id_source()()[:8] != id_source()()[:8] != new_id()[:8]


def test_threads_taking_ids_at_once_never_get_the_same_one() -> None:
    ids = id_source()
    taken: list[list[bytes]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def take(out: list[bytes]) -> None:
        start.wait(timeout=10)
        out.extend(ids() for _ in range(20_000))

    threads = [threading.Thread(target=take, args=(out,)) for out in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    every = [i for out in taken for i in out]
    assert len(set(every)) == len(every) == 80_000
