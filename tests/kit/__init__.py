"""The test kit: what more than one test module builds on (a manual clock, site configs,
keyword builders for jobs, leases and job info, the shared federation and sync worlds).

Test modules import from here and never from one another (tests/test_test_layout.py)."""
