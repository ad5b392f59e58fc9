"""The federation daemon's shell: its HTTP endpoint (`service`), what a replica that does not
lead answers (`followers`), and its command line and main loop (`entry`).

Submodules are imported by their users; this package imports none of them.
"""
