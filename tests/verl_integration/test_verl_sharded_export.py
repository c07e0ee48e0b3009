"""`JetrlFSDPEngine` sharded over 2 processes (FSDP2, gloo, CPU): the FP8 stream verl sends at every sync
carries exactly the single-process export's fp8 bytes, 128x128 scales, BF16 tensors, names and digests on
every rank, while each converted weight lives sharded along N -- in both export modes: ``gather`` (verl's
``get_per_tensor_param``: one full-tensor gather per parameter, quantized after it) and ``shard`` (each rank
quantizes its own rows, only e4m3 bytes + scales are gathered), which is refused, naming the weight, when
a shard is not whole 128-row blocks. Neither mode ever holds the whole model gathered on one rank (measured:
every ``DTensor.full_tensor`` result is tracked while it is alive). A training pass holds no full-size FP8 weight
on a rank between its forward and its backward, with gradients bit-equal to the Linears' cached path. The two
ranks' ``save_checkpoint`` exported by ``jetrl export-verl`` (verl's merger, then jetrl's FP8 writer) holds the
single-process export's bytes."""

import os
import traceback
import weakref
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="verl 0.9.1 is installed by `make venv` (third_party/verl-cpu-requirements.txt)"
)

if not torch.cuda.is_available():  # as conftest does; also in the spawned ranks, which import this module
    import verl_cpu_platform

    verl_cpu_platform.install()

from transformers import AutoModelForCausalLM  # noqa: E402
from verl_engine_cases import build_engine, fp8_weight_probe, free_port  # noqa: E402

from jetrl.convert import convert_model, export_fp8_weights  # noqa: E402
from jetrl.recipe import Recipe  # noqa: E402
from jetrl.rollout.sync import tensor_digest  # noqa: E402
from jetrl.testing.subprocess_guard import HANG_GUARD_S  # noqa: E402
from jetrl.tiny import save_tiny_checkpoint  # noqa: E402
from jetrl.verl.engine import DIGEST_SUFFIX, SCALE_SUFFIX, decode_digest  # noqa: E402

RECIPE = "jetrl-unified"
WORLD = 2
MODELS = {"tiny": (3, {}), "tiny-kv2": (4, {"num_key_value_heads": 2})}
"""The tiny model's k_proj / v_proj have 128 rows: 64 per FSDP shard, off the 128-row blocks. With two kv
heads every weight's shard is 128 rows or more: the per-shard export is exact there."""


def _export(eng, mode: str) -> dict:
    """One sync stream of `eng` with ``JETRL_FP8_EXPORT=mode``, and every ``DTensor.full_tensor`` result
    tracked while alive (count, bytes, peak); ``error`` holds the message of a refused export."""
    from torch.distributed.tensor import DTensor

    from jetrl.rollout.sync import WeightSyncError

    os.environ["JETRL_FP8_EXPORT"] = mode
    live: dict[int, int] = {}
    gathered = {"calls": 0, "bytes": 0, "peak_n": 0, "peak_bytes": 0}
    full_tensor = DTensor.full_tensor

    def tracked(self, *args, **kwargs):
        t = full_tensor(self, *args, **kwargs)
        live[id(t)] = t.nbytes
        weakref.finalize(t, live.pop, id(t), None)
        gathered["calls"] += 1
        gathered["bytes"] += t.nbytes
        gathered["peak_n"] = max(gathered["peak_n"], len(live))
        gathered["peak_bytes"] = max(gathered["peak_bytes"], sum(live.values()))
        return t

    DTensor.full_tensor = tracked
    try:
        gen, peft = eng.get_per_tensor_param()
        assert peft is None
        stream = [(name, t.detach().cpu().clone()) for name, t in gen]
    except WeightSyncError as e:
        return {"error": str(e), "gathered": gathered}
    finally:
        DTensor.full_tensor = full_tensor
    return {"stream": stream, "gathered": gathered, "last_export": eng.jetrl_last_export}


