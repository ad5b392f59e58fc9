"""Site policy as pure decisions: retention tiers; residency, data classes and budgets of
the `--geo-*` directives (checked by the SPANK plugin's validator and by job_submit.lua)."""
