"""A linearizability checker for the lease contract (issue 19).

``history`` records calls, ``model`` is the contract's sequential object per key,
``checker`` searches for an order (Wing & Gong with Lowe's memoisation, per key, as
Porcupine does), ``report`` prints where no order can go on.
"""
