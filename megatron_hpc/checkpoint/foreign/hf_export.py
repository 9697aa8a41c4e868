"""`ckpt convert --to hf`: a whole checkpoint of ours as a Hugging Face model folder (config.json and the weights).
The mapping of each architecture is in hf_gpt2.py and its siblings, chosen by hf_formats.py; the run's tokenizer
files that go beside it are found by checkpoint/conversion/tokenizers.py. Offline, one process, CPU.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import WholeCheckpoint, model_config, pp_layout
from megatron_hpc.checkpoint.foreign import hf_formats


def export_hf(whole: WholeCheckpoint, out: Path, *, eos_token_id: int | None = None,
              token_ids: dict[str, Any] | None = None) -> Path:
    """Write config.json and the weights (model.safetensors, or pytorch_model.bin without safetensors) of the first
    Hugging Face architecture (hf_formats.py) that can express the model. `token_ids` (bos_token_id and
    eos_token_id of an imported model's generation_config.json) replace the ones derived from `eos_token_id`."""
    model = model_config(whole)
    # An import goes back as the architecture it came as (a Mistral without its window would pass for a Llama too).
    source = whole.first.get("converted_from")
    prefer = source.get("architecture") if isinstance(source, dict) else None
    fmt, hf_config = hf_formats.for_model(model, eos_token_id=eos_token_id, where=whole.found.folder, prefer=prefer)
    hf_config.update(token_ids or {})
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=model["num_layers"])
    sd = fmt.state_to_hf(full, model)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps(hf_config, indent=2) + "\n")
    try:
        from safetensors.torch import save_file
    except ImportError:
        path = out / "pytorch_model.bin"
        torch.save(sd, path)
    else:
        path = out / "model.safetensors"
        save_file(sd, str(path), metadata={"format": "pt"})
        # safetensors creates its file with mode 0600 whatever the umask, so a folder meant for others to load
        # was unreadable to them; it gets the mode of the config.json beside it (0666 less the umask).
        path.chmod(stat.S_IMODE(config.stat().st_mode))
    return path
