"""Where checkpoint objects live: the store interface and a local directory (`store`), S3
(`s3store`), the wrappers (`retry`, `breaker`, `pacing`), the one opener (`open_store`),
transfers a few at once (`parallel`, `transfer_plan`), digests (`sums`, `digests`) and a
keyless scrub (`scrub_store`).

Submodules are imported by their users; this package imports none of them.
"""
