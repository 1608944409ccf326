"""KeptLease and lease IDs on their own: what the keep-alive loop relies on."""

from __future__ import annotations

import logging
import re
import time

import pytest

from etcd_leases.etcd.kept_lease import KeptLease
from etcd_leases.etcd.lease_ids import is_session_lease, new_lease_id
from tests.conftest import Records


def test_lease_ids_are_positive_int64s_and_say_whether_they_are_a_session() -> None:
    tenures = [new_lease_id() for _ in range(500)]
    sessions = [new_lease_id(session=True) for _ in range(500)]
    assert all(0 < lease_id < 2**62 for lease_id in tenures + sessions)
    assert not any(is_session_lease(lease_id) for lease_id in tenures)
    assert all(is_session_lease(lease_id) for lease_id in sessions)
    assert len(set(tenures + sessions)) == 1000
    # Below the mark, 45 random bits (plus one): about half the IDs have the top one.
    assert any(lease_id & (1 << 44) for lease_id in sessions)


def test_a_lease_id_is_positive_even_when_the_random_bits_are_all_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # etcd reads ID 0 as "choose one for me": a lost answer could not be retried.
    monkeypatch.setattr("secrets.randbits", lambda bits: 0)
    assert new_lease_id(session=True) > 0


async def test_remaining_is_zero_once_the_deadline_passed() -> None:
    kept = KeptLease(1, 3, time.monotonic() - 0.01)
    assert kept.remaining() == 0.0 and not kept.lost.is_set()
    alive = KeptLease(2, 3, time.monotonic() + 2)
    assert 1.5 < alive.remaining() <= 2
    assert alive.lost_reason is None  # no reason before a loss


async def test_loss_callbacks_run_once_with_the_lease_and_can_be_taken_back() -> None:
    kept = KeptLease(7, 3, time.monotonic() + 3)
    seen: list[KeptLease] = []
    kept.add_loss_callback(seen.append)
    taken_back: list[KeptLease] = []
    kept.add_loss_callback(taken_back.append)
    kept.remove_loss_callback(taken_back.append)
    kept.remove_loss_callback(taken_back.append)  # twice: nothing to take back, no error
    kept._set_lost("gone")
    kept._set_lost("again")
    assert seen == [kept] and taken_back == []
    assert kept.lost_reason == "gone" and kept.remaining() == 0.0
    late: list[KeptLease] = []
    kept.add_loss_callback(late.append)  # already lost: called at once, with the lease
    assert late == [kept]


async def test_a_loss_callback_that_raises_is_logged_and_stops_no_other(
    no_background_task_fails: Records,
) -> None:
    kept = KeptLease(0xABC, 3, time.monotonic() + 3)
    after: list[KeptLease] = []

    def fails(_: KeptLease) -> None:
        raise RuntimeError("boom")

    kept.add_loss_callback(fails)
    kept.add_loss_callback(after.append)
    kept._set_lost("gone")
    assert after == [kept]
    (record,) = no_background_task_fails.records
    assert record.levelno == logging.ERROR
    assert "lease abc failed" in record.getMessage() and "fails" in record.getMessage()
    no_background_task_fails.records.clear()  # failed on purpose


async def test_a_kept_lease_shows_its_id_ttl_and_state() -> None:
    kept = KeptLease(0xABC, 3, time.monotonic() + 2)
    assert re.fullmatch(r"<KeptLease abc ttl=3s [12]\.[0-9]{3} s>", repr(kept)), repr(kept)
    kept._set_lost("gone")
    assert repr(kept) == "<KeptLease abc ttl=3s lost: gone>"
