"""Watching etcd: one ``Watch`` stream per provider shared by every watcher.

- :mod:`.watcher`: one watcher, the changes of a key or range, nothing lost or twice;
- :mod:`.stream`: the stream that serves them all, reopened and resumed when it breaks;
- :mod:`.refusals`: watches refused for auth reasons (an expired token, or not?);
- :mod:`.held_keys`: one watch over a key prefix shared by every held key.
"""

from etcd_leases.etcd.watch.stream import WatchStream
from etcd_leases.etcd.watch.watcher import ErrorCallback, EventsCallback, Watcher

__all__ = ["ErrorCallback", "EventsCallback", "WatchStream", "Watcher"]
