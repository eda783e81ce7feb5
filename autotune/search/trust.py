"""Where the calibrated memory model may veto, and by how much it must be over capacity to do so.

The planner (:mod:`autotune.search.planner`) skips a candidate the calibrated model puts clearly over
capacity. This mixin says when that word counts: once measured peaks anchor the model for this
trainer, only at settings of the knobs it cannot read where a measured peak bounds the candidate
below (issue 19 item 3), and with a margin that grows where the model extrapolates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.candidate import constraints
from autotune.candidate.defaults import knob

if TYPE_CHECKING:
    from autotune.candidate.memo import Memo
    from autotune.recipe import Recipe
    from autotune.search.knobs import KnobMemory

EXTRAPOLATED = 2  # a micro-batch more than this many times every calibrating peak's is extrapolated


class ModelTrust:
    """When the calibrated memory model may veto (mixed into :class:`Planner`)."""

    recipe: Recipe
    seen: list[Any]  # the planner's Seen records (it imports this module)
    knobs: KnobMemory
    margin: float
    unexplored_margin: float
    rel_error: float
    _memo: Memo

    @property
    def model_trusted(self) -> bool:
        """Whether the memory model may veto: once a measured peak anchors it for a trainer it
        describes (autotune's TRL worker, ms-swift, the simulator); for a trainer it does not know
        (a --command template, which may keep four models or quantize) only once several of that
        trainer's own peaks have calibrated it and it predicts them well."""
        peaks = [s for s in self.seen if s.status == "ok" and s.peak_gib]
        if self.recipe.runner != "command":
            return bool(peaks)
        return len(peaks) >= 3 and self.rel_error <= 0.15

    def reads(self, params: dict[str, Any]) -> bool:
        """Whether the calibrated model may judge ``params`` (:meth:`KnobMemory.calibrated_for`)."""
        return self.knobs.calibrated_for(params, self._calibrated_at())

    def _calibrated_at(self) -> dict[tuple[tuple[str, str], ...], dict[str, Any]]:
        """The settings of the knobs the model cannot read that measured peaks calibrated it at,
        each with one such trial's knobs (asked by every verdict, so once per trial learned)."""
        compute = lambda: {  # noqa: E731
            self.knobs.model_blind(s.params): s.params for s in self.seen if s.status == "ok" and s.peak_gib
        }
        return self._memo.get("calibrated_at", (self.knobs, self.seen), {"n": len(self.seen)}, compute)

    def veto_margin(self, params: dict[str, Any]) -> float:
        """How far over capacity the model must put ``params`` to veto it: twice its measured
        error, and :attr:`unexplored_margin` where it extrapolates. To a ZeRO stage / offload mode no
        success has used, its model-state term was never measured. To a micro-batch more than
        :data:`EXTRAPOLATED` times every calibrating peak's, a part of the peak the model cannot
        represent (a trainer's own knob) has landed in the activations' weight: calibrated at
        micro-batch 1, it put micro-batch 16 at 98 GiB against 60-66 in truth (a review's case)."""
        margin = max(self.margin, 2 * self.rel_error)
        regime = (params.get("zero_stage"), params.get("offload"))
        if not any(
            s.status == "ok" and (s.params.get("zero_stage"), s.params.get("offload")) == regime
            for s in self.seen
        ):
            return max(margin, self.unexplored_margin)
        if self._micro(params) > EXTRAPOLATED * self._calibrated_micro():
            return max(margin, self.unexplored_margin)
        return margin

    def _micro(self, params: dict[str, Any]) -> int:
        """The micro-batch as the model reads it (TRL's default where the space names none)."""
        return int(knob(constraints.as_trl(params, self.recipe), "per_device_train_batch_size") or 1)

    def _calibrated_micro(self) -> int:
        """The largest micro-batch a measured peak calibrated the model at (0 before any)."""
        compute = lambda: max(  # noqa: E731
            (self._micro(s.params) for s in self.seen if s.status == "ok" and s.peak_gib), default=0
        )
        return self._memo.get("calibrated_micro", (self.recipe, self.seen), {"n": len(self.seen)}, compute)
