"""Who is calling the federation daemon, and what they may cost: authentication (`authn`,
`sessions`), the TLS the service speaks (`tls`), Slurm lookups a caller may cause
(`lookups`) and refused requests audited at a bounded rate (`refusals`).

Submodules are imported by their users; this package imports none of them.
"""
