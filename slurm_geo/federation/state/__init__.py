"""The federation state: logical jobs, incarnations, leases, owners and the audit log,
in SQLite at one site (`sqlite`, `schema`, `identities`, `audit`) or replicated on etcd
(`etcd`), behind one typed interface (`interface`), opened from the config by `open`.

Submodules are imported by their users; this package imports none of them.
"""
