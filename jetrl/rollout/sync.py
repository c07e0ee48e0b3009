"""Trainer -> rollout-engine weight sync: the trainer's own bytes, copied in place, proven by digests.

What is sent depends on the recipe's ``weight_sync``:

- ``fp8-bytes`` (``jetrl-unified``): every converted Linear's e4m3 bytes and 128x128 scales from
  `jetrl.convert.export_fp8_weights` (the bytes the trainer's fprop uses), plus every other parameter
  (embeddings, norms, lm_head, biases) in the engine's dtype. Nothing is re-quantized.
- ``bf16`` (``bf16`` and ``naive-fp8-rollout``): the trainer's weights in BF16. A ``naive`` engine then
  quantizes each (fused) weight per tensor, as vLLM's online fp8 does (`methods.naive_quantize_weight`).

Placement. HF names map onto vLLM parameters through the model's ``packed_modules_mapping``:
``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up], stacked along N in that order. An FP8 part
lands at row ``offset`` of the fused ``weight`` and at row ``offset / 128`` of ``weight_scale_inv``,
which is exact only if every part's N is a multiple of 128: anything else is refused, naming the part.
Padded vocabulary rows of embeddings / lm_head (vLLM pads the vocab) are left alone. Every engine
parameter must receive data, and every payload entry must find a place, else `WeightSyncError`.

Verification. After every copy, a digest of every placed tensor is computed on both sides -- the
trainer's payload and the engine's memory (the exact row range) -- and any difference raises
`WeightSyncError` naming the parameter. `tensor_digest` is a 128-bit position-weighted sum of the
bytes (as 64-bit words, mod 2^64, odd multipliers): any single-word change always changes it, it is
order-independent so CPU and GPU agree, and it runs on the tensor's device (on CUDA one read of the
bytes by `jetrl.kernels.digest`; every digest of a sync comes back in one host transfer). Not
cryptographic: it guards against bugs, not adversaries.

The copy runs inside the engine (`Engine.apply`, vLLM's ``apply_model``). With an in-process engine trainer
and engine tensors live in one process (colocated on one GPU, or on the CPU) and the payload is handed over as
it is; an engine in other processes (vLLM's engine core and worker processes) receives it in byte buffers of
at most 1 GiB (`jetrl.rollout.transfer`: CUDA IPC handles on a GPU, so the worker copies from the trainer's
memory), and the digests prove the bytes either way. vLLM-free: the engine side is reached only through
`jetrl.rollout.adapter.Engine`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from jetrl.recipe import BLOCK, Recipe
from jetrl.rollout.methods import naive_quantize_weight
from jetrl.rollout.transfer import DEFAULT_BUCKET_BYTES, Parcel, pack_buckets

__all__ = [
    "WeightSyncError",
    "SyncReport",
    "Placement",
    "tensor_digest",
    "tensor_digests",
    "DIGEST_K",
    "trainer_payload",
    "plan_sync",
    "sync_weights",
    "verify_weights",
    "install_payload",
]

_MASK = (1 << 64) - 1
DIGEST_K = (-7046029254386353131, -4658895280553007687, -7723592293110705685, 1442695040888963407)
"""`tensor_digest`'s odd-multiplier generators (golden-ratio and splitmix64 constants, as signed int64)."""


class WeightSyncError(RuntimeError):
    """A weight sync could not be planned, or the engine does not hold exactly the trainer's bytes."""


@dataclass(frozen=True)
class SyncReport:
    """What one sync moved and how long it took."""

    bytes: int
    """Payload bytes copied into the engine (fp8 bytes + scales + BF16 tensors)."""
    seconds: float
    """Wall time of the whole sync (export + copy + verification)."""
    n_params: int
    """Payload entries placed (an fp8 weight with its scales counts once)."""
    digests_equal: bool
    """Always True in a returned report (a mismatch raises); kept for logs."""
    mode: str = ""
    """Engine mode: block / naive / bf16."""
    export_seconds: float = 0.0
    copy_seconds: float = 0.0
    verify_seconds: float = 0.0
    n_digests: int = 0
    """Tensors compared by digest."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Placement:
    """Where one payload entry goes in the engine."""

    hf_name: str
    engine_param: str
    row0: int
    rows: int
    kind: str
    """"fp8" (bytes + scales), "bf16" (a BF16 slice), or "naive" (BF16 part of a per-tensor-quantized weight)."""
    scale_param: str | None = None
    scale_row0: int = 0
    scale_rows: int = 0


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D int64 words, zero-padded to a multiple of 8 bytes."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int64)


def _hash_pair(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]`` (h1, h2) of `t` on its device (no host sync): the Triton kernel on CUDA (one read
    of the bytes), the torch reference elsewhere; the same bits either way."""
    from jetrl.kernels.digest import launch_digest, torch_digest

    return (launch_digest if t.is_cuda else torch_digest)(_words(t), DIGEST_K)


