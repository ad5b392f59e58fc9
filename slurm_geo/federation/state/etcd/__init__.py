"""The federation state replicated on etcd: one leader among the daemons of the trusted
sites, every value sealed (docs/federation.md, "Replicated state on etcd").

`kv` (etcd behind its endpoints, values sealed), `layout` (the key names), `transaction`
(compare-and-set writes, refused by etcd for a replica that does not lead), `leadership`
(the leader key and its lease; `next_step`, pure), `state`, `identities` and `audit` (the
interface of federation.state.interface, as the SQLite state's).
"""
