"""Backoff: the pace at which the keep-alive loop and the watch streams try again."""

from __future__ import annotations

import pytest

from etcd_leases.etcd.backoff import Backoff


def test_waits_double_up_to_the_ceiling() -> None:
    backoff = Backoff()  # the reconnect pace
    waits = [backoff.failed() for _ in range(8)]
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_a_success_starts_the_waits_over() -> None:
    backoff = Backoff(0.05, 1.0)
    for _ in range(4):
        backoff.failed()
    backoff.reset()
    assert [backoff.failed(), backoff.failed()] == pytest.approx([0.05, 0.1])


def test_a_ceiling_below_a_doubling_is_kept() -> None:
    backoff = Backoff(0.3, 0.5)
    assert [backoff.failed() for _ in range(3)] == pytest.approx([0.3, 0.5, 0.5])
