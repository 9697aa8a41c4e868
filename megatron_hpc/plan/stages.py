"""Which transformer layers each pipeline stage holds, and the bubble of a schedule. Pure arithmetic.

Megatron's layout: with p pipeline ranks and v model chunks per rank there are p * v virtual stages; virtual
stage s runs on pipeline rank s % p as that rank's chunk s // p (so rank 0 holds stages 0, p, 2p, ...), and the
layers are split into contiguous blocks in stage order. The first stage also holds the embedding, the last the
final norm, the output layer and the loss. Uneven first/last stages follow Megatron's
--decoder-first/last-pipeline-num-layers: those stages take the given counts and the others split the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.errors import PlanError
from megatron_hpc.plan.fixes import Fix, FixablePlanError, set_fix, sizes_choice


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One virtual stage: where it runs and what it holds."""

    index: int
    """Virtual stage index, 0 .. p * v - 1, in the order activations flow."""
    pp_rank: int
    chunk: int
    """Which of its pipeline rank's model chunks this stage is."""
    layers: range
    """Global indices of its transformer layers."""
    first: bool
    """Holds the embedding (takes token ids)."""
    last: bool
    """Holds the final norm, the output layer and the loss."""


def split_layers(num_layers: int, *, pipeline: int, virtual: int = 1, first_stage_layers: int = 0,
                 last_stage_layers: int = 0) -> list[range]:
    """Layer ranges of the p * v virtual stages, in stage order; PlanError with the fix when they do not divide."""
    stages = pipeline * virtual
    if pipeline < 1 or virtual < 1:
        raise PlanError(f"parallel.pipeline={pipeline}, parallel.virtual_pipeline={virtual}: both must be at least 1")
    if virtual > 1 and pipeline == 1:
        what = (f"parallel.virtual_pipeline={virtual} needs parallel.pipeline of 2 or more (virtual stages "
                "interleave the chunks of several pipeline ranks)")
        raise FixablePlanError(lambda kept: what + ("; use --set parallel.virtual_pipeline=1" if kept else ""),
                          [set_fix("parallel.virtual_pipeline", 1)])
    uneven = first_stage_layers > 0 or last_stage_layers > 0
    if uneven and virtual > 1:
        raise PlanError("parallel.pipeline_first_stage_layers / pipeline_last_stage_layers are for the plain 1F1B "
                        "schedule; with parallel.virtual_pipeline > 1 the layers split evenly (set them to 0)")
    if uneven and pipeline == 1:
        raise PlanError("parallel.pipeline_first_stage_layers / pipeline_last_stage_layers need "
                        "parallel.pipeline of 2 or more; set them to 0")
    if not uneven and num_layers % stages:
        raise _uneven(num_layers, pipeline=pipeline, virtual=virtual)
    counts = _counts(num_layers, stages=stages, first=first_stage_layers, last=last_stage_layers)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _counts(num_layers: int, *, stages: int, first: int, last: int) -> list[int]:
    if first == 0 and last == 0:
        return [num_layers // stages] * stages
    fixed = [n for n in (first, last) if n > 0]
    middle = stages - len(fixed)
    rest = num_layers - sum(fixed)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest <= 0 or rest % middle)):
        raise PlanError(f"model.num_layers={num_layers} with {first or 'an even share of'} layer(s) on the first "
                        f"stage and {last or 'an even share of'} on the last leaves {rest} for the other "
                        f"{middle} stage(s), which must split evenly and not be empty; change "
                        "parallel.pipeline_first_stage_layers / pipeline_last_stage_layers")
    each = rest // middle if middle else 0
    counts = [each] * stages
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    return counts


def _uneven(num_layers: int, *, pipeline: int, virtual: int) -> FixablePlanError:
    """The layers do not split into pipeline x virtual equal stages: the sizes of either that split them."""

    def wording(kept: list[Fix]) -> str:
        sizes = [text for text in (sizes_choice("parallel.pipeline", kept),
                                   sizes_choice("parallel.virtual_pipeline", kept)) if text]
        use = f"; use {', or '.join(sizes)}" if sizes else ""
        if virtual == 1:  # uneven first and last stages are for the plain schedule only
            use += f"{', or' if sizes else ';'} set parallel.pipeline_first_stage_layers / pipeline_last_stage_layers"
        return (f"model.num_layers={num_layers} does not split evenly into {pipeline * virtual} pipeline stage(s) "
                f"(parallel.pipeline x parallel.virtual_pipeline){use}")

    def candidates() -> list[Fix]:
        pipelines = [p for p in range(2 if virtual > 1 else 1, num_layers // virtual + 1)
                     if num_layers % (p * virtual) == 0]
        virtuals = [v for v in range(1, num_layers // pipeline + 1)
                    if num_layers % (pipeline * v) == 0 and v != virtual]
        return [*(set_fix("parallel.pipeline", p) for p in [*pipelines, 0]),
                *(set_fix("parallel.virtual_pipeline", v) for v in virtuals)]

    return FixablePlanError(wording, candidates)


def stage_layouts(num_layers: int, *, pipeline: int, virtual: int = 1, first_stage_layers: int = 0,
                  last_stage_layers: int = 0) -> list[StageLayout]:
    """Every virtual stage of the pipeline, in stage order."""
    ranges = split_layers(num_layers, pipeline=pipeline, virtual=virtual, first_stage_layers=first_stage_layers,
                          last_stage_layers=last_stage_layers)
    return stage_layouts_of(ranges, pipeline=pipeline)


def stage_layouts_of(ranges: list[range], *, pipeline: int) -> list[StageLayout]:
    """The virtual stages of a layer split already made (a plan's stage_layers), in stage order."""
    last = len(ranges) - 1
    return [StageLayout(index=s, pp_rank=s % pipeline, chunk=s // pipeline, layers=layers, first=s == 0,
                        last=s == last) for s, layers in enumerate(ranges)]


def rank_stages(layouts: list[StageLayout], pp_rank: int) -> list[StageLayout]:
    """The stages pipeline rank `pp_rank` runs, chunk 0 first."""
    return [s for s in layouts if s.pp_rank == pp_rank]


def bubble_fraction(*, pipeline: int, micro_batches: int, virtual: int = 1) -> float:
    """Idle share of a 1F1B step: (p - 1) / (m + p - 1), divided by v when interleaved (Narayanan et al. 2021).

    The paper's bubble time over ideal time is (p - 1) / m; as a share of the whole step (ideal plus bubble)
    that is (p - 1) / (m + p - 1). 0 without pipelining.
    """
    if pipeline <= 1:
        return 0.0
    return (pipeline - 1) / (micro_batches + pipeline - 1) / virtual