def _rank_main(rank: int, ckpts: dict[str, str], port: int, out_dir: str) -> None:
    """One FSDP2 rank: verl's engine initialisation, the shard layout, sync streams in both export modes,
    the gathered tensors alive at once. Writes ``rank<r>.pt`` (or ``rank<r>.err`` with the traceback)."""
    try:
        torch.set_num_threads(1)
        os.environ.update(
            {
                "JETRL_RECIPE": RECIPE,
                "JETRL_GEMM_BACKEND": "emulated",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
            }
        )
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        out: dict = {}
        for key, ckpt in ckpts.items():
            eng = build_engine(ckpt)
            shards = {}
            for name in eng.jetrl_conversion.converted_names():
                w = eng.module.get_submodule(name).weight
                assert isinstance(w, DTensor), f"{name}.weight is {type(w).__name__}, not an FSDP2 DTensor"
                shards[f"{name}.weight"] = (tuple(w.shape), tuple(w.to_local().shape), str(tuple(w.placements)))
            sizes = sorted((p.nbytes for p in eng.module.state_dict().values()), reverse=True)
            ids = torch.randint(3, 70, (2, 16), generator=torch.Generator().manual_seed(0))  # the same on both ranks
            train = fp8_weight_probe(eng, ids)
            out[key] = {
                "shards": shards,
                "param_bytes": sizes,
                "gather": _export(eng, "gather"),
                "shard": _export(eng, "shard"),
                "train": train,
            }
            eng.save_checkpoint(str(Path(out_dir) / "ckpt" / key / "global_step_0" / "actor"), global_step=0)
            del eng
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import multiprocessing as mp

    root = tmp_path_factory.mktemp("tiny")
    ckpts = {key: str(save_tiny_checkpoint(root / key, seed=seed, **kw)) for key, (seed, kw) in MODELS.items()}
    out = tmp_path_factory.mktemp("fsdp2")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, ckpts, port, str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(HANG_GUARD_S)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"FSDP2 ranks {hung} still running after {HANG_GUARD_S} s"
    errors = {r: (out / f"rank{r}.err").read_text() for r in range(WORLD) if (out / f"rank{r}.err").exists()}
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])
    return ckpts, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)], out / "ckpt"


