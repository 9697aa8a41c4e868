"""What share of the hardware's datasheet figures a training step achieves: the step-time model's calibration. Pure.

plan/steptime.py multiplies these into the platform's figures (config/hardware.py). They are the only numbers of
the model that are not datasheet facts or counts, so they are kept in one dataclass that a measured calibration
(`megatron-hpc tune`, a later part of issue 29) replaces; `plan` names which one it used.

The built-in defaults are round numbers set before the model was compared with any published run, from what is
common knowledge about the kernels and libraries, not fitted to benchmarks/RESULTS.md's figures:
- GEMMs: cuBLAS-class kernels reach about 85% of dense peak on large bf16 matrices; a GEMM whose ideal time at
  peak is short loses a fixed ~10 us to launch, wave quantization and its tail (the half-efficiency point);
- collectives reach about 80% of the link's nominal bandwidth as ring bus bandwidth (nccl-tests' busbw against the
  datasheet's NVLink and NIC figures);
- memory-bound kernels (norms, activations, dropout, softmax, Adam) stream at about 70% of the HBM bandwidth and
  move each activation byte they save about twice (written, then read) in the forward, twice that in the backward;
- the trainer overlaps no TP or pipeline communication with compute (it does overlap the DP gradient reduce,
  parallel.overlap_grad_reduce, which the model accounts for by its own rule);
- every operator a rank dispatches outside the GEMMs costs a fixed time whatever its size (OP_OVERHEAD_S, by
  backend; plan/op_counts.py counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SOURCE = "built-in defaults (no measurement)"

OP_OVERHEAD_S = {"gloo": 15e-6, "nccl": 1e-6, "xla": 0.0}
"""Fixed cost of one dispatched operator, by the backend the platform trains with (the per-operator term of
plan/steptime.py), before op_overhead_factor:
- CPU (gloo): eager dispatch, autograd bookkeeping and an allocation per operator, with no device to overlap them:
  on this project's 2-core CI machine one of our layers at tiny's shape, forward and backward at micro-batch 4 and
  2, took 54.9 and 28.2 ms (single thread), 1.5 ms over proportional for its 105 operators: ~14 us each; rounded up.
  tune's operator chain (train/tune_trials.py) measures 6-15 us per operator there, by load.
- CUDA (nccl): the host enqueues ahead of the device, so what a step sees is the device's gap between two dependent
  kernels (launch latency, ramp-up and tail), a few microseconds per kernel; but about two in three of the operators
  counted are views, transposes and detaches that launch no kernel, so 1 us per operator counted (3 us per kernel).
  3 us per operator moved the H100 70B row of benchmarks/steptime_published.py from -18% to -21%, past the issue's
  20%: Megatron-LM fuses its element-wise kernels (bias-GeLU, softmax, LayerNorm), which ours do not count apart.
- XLA: the step is traced into one compiled graph (shared/reference/neuron-xla.md), so operators are fused and no
  per-operator dispatch remains at run time: 0 (the GEMMs keep their own fixed cost)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    source: str = DEFAULT_SOURCE
    """What `plan` prints as the calibration: the built-in defaults, or where and when it was measured."""
    gemm_peak_fraction: float = 0.85
    """Share of dense peak a large GEMM achieves."""
    gemm_overhead_s: float = 10e-6
    """Ideal time at peak at which a GEMM reaches half of gemm_peak_fraction: its fixed cost."""
    collective_bandwidth_fraction: float = 0.8
    """Achieved ring bus bandwidth of a collective or send/receive over the link's nominal bandwidth."""
    collective_latency_factor: float = 1.0
    """Achieved over the platform's startup cost of a message or ring step (a collective library's software
    overhead; 1.0 takes the datasheet's latency)."""
    memory_bandwidth_fraction: float = 0.7
    """Achieved over nominal device memory bandwidth of memory-bound kernels."""
    elementwise_bytes_per_saved_byte: float = 2.0
    """Memory traffic of the forward's memory-bound kernels per activation byte a layer saves (the backward moves
    twice that)."""
    optimizer_bytes_per_parameter: float = 36.0
    """Memory traffic of one Adam step per parameter a rank updates: fp32 weight, grad and two moments read, weight
    and moments written, the 16-bit copy written, the grad zeroed."""
    op_overhead_factor: float = 1.0
    """Achieved over OP_OVERHEAD_S of the fixed cost of one operator outside the GEMMs (a measured calibration's
    dispatch scale; 1.0 takes the backend's built-in figure)."""
    tp_comm_overlap: float = 0.0
    """Share of TP collectives hidden behind compute."""
    pp_comm_overlap: float = 0.0
    """Share of pipeline sends and receives hidden behind compute."""
    attention_scores_in_memory: bool | None = None
    """Whether the attention kernels write the s x s scores to device memory (and read them back): None as the
    trainer's kernels do on the backend (not on CUDA, where scaled_dot_product_attention runs a flash kernel; yes
    on XLA's math path); True for a stack without flash attention, such as Megatron-LM in 2021."""

    def gemm_fraction(self, flops: float, peak_flops: float) -> float:
        """Achievable share of peak of one GEMM of `flops` on a device of `peak_flops`: saturates at
        gemm_peak_fraction, half of it where the ideal time equals gemm_overhead_s."""
        ideal = flops / peak_flops
        return self.gemm_peak_fraction * ideal / (ideal + self.gemm_overhead_s)

    def op_overhead_s(self, backend: str) -> float:
        """Fixed cost of one operator outside the GEMMs on `backend` (OP_OVERHEAD_S times op_overhead_factor)."""
        return OP_OVERHEAD_S.get(backend, 0.0) * self.op_overhead_factor


DEFAULT_CALIBRATION = Calibration()
