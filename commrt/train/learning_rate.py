"""The engine's learning rate (``Engine.get_lr`` / ``set_lr``, the ``scheduler`` section), as part
of ``engine.Engine``. The rate lives in ``Zero.spec`` (an ``OptimSpec``, replaced between steps,
never mutated), which every stage and layout reads in its step; ``zero_defer`` keeps the spec of
the step that made a unit's step due. Every rank must run each step at the same rate: the step's
gradient check all-reduces the ranks' rates (``Engine._check_gradients``)."""
from __future__ import annotations

import dataclasses

from commrt.optim.schedules import lr_at
from commrt.runtime.errors import ConfigError


class LearningRate:
    """Mixed into ``Engine``: reads ``cfg``, ``global_steps`` and ``zero.spec``."""

    def get_lr(self) -> list[float]:
        """The learning rate the next step runs at, per parameter group (the engine has one), as
        DeepSpeed's ``engine.get_lr()``."""
        return [self.zero.spec.lr]

    def set_lr(self, lr: float) -> None:
        """Run the next steps at ``lr`` (a torch scheduler's or the caller's own schedule: call it
        before ``step()``). Every rank must set the same value before the same step: the step's
        gradient check all-reduces every rank's rate and raises ConfigError on all of them if any
        differs. Saved in checkpoints. Refused with a ``scheduler`` config, which sets each step's."""
        if self.cfg.scheduler is not None:
            raise ConfigError(f"set_lr with the {self.cfg.scheduler.type} scheduler of the config, which sets the "
                              "learning rate of every step; drop the scheduler section to set it yourself")
        self.zero.spec = dataclasses.replace(self.zero.spec, lr=lr)  # OptimSpec checks it: a ConfigError

    def _schedule_lr(self) -> None:
        """The configured schedule's rate for the step after ``global_steps`` taken ones (the same
        on every rank: the step count is)."""
        s = self.cfg.scheduler
        if s is not None:
            self.zero.spec = dataclasses.replace(self.zero.spec, lr=lr_at(s, self.global_steps, self.cfg.optimizer.lr))

    def resume_lr(self, saved: float | None) -> None:
        """After a load: the schedule's rate at the loaded step count, or without one the rate the
        checkpoint was saved with (a ``set_lr`` value; None in files from before it was saved)."""
        if self.cfg.scheduler is not None:
            self._schedule_lr()
        elif saved is not None:
            self.zero.spec = dataclasses.replace(self.zero.spec, lr=saved)
