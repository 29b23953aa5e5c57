"""Pipeline parallelism over point-to-point transfers: schedules as data (schedules.py), a
pre-flight deadlock check (validate.py), tensor-list transfers (p2p.py), stage splitting (stage.py)
and the schedules that run them (runtime.py)."""
from commrt.pipeline.schedules import (Action, format_grid, gpipe_actions, interleaved_actions,
    one_f_one_b_actions, pipedream_actions)
from commrt.pipeline.validate import ScheduleError, validate

__all__ = ["Action", "format_grid", "gpipe_actions", "one_f_one_b_actions", "interleaved_actions",
           "pipedream_actions", "ScheduleError", "validate"]
from commrt.pipeline.p2p import P2POp, batch_isend_irecv, isend_tensors, recv_tensors
from commrt.pipeline.pipedream import PipeDream
from commrt.pipeline.notices import StageFailed
from commrt.pipeline.runtime import GPipe, Interleaved1F1B, OneFOneB, PipelineSchedule
from commrt.pipeline.stage import PipelineStage, split

__all__ += ["P2POp", "batch_isend_irecv", "isend_tensors", "recv_tensors", "PipeDream", "GPipe",
            "Interleaved1F1B", "OneFOneB", "PipelineSchedule", "PipelineStage", "StageFailed", "split"]
