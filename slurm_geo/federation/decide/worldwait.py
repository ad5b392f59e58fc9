"""Whether a move waits for the job's world at its target (issue 31 item 4). Pure.

A move decided while the job's cluster is alive (a hopeless queue, a move a person
approved, a restart or a failback) never starts the new incarnation where the job's world
is not complete: its preamble would find no world record there and run the job without
its inputs. checkpoint-sync stages the world there, behind the checkpoints; meanwhile the
move waits (a queued job stays queued, a training job keeps its lease and trains on) and
happens once the world's record is at the target (federation.worldstaged). A move off a
lost cluster never waits here: while home is down the planner makes a target without the
world ineligible (nothing can be read from home then), and a target residency forbids is
never planned (policy.geo.check).
"""

from __future__ import annotations

from slurm_geo.federation.decide.planner import PredictTransfer, WorldStaging, stage_s


def world_wait(world: WorldStaging | None, target: str, target_store: str,
               predict: PredictTransfer) -> str:
    """'' when the job's world is complete in `target_store` (or it declares none); else
    why a move to `target` waits, in one line, with what is left and the predicted time
    to stage it (`planner.stage_s`)."""
    if world is None:
        return ""
    missing = world.missing(target_store)
    if missing == 0:
        return ""
    if missing is None:
        return (f"waiting for its world at {target}: its inputs and env (--geo-inputs, "
                f"--geo-env) are not staged in home's store {world.source_store} yet "
                "(its job stages them at home as it runs)")
    seconds = stage_s(world, target_store, predict)
    eta = "time unknown (the link's rate is not measured yet)" if seconds is None \
        else f"~{seconds:.0f} s"
    return f"staging the world to {target}: {missing / 1e6:.0f} MB left, {eta}"
