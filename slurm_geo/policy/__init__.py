"""Site policy as pure decisions: retention tiers (residency and budgets follow)."""