def _single_process_export(ckpt):
    """The same checkpoint in one process, as `test_verl_engine` checks the world-size-1 engine against:
    fp32 masters cast to the forward's bf16, `jetrl.convert.convert_model`, `export_fp8_weights`."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(torch.bfloat16)
    convert_model(model, Recipe.from_name(RECIPE), backend="emulated")
    fp8 = export_fp8_weights(model)
    expected = {}
    for name, (q, s) in fp8.items():
        expected[name], expected[name[: -len("weight")] + SCALE_SUFFIX] = q, s
    expected.update({n: p for n, p in model.state_dict().items() if n not in fp8})
    return expected, set(fp8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


STREAMS = [("tiny", "gather"), ("tiny-kv2", "gather"), ("tiny-kv2", "shard")]


@pytest.mark.parametrize(("model", "mode"), STREAMS, ids=[f"{m}-{x}" for m, x in STREAMS])
def test_every_rank_streams_the_single_process_export(ranks, model, mode):
    ckpts, results, _ = ranks
    expected, fp8_names = _single_process_export(ckpts[model])
    assert len(fp8_names) == 14
    for r, res in enumerate(results):
        res = res[model][mode]
        assert "error" not in res, (r, res.get("error"))
        names = [n for n, _ in res["stream"]]
        assert len(names) == len(set(names)), f"rank {r}: a tensor streamed twice"
        stream = dict(res["stream"])
        tensors = {n: t for n, t in stream.items() if not n.endswith(DIGEST_SUFFIX)}
        assert set(tensors) == set(expected), (r, sorted(set(tensors) ^ set(expected)))
        for name, want in expected.items():
            got = tensors[name]
            assert got.dtype == want.dtype and got.shape == want.shape, (r, name, got.dtype, tuple(got.shape))
            assert torch.equal(_bits(got), _bits(want)), f"rank {r}: {name} differs from the single-process export"
            digest = decode_digest(stream[name + DIGEST_SUFFIX])
            assert digest == tensor_digest(want), f"rank {r}: {name}: digest entry is not the single-process digest"
        assert res["last_export"]["n_fp8"] == 14 and res["last_export"]["n_tensors"] == len(expected)


def test_per_shard_export_refuses_shards_off_128_row_blocks(ranks):
    _, results, _ = ranks
    for r, res in enumerate(results):
        err = res["tiny"]["shard"].get("error")
        assert err is not None, f"rank {r}: the per-shard export of 64-row k_proj shards was not refused"
        assert "model.layers.0.self_attn.k_proj.weight: N=128 is sharded into 64-row FSDP shards" in err, err
        assert "JETRL_FP8_EXPORT=gather" in err, err


def test_weights_are_sharded_along_n_across_ranks(ranks):
    _, results, _ = ranks
    for res in results:
        for model in MODELS:
            shards = res[model]["shards"]
            assert len(shards) == 14
            for name, (full, local, placements) in shards.items():
                assert placements == "(Shard(dim=0),)", (name, placements)
                assert local == (full[0] // WORLD, full[1]), (name, full, local)
    q = results[0]["tiny"]["shards"]["model.layers.0.self_attn.q_proj.weight"]
    k = results[1]["tiny"]["shards"]["model.layers.1.self_attn.k_proj.weight"]
    k2 = results[1]["tiny-kv2"]["shards"]["model.layers.1.self_attn.k_proj.weight"]
    assert (q[0], q[1]) == ((256, 256), (128, 256)) and (k[0], k[1]) == ((128, 256), (64, 256))
    assert k2[1] == (128, 256)


@pytest.mark.parametrize(("model", "mode"), STREAMS, ids=[f"{m}-{x}" for m, x in STREAMS])
def test_the_stream_never_holds_the_whole_model_gathered(ranks, model, mode):
    """Measured on both ranks. Gather mode: every parameter is gathered exactly once (fp32 masters), and at
    most two full parameters are alive at once -- the one being gathered and the previous one, which verl
    0.9.1's generator (``unfuse_moe_params``' loop variable) still references while it asks for the next.
    Shard mode: only e4m3 bytes + scales of the FP8 weights and BF16 of the rest are gathered."""
    ckpts, results, _ = ranks
    expected, fp8_names = _single_process_export(ckpts[model])
    for r, res in enumerate(results):
        g, sizes = res[model][mode]["gathered"], res[model]["param_bytes"]
        print(
            f"{model} {mode} rank {r}: {g['calls']} gathers, {g['bytes']} bytes gathered, peak {g['peak_n']} "
            f"alive = {g['peak_bytes']} bytes; the model's fp32 masters: {sum(sizes)} bytes"
        )
        if mode == "gather":
            assert g["calls"] == len(sizes) and g["bytes"] == sum(sizes), (r, g, len(sizes), sum(sizes))
            assert g["peak_n"] <= 2, f"rank {r}: {g['peak_n']} gathered parameters alive at once"
            assert g["peak_bytes"] <= sizes[0] + sizes[1], (r, g, sizes[:2])
        else:
            want = sum(
                t.nbytes if n in fp8_names or n.endswith(SCALE_SUFFIX) else t.numel() * 2 for n, t in expected.items()
            )
            assert g["bytes"] == want and g["calls"] == len(expected), (r, g, want, len(expected))
            # alive at once: at most the current and the previous entry, each a (bytes, scales) pair
            assert g["peak_n"] <= 4 and g["peak_bytes"] <= sizes[0], (r, g, sizes[0])
        assert g["peak_bytes"] < sum(sizes) / 4, (r, g["peak_bytes"], sum(sizes))


def test_a_training_pass_holds_no_full_fp8_weight_and_matches_the_cached_path(ranks):
    _, results, _ = ranks
    for r, res in enumerate(results):
        for model in MODELS:
            probe = res[model]["train"]
            assert probe["cache_weight"] and not any(probe["cache_weight"]), (r, model)
            assert probe["alive"] == [], f"rank {r} {model}: FP8 weights alive after the forward: {probe['alive']}"
            assert probe["quantizations"] == 2 * probe["linears"], (r, model, probe["quantizations"])
            assert probe["alive_cached"], f"rank {r} {model}: the probe does not see the cached path's bytes"
            shards = res[model]["shards"]
            for name, g in probe["grads_cached"].items():
                if name in shards:
                    assert tuple(g.shape) == shards[name][1], (r, name, tuple(g.shape))  # this rank's rows
                assert torch.equal(probe["grads"][name], g), f"rank {r} {model}: {name}: gradient differs"


@pytest.mark.parametrize("model", list(MODELS))
def test_export_verl_of_the_two_ranks_checkpoint_is_the_single_process_export(ranks, model, tmp_path):
    from safetensors.torch import load_file

    from jetrl.verl.export import export_checkpoint

    ckpts, _, saved = ranks
    expected, fp8_names = _single_process_export(ckpts[model])
    shards = sorted(p.name for p in (saved / model / "global_step_0" / "actor").glob("model_world_size_*"))
    assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
    written = export_checkpoint(saved / model / "global_step_0", out=tmp_path, fp8=True, log=lambda _: None)
    got = load_file(str(written["fp8"] / "model.safetensors"))
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and torch.equal(_bits(got[name]), _bits(want)), name
