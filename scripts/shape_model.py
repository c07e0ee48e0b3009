"""Random-weight checkpoints with a real model's shape, built offline (no weights or tokenizer downloaded).

A shape is ``qwen3-0.6b`` (Qwen3-0.6B's dimensions, untied embeddings) or a folder of ``recipes/models/``
(``llama3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b-base``: the shipped ``config.json``, architecture facts only),
with ``--layers`` of its decoder layers. The tokenizer is jetrl's character tokenizer (`jetrl.tiny`); its
special ids replace the config's. ``--chat`` gives the ChatML one padded to the model's vocabulary
(``CharTokenizer(chat=True, size=vocab_size)``): what a ``python -m jetrl.verl`` run needs, since verl renders
prompts with the chat template and decodes every sampled id.

    python scripts/shape_model.py --shape llama3.1-8b --layers 8 --chat --out /tmp/llama-8l [--device cuda]

Used by bench_e2e.py (plain tokenizer: its generation never decodes) and bench_verl_shapes.py (chat).
`reusable_model_dir` keeps a benchmark's model at a fixed path (bench_e2e, bench_rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "recipes" / "models"
QWEN3_0_6B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
SHAPES = ("qwen3-0.6b", *sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file()))
DEFAULT_LAYERS = 8
"""Decoder layers of an 8B-class shape unless told (its fp32 masters and AdamW states beside vLLM on one H200);
qwen3-0.6b keeps all 28."""


def tokenizer_for(vocab_size: int, chat: bool):
    from jetrl.tiny import CharTokenizer

    return CharTokenizer(chat=True, size=vocab_size) if chat else CharTokenizer()


def shape_config(shape: str, layers: int | None, *, chat: bool = False, **overrides):
    """The `transformers` config of `shape` with `layers` decoder layers (None: `DEFAULT_LAYERS`, qwen3-0.6b
    all of its own), the character tokenizer's special ids; `overrides` replace fields (tests shrink a shape)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r}: choose one of {SHAPES}")
    if shape == "qwen3-0.6b":
        fields = dict(QWEN3_0_6B)
    else:
        fields = json.loads((MODELS_DIR / shape / "config.json").read_text())  # its architectures kept: the
        fields.pop("torch_dtype", None)  # config-only dry run's checkpoint names its model class as a real one does
    full = fields["num_hidden_layers"]
    n = (full if shape == "qwen3-0.6b" else DEFAULT_LAYERS) if layers is None else layers
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    if n > full:
        raise ValueError(f"--layers {n}: {shape} has {full} decoder layers")
    fields.update(num_hidden_layers=n, **overrides)
    if "max_window_layers" in fields:  # Qwen2: layers from this index on use sliding windows (when enabled)
        fields["max_window_layers"] = min(fields["max_window_layers"], n)
    tok = tokenizer_for(fields["vocab_size"], chat)
    fields.update(pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def write_shape_model(
    path: str | Path, shape: str, layers: int | None, *, seed: int = 0, chat: bool = False, device=None, **overrides
) -> Path:
    """Write `shape_config(shape, layers, chat=chat, **overrides)` with random bf16 weights (seeded; initialised
    on `device`, default CUDA when there is one) and the character tokenizer to `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    from jetrl.tiny import save_checkpoint

    cfg = shape_config(shape, layers, chat=chat, **overrides)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.cpu()
    if torch.cuda.is_available():  # the allocator would keep the init's blocks (12 GB at 8 Llama-8B layers)
        torch.cuda.empty_cache()  # from the engine and trainer that the caller starts next on the same GPU
    return save_checkpoint(model, tokenizer_for(cfg.vocab_size, chat), path)


def reusable_model_dir(name: str, write: Callable[[Path], object]) -> Path:
    """``<tmp>/jetrl-bench-models/<name>``, written by ``write(folder)`` the first time and reused afterwards
    (a ``.complete`` marker; a half-written folder is never taken). Why a fixed path: vLLM keys its
    torch.compile cache by the model path among other things, so a new temporary folder per run recompiled the
    engine every time (80 s of a 0.6B FP8 engine's start on the H200), within a lease and, with
    ``third_party/jit_cache_device.sh``, across leases. `name` must say everything the contents depend on;
    delete the folder to rebuild it."""
    root = Path(tempfile.gettempdir()) / "jetrl-bench-models"
    final = root / name
    if (final / ".complete").is_file():
        return final
    partial = root / f"{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    (partial / ".complete").touch()
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=SHAPES)
    p.add_argument("--layers", type=int, help=f"decoder layers (default {DEFAULT_LAYERS}; qwen3-0.6b: 28)")
    p.add_argument("--chat", action="store_true", help="the ChatML tokenizer padded to the vocabulary (verl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="where the weights are initialised (default cuda when available)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        path = write_shape_model(args.out, args.shape, args.layers, seed=args.seed, chat=args.chat, device=args.device)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
