"""The geo rules the policy tests and the SPANK environment tests share."""

from __future__ import annotations

from slurm_geo.config.tables import parse_policy
from slurm_geo.policy.geo import GeoRules

REGIONS = {"home", "remote"}
POLICY = parse_policy(
    {"require_cost_center": True, "signal_lead_s": 60, "max_restarts": 3,
     "data_classes": {"restricted": ["home"]}, "budgets": {"ml": 500, "ops": 99.5}},
    REGIONS, "[policy]")


RULES = GeoRules(POLICY, {"onprem": "home", "rented": "remote"})
