"""Chargeback: accounting from every cluster and checkpoint egress, priced into cost lines.

Pure parts (periods, attribution, prices and cost lines, budgets, reports) take their inputs
as arguments; `db` and `ingest` are the thin I/O around them. docs/billing.md explains the
arithmetic with a worked example.
"""
