"""The job plan: each strategy's layout, the mesh as degrees and the batch, resolved in one place."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from mlscale.config import TrainConfig
from mlscale.tasks import make_task
from mlscale.train.plan import JobPlan, MeshDims
from mlscale.train.planner import plan_job
from tests.helpers import REPO


@pytest.mark.parametrize(("options", "mesh", "processes", "servers", "shards", "global_batch"), [
    (dict(workers=4), MeshDims(dp_replicate=4), 4, 0, 4, 4 * 32),
    (dict(workers=4, strategy="fsdp", grad_accum=2), MeshDims(dp_shard=4), 4, 0, 4, 4 * 64),
    (dict(workers=2, strategy="tp", task="tinylm"), MeshDims(tp=2), 2, 0, 1, 32),
    (dict(workers=4, strategy="pipeline", stages=2, task="tinylm"), MeshDims(dp_replicate=2, pp=2), 4, 0, 2, 64),
    (dict(workers=3, strategy="ps", ps_servers=2), MeshDims(dp_replicate=3), 5, 2, 3, 96),
    (dict(workers=3, fault_tolerance="per-step"), MeshDims(dp_replicate=3), 3, 0, 3, 96),
    (dict(workers=2, strategy="fsdp", fault_tolerance="per-step", group_size=2),
     MeshDims(dp_replicate=2, dp_shard=2), 4, 0, 4, 128),
])
def test_each_strategy_plans_its_mesh_processes_and_batch(options, mesh, processes, servers, shards, global_batch):
    config = TrainConfig(**options)
    plan = plan_job(config, data=make_task(config.task, {}).train)
    assert plan.mesh == mesh and plan.processes == processes and plan.servers == servers
    assert plan.data_shards == shards and plan.global_batch == global_batch
    assert plan.mesh.size + plan.servers * plan.replica_groups == plan.processes
    assert plan.total_steps and plan.total_steps > 0
    assert JobPlan.from_dict(json.loads(json.dumps(plan.as_dict()))) == plan  # plan.json reads back equal


def test_the_planner_is_the_only_caller_of_the_strategies_layout_methods():
    """Nothing re-derives the layout: the strategies' layout methods are called from the planner alone."""
    layout = {"world_size", "data_shards", "checkpoint_ranks", "mesh"}
    callers = []
    for path in sorted((REPO / "mlscale").rglob("*.py")):
        if path.relative_to(REPO).as_posix() == "mlscale/train/planner.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in layout:
                target = ast.unparse(node.func.value)
                if "strategy" in target.lower() or target in ("cls", "super()", "type(self)"):
                    callers.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node.func)}")
    assert callers == []


def test_a_run_writes_its_plan_beside_its_configuration(tmp_path):
    from mlscale.train.launcher import fit

    report = fit(TrainConfig(task="digits", steps=3, batch_size=16, progress=False, run_dir=str(tmp_path / "run")))
    plan = JobPlan.read(Path(report["run_dir"]) / "plan.json")
    assert plan.total_steps == report["steps"] == 3 and plan.global_batch == 16 and plan.processes == 1


def test_every_declared_strategy_has_its_class_and_every_class_is_declared():
    from mlscale.config import STRATEGY_HELP as DECLARED
    from mlscale.train.strategies import STRATEGIES

    assert list(STRATEGIES) == list(DECLARED)


def test_a_strategy_owns_its_options_group_and_the_group_applies_to_it_alone():
    from mlscale.config import GROUPS
    from mlscale.train.strategies import STRATEGIES

    owned = {name: cls.options for name, cls in STRATEGIES.items() if cls.options is not None}
    assert set(owned) == {"ddp", "pipeline", "ps"}
    for name, model in owned.items():
        assert model in GROUPS.values() and model.only["strategy"] == (name,)


def test_mesh_degrees_and_a_plan_that_cannot_run_are_refused_when_made():
    assert MeshDims(dp_replicate=2, tp=2).tp_enabled and not MeshDims(dp_replicate=2, tp=2).pp_enabled
    for bad in ({"tp": 0}, {"pp": -1}, {"dp_shard": 1.5}, {"dp_replicate": True}):
        with pytest.raises(ValueError, match="mesh degree"):
            MeshDims(**bad)
    good = dict(strategy="ddp", fault_tolerance="restart", world=2, replica_groups=1, servers=0,
                mesh=MeshDims(dp_replicate=2), rank_shards=[0, 1], checkpoint_ranks=[0], batch_size=4, grad_accum=1)
    assert JobPlan(**good).global_batch == 8
    for change, words in (({"mesh": MeshDims(dp_replicate=3)}, "a mesh of 3 training processes"),
                          ({"rank_shards": [0]}, "1 ranks' data shards for a world of 2"),
                          ({"checkpoint_ranks": [2]}, "checkpoint ranks [2]"),
                          ({"grad_accum": 0}, "batch size 4 x 0"),
                          ({"servers": 2}, "servers 2")):
        with pytest.raises(ValueError, match=re.escape(words)):
            JobPlan(**{**good, **change})
