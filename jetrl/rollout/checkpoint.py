"""Write a jetrl-converted model as a stock vLLM block-FP8 checkpoint.

The layout is the one DeepSeek-V3 / Qwen3-FP8 checkpoints use and vLLM's ``fp8`` method reads:
each converted Linear stores ``<name>.weight`` (float8_e4m3fn ``[N, K]``) and
``<name>.weight_scale_inv`` (float32 ``[ceil(N/128), ceil(K/128)]``, the dequant multiplier), every
other tensor is BF16, and ``config.json`` carries ``quantization_config = {quant_method: fp8,
activation_scheme: dynamic, weight_block_size: [128, 128], ignored_layers: [...]}`` with no
``scale_fmt`` (fp32 scales). The bytes are the trainer's own (`jetrl.convert.export_fp8_weights`), so an
engine started from this directory -- with ``jetrl_fp8`` or stock vLLM -- holds exactly what the trainer
computes with, before any sync.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

__all__ = ["save_fp8_checkpoint", "write_fp8_export", "write_export_dir", "FP8_BLOCK_QUANT_CONFIG", "HF_DIR", "FP8_DIR"]

HF_DIR = "hf"
FP8_DIR = "fp8-block128"
"""The folders an export writes (`jetrl export`, `jetrl export-verl`): the HF policy and its block-FP8 checkpoint."""
FP8_BLOCK_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The ``quantization_config`` of a stock 128x128 block-FP8 checkpoint (without ``ignored_layers``)."""


def save_fp8_checkpoint(model: torch.nn.Module, tokenizer, path: str | os.PathLike) -> Path:
    """Write `model` (converted with `jetrl.convert.convert_model`) as an FP8 block checkpoint in `path`.
    `tokenizer` needs a ``save(path)`` (`jetrl.tiny.CharTokenizer`) or ``save_pretrained(path)``; None skips it."""
    from safetensors.torch import save_file

    from jetrl.convert import export_fp8_weights
    from jetrl.linear import JetFP8Linear

    fp8 = export_fp8_weights(model)
    if not fp8:
        raise ValueError("save_fp8_checkpoint: the model has no JetFP8Linear; run jetrl.convert.convert_model first")
    tensors: dict[str, torch.Tensor] = {}
    ignored = []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not isinstance(mod, JetFP8Linear) and mname != "lm_head":
            ignored.append(mname)
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(mod, JetFP8Linear) and pname != "bias":
                continue
            tensors[name] = p.detach().to(torch.bfloat16).contiguous().cpu()
    for name, (q, s) in fp8.items():
        tensors[name] = q.contiguous().cpu()
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = s.contiguous().cpu()
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(p / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "bfloat16"
    cfg.pop("torch_dtype", None)
    cfg["quantization_config"] = {**FP8_BLOCK_QUANT_CONFIG, "ignored_layers": ignored}
    (p / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        (tokenizer.save if hasattr(tokenizer, "save") else tokenizer.save_pretrained)(p)
    return p


def write_export_dir(path: str | os.PathLike, info: dict, fmt: str, write) -> Path:
    """``write(tmp)`` fills a fresh folder beside `path`; ``jetrl.json`` = `info` with ``format`` `fmt` is added
    and the folder renamed to `path`, replacing it, so that a failed write leaves no `path`."""
    final = Path(path)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    (tmp / "jetrl.json").write_text(json.dumps({**info, "format": fmt}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def write_fp8_export(model: torch.nn.Module, tokenizer, recipe, path: str | os.PathLike, info: dict) -> Path:
    """The trained policy `model` (HF, BF16: the trainer's compute weights) as the FP8 block checkpoint of
    `recipe` in `path`, with ``jetrl.json`` (`write_export_dir`).

    Converted on the host: the 128x128 weight quantization is the recipe's reference (`jetrl.quant`), bitwise
    the same on every backend and device, so a GPU run exports the bytes it trained with."""
    from jetrl.convert import convert_model

    convert_model(model, recipe, backend="emulated")
    return write_export_dir(path, info, "vllm-fp8-block128", lambda tmp: save_fp8_checkpoint(model, tokenizer, tmp))
