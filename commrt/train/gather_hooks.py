"""Stage 3's module hooks, as part of ``engine.Engine``: a module's unit gathered before its
forward and its backward and released after its forward, the next units prefetched along the
order the first forward ran them, and the units a forward reads outside its own modules.

Parameters a forward reads outside the forward of the module that owns them
(weight tying by use, ``logits = h @ self.emb.weight.t()`` after ``self.emb`` ran and released its
unit). Found by watching the first forward's torch calls (a ``TorchFunctionMode``, the first
forward only: a Python call per op would cost every step): a parameter passed to a torch
function outside its own module's forward is gathered there and then (if released), and its
unit noted for the innermost running module,
whose later forwards and backwards gather it with their own (``Engine._outside``), as DeepSpeed's
``register_external_parameter`` does by hand.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

from torch import nn
from torch.overrides import TorchFunctionMode

from commrt.train.units import UnitState
from commrt.train.zero_step import drop_prefetches


class FirstForwardReads(TorchFunctionMode):
    """Calls ``found(param)`` for every parameter of ``watched`` (ids) that a torch function gets:
    ``found`` tells a read outside the owner's forward (and gathers it, if released) before the
    function runs. Not only released ones: a module with parameters of its own holds every
    descendant's unit through its first forward, so its read of a child's parameter after the
    child's forward found it gathered, was not noted, and met it released from then on."""

    def __init__(self, watched: dict, found: Callable[[nn.Parameter], None]):
        super().__init__()
        self.watched, self.found = watched, found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__get__", "__set__"):  # p.data: the engine's own gather and release
            return func(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, nn.Parameter) and id(t) in self.watched:
                    self.found(t)
        return func(*args, **kwargs)


