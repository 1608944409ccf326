"""A linearizability checker for the lease contract (issue 19).

``history`` records calls (start, end, answer or none), ``recorder`` wraps any
provider to record them (the recipes' too, and a holder's belief that it holds),
``model`` is the contract's sequential object per key, ``checker`` searches for an
order (Wing & Gong with Lowe's memoisation, per key, as Porcupine does), ``report``
prints where no order can go on. ``generate`` makes valid histories from the in-memory
model, ``workload`` drives random calls and ``recipes`` drives ``hold``, ``adopt`` and
an election, ``faults`` kills, freezes and partitions etcd members and freezes the
recording processes, ``child`` records in a process of its own, and ``soak`` runs it
all (``python -m tests.linearizability.soak --help``). ``inbox`` checks recorded
histories of the threads' inboxes against a FIFO queue per thread, which the workers
of ``inbox_child`` record.
"""
