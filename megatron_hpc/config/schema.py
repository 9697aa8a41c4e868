"""The typed, frozen configuration tree a recipe loads into.

Each section is a frozen dataclass; a function takes the section it needs, never the whole
tree. Derived values (data-parallel size, micro-batch count, padded vocabulary) are computed by
`megatron_hpc.plan` and never written back here. The docstring under each field is what
`megatron-hpc plan --help` users read; names follow Megatron's flags where one exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16"]
DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
PositionEmbedding = Literal["learned", "rope"]
Activation = Literal["gelu", "gelu_tanh"]
Normalization = Literal["layernorm", "rmsnorm"]
RopeScaling = Literal["none", "llama3"]
DataSource = Literal["synthetic", "indexed"]
CheckpointFormat = Literal["xser", "torch"]
SaveFailure = Literal["stop", "continue"]
RecomputeGranularity = Literal["selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
CompileBackend = Literal["inductor", "aot_eager", "eager"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    num_layers: int
    """Transformer layers (Megatron --num-layers)."""
    hidden_size: int
    """Model width h (--hidden-size)."""
    num_attention_heads: int
    """Attention heads; must be divisible by the tensor-parallel size."""
    seq_length: int
    """Tokens per sample (--seq-length)."""
    max_position_embeddings: int
    """Learned position table size; seq_length may not exceed it."""
    vocab_size: int = 50257
    """True tokenizer vocabulary (GPT-2 BPE: 50257); padded by the planner."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 * hidden_size, as in GPT-3."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times TP (Megatron's rule)."""
    position_embedding: PositionEmbedding = "learned"
    """learned (GPT-3) or rope (rotary)."""
    rotary_percent: float = 1.0
    """Fraction of each head rotated when position_embedding is rope (Pythia: 0.25): the first
    int(head_dim * rotary_percent) dims, in GPT-NeoX's rotate_half layout (model/rotary.py)."""
    rotary_base: float = 10000.0
    """Rotary frequency base theta (Megatron --rotary-base, NeoX rotary_emb_base; 10000 in GPT-NeoX and Pythia)."""
    parallel_residual: bool = False
    """GPT-NeoX's use_parallel_residual (GPT-J's layout): x + attn(ln_1(x)) + mlp(ln_2(x)), both branches reading
    the block's input through their own LayerNorm. False is GPT's sequential block, mlp(ln_2(x + attn(ln_1(x))))."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 * num_layers)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (0 in the Neuron reference)."""
    hidden_dropout: float = 0.0
    """Dropout on residual branches (0 in the Neuron reference)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm or RMSNorm (Megatron --norm-epsilon; Llama 1e-5, Qwen2.5 1e-6)."""
    normalization: Normalization = "layernorm"
    """layernorm (GPT, NeoX: weight and bias) or rmsnorm (Llama, Qwen: x / rms(x) * weight, no bias; Megatron
    --normalization RMSNorm)."""
    swiglu: bool = False
    """The gated MLP of Llama and Qwen (Megatron --swiglu): proj(silu(x W_gate) * (x W_up)), replacing the GeLU of
    `activation`. The gate and up projections are two column-parallel weights (mlp.gate, mlp.fc), so a TP rank
    always holds the same rows of both; Megatron's fused linear_fc1, [gate_r; up_r] on TP rank r, is split and
    joined by that rule at import and export."""
    num_query_groups: int | None = None
    """Grouped-query attention (Megatron --group-query-attention --num-query-groups): the heads share this many
    key/value heads (1 is multi-query attention). Unset means one per head (multi-head attention). Must divide
    num_attention_heads; TP must divide it. The QKV rows are in Megatron's grouped layout [G, (nh/G queries, key,
    value), hd], so a row block holds whole groups."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linears (False is Megatron --disable-bias-linear: Llama, Qwen)."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with add_bias_linear false (Megatron --add-qkv-bias: Qwen2)."""
    rope_scaling: RopeScaling = "none"
    """Llama 3.1's RoPE frequency scaling (Megatron --use-rope-scaling; Hugging Face rope_type "llama3"): the
    inverse frequencies below original context / low_freq_factor wavelengths are divided by the factor, those
    above original context / high_freq_factor are kept, and the ones between are interpolated."""
    rope_scaling_factor: float = 8.0
    """Llama 3.1's scaling factor (Megatron --rope-scaling-factor)."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1's low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1's high_freq_factor."""
    rope_original_max_position: int = 8192
    """Llama 3.1's original_max_position_embeddings: the context the base model was trained at."""
    activation: Activation = "gelu"
    """The MLP's GeLU: gelu is the exact (erf) one, as Megatron's; gelu_tanh is the tanh approximation that GPT-2
    was trained with (Hugging Face's gelu_new), for imported GPT-2 weights."""
    recompute: bool = False
    """Alias of recompute_granularity=full with recompute_method=uniform and recompute_num_layers=1 (every layer
    checkpointed on its own); contradicting recompute_granularity=selective is an error."""
    recompute_granularity: RecomputeGranularity | None = None
    """Activation recomputation (Megatron --recompute-granularity): null keeps every activation; selective
    recomputes only the attention core softmax(QK^T)V (Megatron's recommendation); full recomputes whole layers,
    grouped by recompute_method (plan/recompute.py)."""
    recompute_method: RecomputeMethod | None = None
    """With full granularity (--recompute-method): uniform checkpoints each group of recompute_num_layers layers as
    a unit; block checkpoints the first recompute_num_layers layers of each pipeline stage and runs the rest
    normally. Unset means uniform."""
    recompute_num_layers: int | None = None
    """Layers per uniform group, or checkpointed layers per stage for block (--recompute-num-layers); unset means
    1. Uniform needs it to divide every stage's layers; block needs at most a stage's layers."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads: num_query_groups, or one per attention head."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size; must divide workers per node, heads and FFN size. 0 lets the planner choose it (TP
    inside a node: the smallest that fits, up to 8 before pipelining; plan/sizing.py)."""
    pipeline: int = 1
    """Pipeline-parallel size (Megatron --pipeline-model-parallel-size): stages across nodes, rank layout tp
    fastest, then dp, then pp. 0 lets the planner choose it from the node count and the memory estimate."""
    virtual_pipeline: int = 1
    """Model chunks per pipeline rank (Megatron --num-virtual-stages-per-pipeline-rank); above 1 runs the
    interleaved 1F1B schedule, whose bubble is 1/virtual_pipeline of plain 1F1B's."""
    pipeline_schedule: str = "1f1b"
    """1f1b (PipeDream-flush; interleaved when virtual_pipeline > 1) or afab (all forward, then all backward:
    GPipe, for debugging; more activation memory)."""
    pipeline_first_stage_layers: int = 0
    """Transformer layers on the first stage (Megatron --decoder-first-pipeline-num-layers); 0 splits evenly.
    The embedding lives there too, so a smaller first stage balances it."""
    pipeline_last_stage_layers: int = 0
    """Transformer layers on the last stage (Megatron --decoder-last-pipeline-num-layers); 0 splits evenly.
    The output layer and loss live there."""
    sequence_parallel: bool = False
    """Megatron --sequence-parallel (Korthikanti et al. 2022): with TP above 1, LayerNorm and dropout hold
    (B, S/tp, H) sequence shards; the TP all-reduces become all-gather / reduce-scatter pairs along the sequence,
    and replicated parameters' gradients are all-reduced over TP after backward. Needs parallel.tensor above 1."""
    distributed_optimizer: bool = False
    """Megatron --use-distributed-optimizer (ZeRO-1): each data-parallel rank keeps Adam's moments for 1/DP of
    the parameters; gradients are reduce-scattered and the updated weights all-gathered
    (train/distributed_optimizer.py). Checkpoints keep the plain layout, so they load at any DP size. On XLA it is
    torch_xla's ZeroRedundancyOptimizer with fp32 master weights, and bf16 runs keep bf16 weights instead of pure
    bf16 (train/xla_zero.py)."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's data-parallel all-reduce during the last micro-batch's backward
    (Megatron --overlap-grad-reduce); ignored on XLA and when data-parallel size is 1."""
    overlap_param_gather: bool = False
    """Megatron --overlap-param-gather: after the distributed optimizer's step, each bucket's all-gather of the
    updated weights starts asynchronously, and the next forward waits for a bucket just before the first layer
    that uses one of its parameters (saves, evaluation and the run's end wait for all of them first). Needs
    parallel.distributed_optimizer; refused under pipelining; ignored with a warning on XLA, whose ZeRO-1
    gathers inside the step's graph. Under train.compile the gathers are waited before the forward instead."""
    grad_bucket_mb: float = 128.0
    """Size of a data-parallel gradient all-reduce bucket in MiB of fp32 (128: 32M elements; Megatron's
    --ddp-bucket-size counts elements). Smaller buckets start sooner in backward, larger ones make fewer calls."""
    choose_layout: Literal["fits", "fastest"] = "fastest"
    """How the planner picks the TP x PP it is left to choose (sizes of 0): "fits", the first that fits in memory in
    the order of Narayanan et al. 2021's table (the smallest pipeline, then the smallest TP); "fastest", the
    fastest predicted by the step-time model among all that fit (plan/layout_choice.py). `plan` shows both."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_steps: int
    """Optimizer steps of the run phase (Megatron --train-iters)."""
    micro_batch_size: int
    """Samples per worker per forward pass."""
    global_batch_size: int
    """Samples per optimizer step across all data-parallel ranks."""
    seed: int = 1234
    """Seed of the weights and of the data order."""
    precision: Precision = "fp32"
    """fp32; bf16 (autocast on CUDA/CPU, pure bf16 with stochastic rounding on XLA); fp16."""
    log_interval: int = 1
    """Print Megatron's iteration line every this many steps."""
    compile: bool = False
    """Wrap the model with torch.compile (not on XLA)."""
    compile_backend: CompileBackend = "inductor"
    """torch.compile's backend: inductor generates kernels (and fills the compile cache); aot_eager and eager only
    trace, to tell a compiler bug from a model bug, or to try the compile phase's plumbing in seconds."""
    max_skipped_steps: int = 5
    """Stop with an error after this many steps in a row whose loss or gradients were not finite."""
    eval_interval: int = 0
    """Run validation every this many steps (and at the end); 0 disables it."""
    eval_iters: int = 10
    """Validation batches per evaluation (Megatron --eval-iters)."""
    eval_test: bool = True
    """After the last step, evaluate eval_iters global batches of the test split (Megatron's do_test); only when
    data.split gives the test split weight (indexed data; synthetic tokens have no test split)."""
    tensorboard: bool = True
    """Write TensorBoard event files to <run folder>/tensorboard from the last rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    lr: float
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay; biases and norms get none."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global L2 gradient-norm clip; 0 disables."""
    lr_decay_style: DecayStyle = "cosine"
    """Decay after warmup."""
    lr_warmup_iters: int = 0
    """Linear warmup length in steps; use this or lr_warmup_fraction."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of lr_decay_iters (Megatron --lr-warmup-fraction)."""
    lr_decay_iters: int | None = None
    """Steps over which the LR decays; None means train.num_steps."""
    lr_warmup_samples: int = 0
    """Warmup in samples (Megatron --lr-warmup-samples); setting it or lr_decay_samples counts the
    schedule in samples. Use instead of lr_warmup_iters."""
    lr_decay_samples: int | None = None
    """Samples over which the LR decays (Megatron --lr-decay-samples); None with lr_warmup_samples
    means train.num_steps * global_batch_size. Use instead of lr_decay_iters."""
    lr_wsd_decay_fraction: float = 0.1
    """WSD: fraction of lr_decay_iters spent in the final decay (Megatron --lr-wsd-decay-iters / decay iters)."""
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """WSD: shape of the final decay (Megatron --lr-wsd-decay-style; its default is exponential)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: DataSource | None = None
    """indexed (.bin/.idx at data.path) or synthetic (deterministic generated tokens, like Megatron --mock-data).
    Unset means indexed when data.path is set; without a path, synthetic on the cpu platform and refused on the
    others (a real cluster must not spend its hours on made-up tokens unless you ask: data.source=synthetic)."""
    path: str | None = None
    """Megatron --data-path: one prefix (no .bin/.idx), or a blend "0.3 prefixA 0.7 prefixB"; ~ expands."""
    split: str = "969,30,1"
    """Megatron --split: train,valid,test weights over contiguous document ranges."""
    cache_path: str | None = None
    """Megatron --data-cache-path for the index .npy files; None means <prefix>/cache/GPTDataset_indices."""
    tokenizer_type: str = "GPT2BPETokenizer"
    """Tokenizer that made the data (Megatron --tokenizer-type: GPT2BPETokenizer, HuggingFaceTokenizer,
    SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer); with its files, submit and the trainer
    refuse a model.vocab_size smaller than its vocabulary."""
    vocab_file: str | None = None
    """GPT-2 vocab.json of the tokenizer."""
    merge_file: str | None = None
    """GPT-2 merges.txt of the tokenizer."""
    tokenizer_model: str | None = None
    """Megatron --tokenizer-model: a Hugging Face tokenizer folder (or its tokenizer.json), or a SentencePiece
    .model; ~ expands."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    save: str | None = None
    """Checkpoint folder (Megatron layout); None means <run folder>/checkpoints."""
    load: str | None = None
    """Folder to start from; None means the save folder (a requeued job resumes by itself). When it differs from the
    save folder, it is read only until this run has saved a checkpoint of its own: a restart resumes from that."""
    finetune: bool = False
    """Megatron's --finetune: take only the weights of the checkpoint in `load` and start at iteration 0, with a fresh
    optimizer, LR schedule, data position and RNG (a restart after this run's first save resumes from that save)."""
    load_optim: bool = True
    """False is Megatron's --no-load-optim: Adam's moments and fp16's loss scale start afresh; the iteration, LR
    position and consumed samples still come from the checkpoint in `load`."""
    load_rng: bool = True
    """False is Megatron's --no-load-rng: the random generators keep their train.seed seeding instead of the states
    saved in the checkpoint in `load`."""
    save_interval: int = 0
    """Save every this many steps; 0 saves only at the end, on a signal or on the time budget."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a newer one is complete."""
    format: CheckpointFormat = "xser"
    """xser (torch_xla's one-file-per-tensor layout) or torch (one torch.save file per TP rank)."""
    io_workers_per_node: int = 4
    """At most this many ranks per node read or write checkpoint files at once (bounds host memory)."""
    on_save_failure: SaveFailure = "stop"
    """When a save fails (a full disk): stop with an error, or log it and keep training."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training goes on (Megatron's --async-save): the state
    is copied to host memory before the next optimizer step, and the next save, a stop or the end of the run
    completes the checkpoint (tracker last)."""
    time_budget_min: float = 0.0
    """Save and exit cleanly after this many minutes of training; 0 means no budget."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompilePhaseConfig:
    enabled: bool = True
    """Run a compile phase before the run phase (afterok)."""
    num_steps: int = 5
    """Steps of the trial run (the Neuron reference uses 325 for 6.7B)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    platform: str = "cpu"
    """Default platform (trn1, trn2, p5, cpu); --platform overrides it."""
    workers_per_node: int | None = None
    """Processes per node; None takes the platform's count (one per device). On cpu any count; elsewhere at most
    the platform's (fewer uses a slice of each node)."""
    nofile_limit: int = 65535
    """ulimit -n raised on every node before torchrun."""
    time_limit_min: int = 60
    """SLURM time limit of the run phase, minutes (a cluster profile's time_limit_min.run and --time win)."""
    compile_time_limit_min: int = 120
    """SLURM time limit of the compile phase, minutes: the short trial plus compiling its graphs (a cluster
    profile's time_limit_min.compile and --time win)."""
    exclusive: bool = True
    """Ask SLURM for whole nodes."""
    init_timeout_s: int = 900
    """How long torchrun's node agents wait for every node to join (its rendezvous timeout)."""
    collective_timeout_s: int = 1800
    """How long one collective may block before the ranks fail (and the job requeues) instead of
    hanging: the process-group timeout. Long enough for the slowest checkpoint save between steps."""
    spare_nodes: int = 0
    """Hot spares (issue 28): SLURM allocates the run phase --nodes + spare_nodes with --no-kill and runs the
    workers as a step on --nodes healthy ones; when the step fails, a new step starts in the same job on healthy
    nodes (the failed ones excluded, spares filling in). The spares idle until then; the plan is unchanged."""
    max_in_job_restarts: int = 3
    """How many new steps one job starts after failed ones before falling back to requeueing the job."""
    hang_timeout_s: float | None = None
    """No rank's heartbeat moving for this long tears the step down (stacks first) and restarts it; None derives it
    from the measured step time, with a floor, once the first steps are done."""
    straggler_threshold: float = 1.2
    """A node whose compute time per step stays above this multiple of the median node's is named a straggler."""
    exclude_stragglers: bool = False
    """Replace the nodes named as stragglers with spares at the next in-job restart."""
    warm_restart: bool = True
    """With spare_nodes > 0 on CPU or CUDA: one warm process per node of the allocation (torch and the trainer
    imported once) forks each in-job step's workers, so a restart does not start Python and import torch again.
    Off for XLA platforms (torch_xla must not be imported before a fork) and without spares; false uses torchrun."""


@dataclass(frozen=True, kw_only=True, slots=True)
class K8sConfig:
    """Where and how `submit --cluster k8s` runs the plan: Kubeflow PyTorchJobs (launch/k8s_objects.py)."""

    namespace: str = "default"
    """Kubernetes namespace of the PyTorchJobs, Jobs and ConfigMap."""
    image: str | None = None
    """Container image with megatron-hpc and its runtime (CUDA/NCCL or the Neuron SDK) installed; required."""
    instance_type: str | None = None
    """Instance type the pods run on (p5, p5e, p5en, p6-b200, trn1, trn2: config/instance_types.py); unset means
    the one named like the platform."""
    volume_claim: str | None = None
    """PersistentVolumeClaim every pod mounts (an FSx for Lustre claim, say) for data, checkpoints, the run folder
    and the shared compile cache; required."""
    mount_path: str = "/fsx"
    """Where the claim is mounted in every pod; the run folders live under <mount_path>/runs."""
    shm_gib: int = 64
    """Size of the memory-backed /dev/shm of each pod (data loader workers and NCCL use it)."""
    bin_dir: str = "/usr/local/bin"
    """Folder of the image's python and megatron-hpc (the node script puts it first on PATH)."""
    preprocess_input: str | None = None
    """A corpus.jsonl on the claim: adds a preprocessing Job (`megatron-hpc data preprocess`) writing data.path."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str
    """Recipe name; names the run folder."""
    warning: str | None = None
    """A caveat about the recipe that `plan` and `submit` print as a warning (a stand-in architecture, say)."""
    model: ModelConfig
    train: TrainConfig
    optim: OptimConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompilePhaseConfig = field(default_factory=CompilePhaseConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)
