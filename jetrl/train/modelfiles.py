"""Open a model directory's files before any work: one `ModelFileError` line naming the bad file.

`check_model_dir` reads ``config.json`` and the tokenizer's JSON files, and checks every
``*.safetensors`` file (and the shards a ``model.safetensors.index.json`` names) without loading the
weights: the 8-byte header length, the JSON header, and that the tensors' byte ranges fit the file
exactly (a truncated or padded file fails). That costs a few reads per file, so ``jetrl train
--dry-run`` runs it as well as the trainer's start.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["ModelFileError", "check_model_dir", "check_safetensors"]

_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class ModelFileError(ValueError):
    """A model file that cannot be read; the message starts with the file's path."""


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not readable JSON ({e})") from None


def check_safetensors(path: str | Path) -> int:
    """Validate a safetensors file's header and size; return its number of tensors."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{p}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ModelFileError(f"{p}: header length {n} exceeds the file ({size} bytes): truncated")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelFileError(f"{p}: cannot read ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{p}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{p}: the safetensors header is not a mapping")
    end = 0
    count = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{p}: tensor {name!r} has no valid data_offsets") from None
        end = max(end, int(hi))
        count += 1
    data = size - 8 - n
    if end != data:
        what = "truncated" if end > data else "has trailing bytes"
        raise ModelFileError(f"{p}: the header describes {end} data bytes but the file holds {data}: {what}")
    return count


def check_model_dir(path: str | Path, *, field: str = "model.path") -> None:
    """Raise `ModelFileError` naming the first unreadable file of the HF model directory `path`."""
    d = Path(path)
    if not d.is_dir():
        raise ModelFileError(f"{d}: not a directory ({field})")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise ModelFileError(f"{cfg}: missing ({field} must be an HF model directory)")
    if not isinstance(_json(cfg), dict):
        raise ModelFileError(f"{cfg}: not a JSON mapping")
    for name in _TOKENIZER_JSON:
        if (d / name).is_file():
            _json(d / name)
    files = sorted(d.glob("*.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        doc = _json(index)
        shards = sorted(set((doc.get("weight_map") or {}).values())) if isinstance(doc, dict) else []
        for shard in shards:
            if not (d / shard).is_file():
                raise ModelFileError(f"{d / shard}: missing (named by {index.name})")
    if not files:
        if any(d.glob("*.bin")) or any(d.glob("*.pt")):
            raise ModelFileError(f"{d}: weights only as pickles (*.bin/*.pt); jetrl loads safetensors only")
        raise ModelFileError(f"{d}: no *.safetensors weights ({field})")
    for f in files:
        check_safetensors(f)
