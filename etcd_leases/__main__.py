"""``python -m etcd_leases``: the ``etcd-leases`` command."""

from etcd_leases.cli import entry_point

entry_point()
