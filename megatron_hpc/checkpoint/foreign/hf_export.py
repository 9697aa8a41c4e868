"""`ckpt convert --to hf`: a checkpoint of ours as a Hugging Face model folder (config.json and the weights, in
save_pretrained's shards: hf_shards.py). The mapping of each architecture is in hf_gpt2.py and its siblings, chosen by
hf_formats.py; the run's tokenizer files that go beside it are found by checkpoint/conversion/tokenizers.py. Offline,
one process, CPU.

The weights come from a checkpoint read whole, or from a stream.Source over a TP 1 x PP 1 one whose weights are read
a unit at a time (a torch_dist source: torch_dist_stream.py; ours or a legacy Megatron one at any TP x PP through
stream.merged); then the export holds the source's read budget plus one unit, one shard of the output, and one
unit's Hugging Face tensors while they are made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.conversion import WholeCheckpoint, model_config, pp_layout, stream
from megatron_hpc.checkpoint.foreign import hf_formats
from megatron_hpc.checkpoint.foreign.hf_shards import SHARD_BYTES, Weights, write_shards


def export_hf(whole: WholeCheckpoint, out: Path, *, eos_token_id: int | None = None,
              token_ids: dict[str, Any] | None = None, source: stream.Source | None = None,
              max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write config.json and the weights (model.safetensors, or pytorch_model.bin without safetensors; shards of
    at most `max_shard_bytes` with their index past that) of the first Hugging Face architecture (hf_formats.py) that
    can express the model; the weights file or the index. `token_ids` (bos_token_id and eos_token_id of an imported
    model's generation_config.json) replace the ones derived from `eos_token_id`. With `source` (over `whole`, at
    TP 1 x PP 1) the weights are fetched from it a shard at a time and released."""
    model = model_config(whole)
    # An import goes back as the architecture it came as (a Mistral without its window would pass for a Llama too).
    origin = whole.first.get("converted_from")
    prefer = origin.get("architecture") if isinstance(origin, dict) else None
    fmt, hf_config = hf_formats.for_model(model, eos_token_id=eos_token_id, where=whole.found.folder, prefer=prefer)
    hf_config.update(token_ids or {})
    weights = _weights(whole, source, num_layers=model["num_layers"])
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    try:
        config = out / "config.json"
        config.write_text(json.dumps(hf_config, indent=2) + "\n")
        # safetensors creates its files with mode 0600 whatever the umask, so a folder meant for others to load was
        # unreadable to them; they get the mode of the config.json beside them (0666 less the umask).
        return write_shards(weights, lambda sd: fmt.state_to_hf(sd, model), out, max_bytes=max_shard_bytes,
                            mode_of=config)
    except BaseException:
        # The weights are read as they are written: a damaged source found mid-way leaves no half folder behind
        # (what was in `out` before stays).
        for path in set(out.iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        if made:
            out.rmdir()
        raise


def _weights(whole: WholeCheckpoint, source: stream.Source | None, *, num_layers: int) -> Weights:
    if source is None:
        full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=num_layers)
        return Weights(meta={n: w.to("meta") for n, w in full.items()}, fetch=full.__getitem__,
                       release=lambda name: full.pop(name, None), unit_of=lambda name: name)
    assert whole.tensor_parallel == whole.pipeline_parallel == 1, "a streamed export reads a TP 1 x PP 1 source"
    unit = source.unit
    return Weights(meta={n: w.to("meta") for n, w in whole.first["model"].items()},
                   fetch=lambda name: source.weight(0, 0, name), release=lambda name: source.release(0, 0, name),
                   unit_of=(lambda name: unit(0, 0, name)) if unit is not None else (lambda name: name))