def _format(t: torch.Tensor, h: list[int]) -> str:
    dt = str(t.dtype).removeprefix("torch.")
    return f"{dt}{list(t.shape)}:{h[0] & _MASK:016x}{h[1] & _MASK:016x}"


def tensor_digest(t: torch.Tensor) -> str:
    """128-bit digest of a tensor's bytes, tagged with dtype and shape (see module docstring)."""
    return _format(t, _hash_pair(t).tolist())


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """`tensor_digest` of each tensor, computed on the device with one host transfer per device at
    the end (instead of a sync per tensor)."""
    pairs = {key: _hash_pair(t) for key, t in tensors.items()}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for key, h in pairs.items():
        by_device[h.device].append(key)
    out = {}
    for keys in by_device.values():
        values = torch.stack([pairs[k] for k in keys]).tolist()
        out.update({k: _format(tensors[k], v) for k, v in zip(keys, values, strict=True)})
    return {key: out[key] for key in tensors}


def trainer_payload(model: torch.nn.Module, recipe: Recipe, dtype: torch.dtype = torch.bfloat16) -> dict:
    """HF name -> tensor (BF16 params, cast to `dtype`) or (q, s) (fp8 bytes + 128x128 scales of a
    converted Linear's weight). For ``weight_sync == 'bf16'`` recipes every parameter is a tensor."""
    from jetrl.linear import JetFP8Linear

    fp8: dict = {}
    if recipe.weight_sync == "fp8-bytes":
        from jetrl.convert import export_fp8_weights

        fp8 = export_fp8_weights(model)
        if not fp8:
            raise WeightSyncError(
                f"recipe {recipe.name!r} sends fp8 bytes but the trainer model has no JetFP8Linear; "
                "run jetrl.convert.convert_model(model, recipe) first"
            )
    out: dict = dict(fp8)
    seen: set[int] = set()  # a tied lm_head shares embed_tokens' Parameter: sent once, under its first name
    with torch.no_grad():
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = f"{mname}.{pname}" if mname else pname
                if isinstance(mod, JetFP8Linear) and pname != "bias":
                    if recipe.weight_sync == "fp8-bytes":
                        continue  # sent as fp8 bytes (the master / fp8_param storage stays with the trainer)
                    if pname != "weight":
                        continue
                out[name] = p.detach().to(dtype)
    return out


def _split(name: str) -> tuple[str, str]:
    mod, _, leaf = name.rpartition(".")
    return mod, leaf


