"""A feature repository declared for the tests: users' activity and profile, and a ratio computed on
demand. Its sources live in the directory named by MLSCALE_TEST_FEATURE_DATA (the tests write them)."""

from __future__ import annotations

import os
from datetime import timedelta

from mlscale.features import (
    Entity,
    FeatureRepository,
    FeatureService,
    FeatureView,
    Field,
    FileSource,
    declare_repository,
    on_demand_feature_view,
)

DATA = os.environ.get("MLSCALE_TEST_FEATURE_DATA", "/nonexistent")
user = Entity("user", join_keys=["user_id"], dtype="int64")
activity = FeatureView("activity", [user], [Field("spend"), Field("visits")],
                       FileSource(f"{DATA}/activity.parquet"), ttl=timedelta(days=2))
profile = FeatureView("profile", [user], [Field("age", skew_threshold=0.3)], FileSource(f"{DATA}/profile.parquet"))


@on_demand_feature_view(sources=[activity], schema=[Field("spend_per_visit")])
def per_visit(columns):
    return {"spend_per_visit": columns["spend"] / (columns["visits"] + 1.0)}


plan = FeatureView("plan", [user], [Field("tier", "string")], FileSource(f"{DATA}/plan.parquet"))
model = FeatureService("model", [activity, profile, per_visit])
with_tier = FeatureService("with_tier", [activity, plan])
declare_repository(FeatureRepository([user], [activity, profile, per_visit, plan], [model, with_tier]))
