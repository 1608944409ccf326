"""A linearizability checker for the lease contract (issue 19).

``history`` records calls (start, end, answer or none), ``recorder`` wraps any
provider to record them, ``model`` is the contract's sequential object per key,
``checker`` searches for an order (Wing & Gong with Lowe's memoisation, per key, as
Porcupine does), ``report`` prints where no order can go on. ``generate`` makes valid
histories from the in-memory model, ``workload`` drives random calls, ``faults``
kills and freezes etcd members, ``child`` records in a process of its own, and
``soak`` runs it all (``python -m tests.linearizability.soak --help``).
"""