class GatherHooks:
    """Mixed into ``Engine``, which holds the ``Zero``, the config, the clock and ``_unit_of``."""

    def _install_gather_hooks(self, model: nn.Module) -> None:
        """Gather before forward and before backward, free after forward; prefetch along the
        order the first forward actually ran the modules in (not their registration order).
        A module's forward may read a descendant's parameters without calling it
        (``nn.MultiheadAttention`` reads ``out_proj.weight``): until its first forward has shown
        which descendants run their own hooks, it gathers every descendant's unit, and from then
        on the ones whose hooks did not run inside it (its ``_outside``), as FSDP2 gathers a
        whole unit. Only the first forward of such a module holds its whole subtree gathered."""
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self._gathers = True
        self._root = id(model)  # the key of the model's own forward in _outside and _running
        self._running: list[int] = []  # keys (a unit's id, or _root) of the forwards running now
        self._pins: dict[int, int] = {}  # unit -> running forwards that gathered it for themselves
        self._reads: dict[int, list[UnitState]] = {}  # key -> units FirstForwardReads found it reading
        self._watched = False  # the first forward ran under reads.FirstForwardReads
        self._outside: dict[int, list[UnitState]] = {self._root: []}  # key -> other units its forward gathers
        self._learning: dict[int, dict[int, int]] = {}  # unit -> descendants' hook counts at its first forward
        self._calls: dict[int, int] = {}  # unit -> times its own forward hook ran
        for m in model.modules():
            mine = [p for p in m.parameters(recurse=False) if id(p) in self._unit_of]
            if not mine:
                continue
            u = self._unit_of[id(mine[0])]
            below = {id(v): v for p in m.parameters() if id(p) in self._unit_of
                     for v in [self._unit_of[id(p)]] if v is not u}
            self._outside[id(u)] = list(below.values())
            self._learning[id(u)] = dict.fromkeys(below, 0) if below else {}
            self._hooks.append(m.register_forward_pre_hook(functools.partial(self._before_forward, u)))
            self._hooks.append(m.register_forward_hook(functools.partial(self._after_forward, u)))
            self._hooks.append(m.register_full_backward_pre_hook(functools.partial(self._before_backward, u)))

    def _gathering_forward(self, args, kwargs):
        """The model's forward with the units it reads outside its modules' own forwards (found
        in the first one, ``FirstForwardReads``) gathered around it, as a module's ``_outside``.
        A forward that raised (a user's module, caught by the loop) lets go of what it gathered
        (``_unwind``); the reads are watched until a forward has run to its end."""
        self._enter(self._root)
        try:
            if self._watched:
                return self.module(*args, **kwargs)
            with FirstForwardReads(self._unit_of, self._read_outside):
                out = self.module(*args, **kwargs)
            self._watched = True
            return out
        except BaseException:
            self._unwind()
            raise
        finally:
            self._leave(self._root, self._outside[self._root])

    def _unwind(self) -> None:
        """After a forward that raised: the modules whose forward never returned (their
        ``_after_forward`` did not run) leave as if it had, innermost first, and the units
        prefetched for the modules after them are waited out and released. Otherwise their
        units and every unit they had gathered for themselves stayed pinned and gathered for
        good (released by no later forward), and a first forward's reads stopped being watched
        before the model's read outside a module was seen. Every rank that raised at the same
        module issued the same gathers, so the prefetches' waits end."""
        units = {id(u): u for u in self.zero.units}
        while self._running and self._running[-1] != self._root:
            key = self._running[-1]
            self._leave(key, list(self._outside[key]))
            if not self._pins.get(key):
                self.zero.release(units[key])
        drop_prefetches(self.zero)

    def _enter(self, key: int) -> None:
        self._running.append(key)
        for v in self._outside[key]:  # pinned first: a gather that raises is unwound as one that ran
            self._pins[id(v)] = self._pins.get(id(v), 0) + 1
            self.zero.gather(v)

    def _leave(self, key: int, gathered: list[UnitState]) -> None:
        """Release the units ``key``'s forward gathered for itself, unless another running
        forward still holds them (their own forward's release waits for it too)."""
        self._running.remove(key)
        for v in gathered:
            self._pins[id(v)] -= 1
            if not self._pins[id(v)]:
                self.zero.release(v)

    def _read_outside(self, p: nn.Parameter) -> None:
        """First forward: ``p`` was read; unless inside its own module's forward (or one its
        module's forward runs), gather its unit for the innermost running forward, now (if
        released) and from now on."""
        v = self._unit_of[id(p)]
        key = self._running[-1] if self._running else self._root
        if id(v) in self._running or any(w is v for w in self._reads.get(key, ())):
            return  # its own forward runs (a parameter of no elements too), or noted already
        with self.clock.span("bookkeeping"):
            self.zero.gather(v)  # nothing to do where a running forward holds it
        self._pins[id(v)] = self._pins.get(id(v), 0) + 1  # until key's forward ends (_leave)
        self._outside[key].append(v)
        self._reads.setdefault(key, []).append(v)

    def _before_forward(self, u: UnitState, *_) -> None:
        with self.clock.span("bookkeeping"):
            self._calls[id(u)] = self._calls.get(id(u), 0) + 1
            learning = self._learning.get(id(u))
            if learning:  # first forward: note the descendants' hook counts before it
                self._learning[id(u)] = {k: self._calls.get(k, 0) for k in learning}
            self._enter(id(u))
            self._use(u, self._next, True)

    def _after_forward(self, u: UnitState, *_) -> None:
        with self.clock.span("bookkeeping"):
            learning = self._learning.pop(id(u), None)
            outside = list(self._outside[id(u)])
            if learning:  # keep the descendants whose own hooks did not run inside this forward
                kept = [v for v in outside if self._calls.get(id(v), 0) == learning.get(id(v))]
                self._outside[id(u)] = kept + [v for v in self._reads.get(id(u), []) if all(v is not w for w in kept)]
            self._leave(id(u), outside)
            if not self._pins.get(id(u)):  # else a running forward reads it after this one
                self.zero.release(u)

    def _before_backward(self, u: UnitState, *_) -> None:
        with self.clock.span("bookkeeping"):
            for v in self._outside[id(u)]:  # released by their gradient's reduction, as u is
                self.zero.gather(v)
            self._use(u, self._prev)

    def _use(self, u: UnitState, ahead: dict, forward: bool = False) -> None:
        if forward and not self._next and all(v is not u for v in self._order):
            self._order.append(u)  # first pass: learn the execution order
        self.zero.gather(u)
        # prefetch the next units in execution order, up to stage3_prefetch_bucket_size elements
        # (at least one unit when prefetch is on), as DeepSpeed's setting means
        budget, nxt = self.cfg.zero.stage3_prefetch_bucket_size, ahead.get(id(u))
        settle_ahead = True  # zero_defer: the next unit steps now, so its gather overlaps this compute
        while nxt is not None and budget > 0:
            if nxt.step_due is not None and settle_ahead:
                self.zero.settle(nxt)  # local work only: every rank still issues the same gathers
                settle_ahead = False
            self.prefetched += nxt.full is None and nxt.gathering is None and nxt.step_due is None
            if not self.zero.start_gather(nxt):
                break  # its step is due first (zero_defer): gathered at its use
            budget -= nxt.layout.padded
            nxt = ahead.get(id(nxt))

    def _learn_order(self) -> None:
        if self.zero.stage == 3 and not self._next and self._order:
            self._next = {id(a): b for a, b in zip(self._order, self._order[1:])}
            self._prev = {id(b): a for a, b in zip(self._order, self._order[1:])}
            self.zero.hold_back(self._order)
