"""Elections and locks in etcd's own layout, shared with Go's ``concurrency`` package,
``etcdctl elect`` and ``etcdctl lock`` (see the README's "etcd-native elections and
locks"). They rely on etcd's create revisions, so they belong to the etcd backend."""

from etcd_leases.etcd.native.election import Leader, NativeElection
from etcd_leases.etcd.native.lock import NativeLock

__all__ = ["Leader", "NativeElection", "NativeLock"]