def plan_sync(payload: dict, param_info: dict, packed: dict[str, list[str]]) -> list[Placement]:
    """Place every payload entry onto an engine parameter; raises `WeightSyncError` on any gap or misfit.

    `param_info`: engine name -> `adapter.ParamInfo`; `packed`: fused leaf -> part leaves in order."""
    part_of = {p: (fused, parts) for fused, parts in packed.items() for p in parts}
    placements: list[Placement] = []
    for hf_name, val in payload.items():
        mod, pname = _split(hf_name)
        head, _, leaf = mod.rpartition(".")
        rows_of = (lambda v: v[0].shape[0]) if isinstance(val, tuple) else (lambda v: v.shape[0] if v.dim() else 1)
        if hf_name in param_info:
            target, row0 = hf_name, 0
        elif leaf in part_of:
            fused, parts = part_of[leaf]
            target = f"{head}.{fused}.{pname}" if head else f"{fused}.{pname}"
            row0 = 0
            for p in parts[: parts.index(leaf)]:
                sib = f"{head}.{p}.{pname}" if head else f"{p}.{pname}"
                if sib not in payload:
                    raise WeightSyncError(f"{hf_name}: fused into {target} after {sib}, which the trainer lacks")
                row0 += rows_of(payload[sib])
        else:
            raise WeightSyncError(f"{hf_name}: no engine parameter of that name and no fused parameter containing it")
        if target not in param_info:
            raise WeightSyncError(f"{hf_name}: engine has no parameter {target}")
        info = param_info[target]
        mode = info.jetrl_mode
        if mode == "stock-online-fp8":
            raise WeightSyncError(
                f"{hf_name}: engine parameter {target} belongs to vLLM's online per-tensor FP8 method, which keeps "
                "re-laid-out weights; sync into rollout='jetrl' (jetrl_fp8_naive) instead"
            )
        rows = rows_of(val)
        if isinstance(val, tuple):
            q, s = val
            if mode != "block":
                raise WeightSyncError(
                    f"{hf_name}: the trainer sends fp8 bytes but engine parameter {target} is "
                    f"{info.dtype} ({mode or 'not a jetrl_fp8 layer'}); start the engine with the same recipe"
                )
            if target != hf_name and (row0 % BLOCK or rows % BLOCK):
                raise WeightSyncError(
                    f"{hf_name}: part of fused {target} at rows [{row0}, {row0 + rows}); fp8 parts must start and end "
                    f"on multiples of {BLOCK} so their 128x128 scale rows stack exactly"
                )
            scale_param = f"{_split(target)[0]}.weight_scale_inv"
            if tuple(q.shape[1:]) != info.shape[1:] or q.dtype != torch.float8_e4m3fn:
                raise WeightSyncError(f"{hf_name}: fp8 {q.dtype} {tuple(q.shape)} does not fit {target} {info.shape}")
            placements.append(Placement(hf_name, target, row0, rows, "fp8", scale_param, row0 // BLOCK, s.shape[0]))
        else:
            if mode == "block" and pname != "bias":  # a block-FP8 Linear's bias stays in the engine's dtype
                raise WeightSyncError(
                    f"{hf_name}: the trainer sends BF16 but engine parameter {target} holds jetrl_fp8 bytes; "
                    "convert the trainer model with the engine's recipe (jetrl.convert.convert_model)"
                )
            kind = "naive" if mode == "naive" and pname == "weight" else "bf16"
            if kind == "bf16" and info.dtype != str(val.dtype).removeprefix("torch."):
                raise WeightSyncError(f"{hf_name}: trainer sends {val.dtype}, engine {target} holds {info.dtype}")
            if info.shape and info.shape[0] == 0:
                raise WeightSyncError(
                    f"{hf_name}: engine parameter {target} is empty (vLLM's CPU backend repacked it); "
                    "start the engine with rollout='jetrl' so BF16 Linears keep their weights"
                )
            if tuple(val.shape[1:]) != info.shape[1:]:
                raise WeightSyncError(f"{hf_name}: shape {tuple(val.shape)} does not fit {target} {info.shape}")
            placements.append(Placement(hf_name, target, row0, rows, kind))
        end = row0 + rows
        total = info.shape[0] if info.shape else 1
        if end > total:
            raise WeightSyncError(f"{hf_name}: rows [{row0}, {end}) exceed {target} with {total} rows")
    _check_coverage(placements, param_info)
    return placements


def _check_coverage(placements: list[Placement], param_info: dict) -> None:
    covered: dict[str, int] = defaultdict(int)
    for p in placements:
        covered[p.engine_param] += p.rows
        if p.scale_param:
            covered[p.scale_param] += p.scale_rows
        if p.kind == "naive":
            covered[f"{_split(p.engine_param)[0]}.weight_scale"] = 1
    for name, info in param_info.items():
        total = info.shape[0] if info.shape else 1
        got = covered.get(name, 0)
        if got == total or (info.vocab and 0 < got <= total):
            continue
        raise WeightSyncError(f"engine parameter {name} {info.shape} receives {got} of {total} rows from the trainer")


def _naive_groups(placements: list[Placement]) -> dict[str, list[Placement]]:
    groups: dict[str, list[Placement]] = defaultdict(list)
    for p in placements:
        if p.kind == "naive":
            groups[p.engine_param].append(p)
    return groups


def _expected_digests(payload: dict, placements: list[Placement], recipe: Recipe) -> dict[str, str]:
    """What the engine must hold, keyed like `_engine_digests`, computed from the trainer's payload."""
    out = {}
    for p in placements:
        val = payload[p.hf_name]
        if p.kind == "fp8":
            out[f"{p.hf_name} -> {p.engine_param}"] = val[0]
            out[f"{p.hf_name}:scales -> {p.scale_param}"] = val[1]
        elif p.kind == "bf16":
            out[f"{p.hf_name} -> {p.engine_param}"] = val
    for target, parts in _naive_groups(placements).items():
        full = torch.cat([payload[p.hf_name] for p in sorted(parts, key=lambda p: p.row0)])
        q, s = naive_quantize_weight(full, recipe.rollout_weight, name=target)
        out[f"{target} (per-tensor fp8 of {len(parts)} parts)"] = q
        out[f"{target}:scale (per-tensor)"] = s
    return tensor_digests(out)


def _engine_side(model, placements: list[Placement], recipe: Recipe, payload: dict | Parcel | None, digest: bool):
    """Runs inside the engine: copy `payload` (when given; a `Parcel` is opened) into place; digest what is
    there if `digest`."""
    if isinstance(payload, Parcel):
        payload = payload.open()
    placed = {}

    def put(key, t):
        if digest:
            placed[key] = t

    with torch.no_grad():
        for p in placements:
            if p.kind == "naive":
                continue
            param = model.get_parameter(p.engine_param)
            dst = param.data if param.dim() == 0 else param.data[p.row0 : p.row0 + p.rows]
            if p.kind == "fp8":
                sdst = model.get_parameter(p.scale_param).data[p.scale_row0 : p.scale_row0 + p.scale_rows]
                if payload is not None:
                    q, s = payload[p.hf_name]
                    dst.copy_(q)
                    sdst.copy_(s)
                put(f"{p.hf_name} -> {p.engine_param}", dst)
                put(f"{p.hf_name}:scales -> {p.scale_param}", sdst)
            else:
                if payload is not None:
                    dst.copy_(payload[p.hf_name].reshape(dst.shape))
                put(f"{p.hf_name} -> {p.engine_param}", dst)
        for target, parts in _naive_groups(placements).items():
            wparam = model.get_parameter(target)
            sparam = model.get_parameter(f"{_split(target)[0]}.weight_scale")
            if payload is not None:
                full = torch.cat([payload[p.hf_name] for p in sorted(parts, key=lambda p: p.row0)])
                q, s = naive_quantize_weight(full.to(wparam.device), recipe.rollout_weight, name=target)
                wparam.data.copy_(q)
                sparam.data.copy_(s.reshape(sparam.shape))
            put(f"{target} (per-tensor fp8 of {len(parts)} parts)", wparam.data)
            put(f"{target}:scale (per-tensor)", sparam.data)
        digests = tensor_digests(placed)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return digests


def _compare(expected: dict[str, str], got_per_worker: list[dict[str, str]]) -> None:
    for w, got in enumerate(got_per_worker):
        bad = [k for k in expected if got.get(k) != expected[k]]
        if bad:
            lines = [f"  {k}: trainer {expected[k]} engine {got.get(k)}" for k in bad[:10]]
            more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
            raise WeightSyncError(
                f"engine worker {w} does not hold the trainer's bytes for {len(bad)} tensor(s):\n"
                + "\n".join(lines)
                + more
            )


@dataclass
class _Prepared:
    payload: dict
    placements: list[Placement]
    expected: dict[str, str] = field(default_factory=dict)
    export_seconds: float = 0.0


def _prepare(trainer_model, engine, recipe: Recipe) -> _Prepared:
    if engine.recipe.name != recipe.name:
        raise WeightSyncError(f"engine runs recipe {engine.recipe.name!r} but the sync was asked for {recipe.name!r}")
    t0 = time.perf_counter()
    payload = trainer_payload(trainer_model, recipe)
    export_seconds = time.perf_counter() - t0
    placements = plan_sync(payload, engine.param_info(), engine.packed_modules_mapping())
    return _Prepared(payload, placements, export_seconds=export_seconds)


def _digester(placements: list[Placement], recipe: Recipe):
    """What `Engine.apply` runs to digest the engine's placed tensors (a partial: picklable to worker processes)."""
    return partial(_engine_side, placements=placements, recipe=recipe, payload=None, digest=True)


def _install(engine, prep: _Prepared, recipe: Recipe, bucket_bytes: int) -> None:
    """Copy the payload into the engine: as it is in process, else parcel by parcel (`jetrl.rollout.transfer`),
    each with the placements of its entries (a per-tensor-quantized weight's parts travel together)."""
    if engine.in_process:
        engine.apply(
            partial(_engine_side, placements=prep.placements, recipe=recipe, payload=prep.payload, digest=False)
        )
        return
    groups: dict[str, list[str]] = {}
    for p in prep.placements:
        groups.setdefault(p.engine_param if p.kind == "naive" else p.hf_name, []).append(p.hf_name)
    by_name = {p.hf_name: p for p in prep.placements}
    for names, parcel in pack_buckets(prep.payload, groups.values(), bucket_bytes):
        placements = [by_name[n] for n in names]
        engine.apply(partial(_engine_side, placements=placements, recipe=recipe, payload=parcel, digest=False))
        del parcel


def verify_weights(trainer_model, engine, recipe: Recipe | str) -> int:
    """Compare digests of every placed tensor on both sides without copying; returns how many were
    compared. Raises `WeightSyncError` naming each parameter that differs."""
    recipe = recipe if isinstance(recipe, Recipe) else Recipe.from_name(recipe)
    prep = _prepare(trainer_model, engine, recipe)
    expected = _expected_digests(prep.payload, prep.placements, recipe)
    _compare(expected, engine.apply(_digester(prep.placements, recipe)))
    return len(expected)


def sync_weights(
    trainer_model, engine, recipe: Recipe | str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> SyncReport:
    """Copy the trainer's weights into the engine in place and prove byte equality (see module docstring).
    `bucket_bytes`: the most payload bytes one parcel carries to an engine in other processes."""
    recipe = recipe if isinstance(recipe, Recipe) else Recipe.from_name(recipe)
    t0 = time.perf_counter()
    prep = _prepare(trainer_model, engine, recipe)
    t1 = time.perf_counter()
    _install(engine, prep, recipe, bucket_bytes)
    engine.finalize_weight_update()
    t2 = time.perf_counter()
    expected = _expected_digests(prep.payload, prep.placements, recipe)
    _compare(expected, engine.apply(_digester(prep.placements, recipe)))
    t3 = time.perf_counter()
    nbytes = sum((v[0].nbytes + v[1].nbytes) if isinstance(v, tuple) else v.nbytes for v in prep.payload.values())
    mode = next((p.kind for p in prep.placements if p.kind in ("fp8", "naive")), "bf16")
    return SyncReport(
        bytes=nbytes,
        seconds=t3 - t0,
        n_params=len(prep.placements),
        digests_equal=True,
        mode={"fp8": "block", "naive": "naive", "bf16": "bf16"}[mode],
        export_seconds=prep.export_seconds,
        copy_seconds=t2 - t1,
        verify_seconds=t3 - t2,
        n_digests=len(expected),
    )


def install_payload(
    model, payload: dict, recipe: Recipe | str, param_info: dict, packed: dict, finalize=None
) -> SyncReport:
    """The engine half of a sync, for code already running inside the engine's worker (e.g. verl's vLLM
    worker extension, `jetrl.verl.worker`), where `payload` (as `trainer_payload` returns it) has arrived
    from the trainer: place it (`plan_sync`), copy it into `model` in place, call ``finalize(model)`` if
    given (e.g. `jetrl.rollout.adapter.refresh_after_weight_update`), then prove the engine's memory holds
    exactly the payload's bytes by digest. Raises `WeightSyncError` naming the parameter otherwise."""
    recipe = recipe if isinstance(recipe, Recipe) else Recipe.from_name(recipe)
    t0 = time.perf_counter()
    placements = plan_sync(payload, param_info, packed)
    _engine_side(model, placements, recipe, payload, False)
    if finalize is not None:
        finalize(model)
    t1 = time.perf_counter()
    expected = _expected_digests(payload, placements, recipe)
    _compare(expected, [_engine_side(model, placements, recipe, None, True)])
    t2 = time.perf_counter()
    nbytes = sum((v[0].nbytes + v[1].nbytes) if isinstance(v, tuple) else v.nbytes for v in payload.values())
    mode = next((p.kind for p in placements if p.kind in ("fp8", "naive")), "bf16")
    return SyncReport(
        bytes=nbytes,
        seconds=t2 - t0,
        n_params=len(placements),
        digests_equal=True,
        mode={"fp8": "block", "naive": "naive", "bf16": "bf16"}[mode],
        copy_seconds=t1 - t0,
        verify_seconds=t2 - t1,
        n_digests=len(expected),
    )
