"""CUDA graphs of the trainer's micro-batches (`jetrl.train.graphs`): the buckets on CPU; on an sm_90 GPU, graphed
and eager log-probs, entropies and gradients of a padded micro-batch equal bit for bit, before and after an
optimizer step."""

from __future__ import annotations

import random

import pytest
import torch

from jetrl.testing.numerics import has_sm90
from jetrl.train.graphs import MIN_WIDTH, GraphedLogprobs, bucket_shape, bucket_widths, pad_to
from jetrl.train.policy import TokenBatch, micro_batches


def test_bucket_widths_cover_every_length_with_powers_of_two_and_a_tight_top():
    assert bucket_widths(1) == [64] and bucket_widths(64) == [64] and bucket_widths(65) == [64, 128]
    assert bucket_widths(1000) == [64, 128, 256, 512, 1024] and bucket_widths(1024) == [64, 128, 256, 512, 1024]
    # a 16-token prompt + 512-token response (the e2e benchmark): a 576-wide top, not 1024
    assert bucket_widths(528) == [64, 128, 256, 512, 576]
    for n in range(1, 1100, 7):
        r, w = bucket_shape(1, n, max_rows=8, max_tokens=None)  # unbounded: powers of two
        assert r == 8 and w & (w - 1) == 0 and w >= n and (w == MIN_WIDTH or w < 2 * n)
        r, w = bucket_shape(1, n, max_rows=8, max_tokens=None, max_width=1100)
        assert w in bucket_widths(1100) and w >= n and (w == MIN_WIDTH or w < 2 * n)
    assert bucket_shape(1, 520, max_rows=8, max_tokens=None, max_width=528) == (8, 576)
    assert bucket_shape(1, 520, max_rows=64, max_tokens=4096, max_width=528) == (7, 576)  # 4096 // 513
    with pytest.raises(ValueError, match="600 tokens wide exceeds the widest bucket 576"):
        bucket_shape(1, 600, max_rows=8, max_tokens=None, max_width=528)


@pytest.mark.parametrize("max_seqs", [16, 64])
@pytest.mark.parametrize("budget", [None, 600, 2048, 5000])
def test_every_micro_batch_fits_its_bucket(budget, max_seqs):
    rng = random.Random(budget)
    for _ in range(30):
        top = rng.choice([8, 60, 560])
        lengths = [rng.randint(2, top) for _ in range(rng.randint(1, 150))]
        for mb in micro_batches(lengths, list(range(len(lengths))), max_seqs=max_seqs, max_tokens=budget):
            width = max(lengths[i] for i in mb)
            r, w = bucket_shape(len(mb), width, max_rows=max_seqs, max_tokens=budget, max_width=top + 1)
            assert len(mb) <= r <= max_seqs and width <= w
            if budget is not None and w > MIN_WIDTH:
                assert r * w < 2 * budget, (r, w, budget)  # the padding a bucket adds: < 2x the budget


def test_a_micro_batch_larger_than_its_bucket_is_named():
    with pytest.raises(ValueError, match=r"5 rows x 600 tokens does not fit its bucket of 3 rows x 1024"):
        bucket_shape(5, 600, max_rows=8, max_tokens=2048)


def test_pad_to_keeps_the_rows_on_the_left_and_masks_the_rest():
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    sub = TokenBatch(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), ids[:, 1:], None, None, None)
    pid, mask, tgt = pad_to(sub, 4, 64, pad_id=0)
    assert pid.shape == mask.shape == (4, 64) and tgt.shape == (4, 63)
    assert torch.equal(pid[:2, :3], ids) and int(pid[2:].sum()) == 0 and int(pid[:, 3:].sum()) == 0
    assert int(mask.sum()) == 7 and torch.equal(mask[2:], torch.tensor([[1] + [0] * 63] * 2))
    assert torch.equal(tgt, pid[:, 1:])


def test_no_padded_micro_batch_has_a_fully_masked_attention_row():
    """The H200 test's bf16 q/k/v wgrads were all NaN while a bucket's padding rows had mask 0 everywhere (a row
    with no key to attend to, the likely source: jetrl/train/graphs.py)."""
    for rows, width in ((1, 1), (2, 5), (3, 64)):
        ids = torch.randint(3, 60, (rows, width))
        mask = torch.ones_like(ids)
        mask[-1, 1:] = 0
        sub = TokenBatch(ids, mask, ids[:, 1:], None, None, None)
        for r, w in ((rows, 64), (rows + 3, 128)):
            _, padded, _ = pad_to(sub, r, w, pad_id=0)
            assert bool((padded.sum(1) > 0).all()), (rows, width, r, w)


def test_graphs_refuse_a_cpu_model():
    with pytest.raises(ValueError, match="algo.cuda_graphs: the model is on cpu"):
        GraphedLogprobs(torch.nn.Linear(2, 2), temperature=1.0, pad_id=0, max_rows=2, max_tokens=None, max_width=8)


def _eager_captures(monkeypatch):
    """Stand-ins for the CUDA side of `jetrl.train.graphs` on CPU: a capture runs its function once and a replay
    runs it again, so the bookkeeping around the graphs (static buffers, the autograd node of a replay, the
    gradients added to main_grad) runs as on the GPU, eagerly."""
    import jetrl.train.graphs as graphs

    def capture(fn, pool):
        assert pool == "pool"
        fn()

        def replay():  # a replay issues the captured kernels: autograd's mode inside a Function does not matter
            with torch.enable_grad():
                fn()

        return replay

    monkeypatch.setattr(graphs, "_require_cuda", lambda model: None)
    monkeypatch.setattr(graphs, "_warm_up", lambda fn, iters: [fn() for _ in range(iters)])
    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_graphs_need_the_optimizers_gradient_accumulators(monkeypatch):
    from jetrl.tiny import build_tiny_model

    _eager_captures(monkeypatch)
    with pytest.raises(ValueError, match="parameter 'model.embed_tokens.weight' has no main_grad"):
        GraphedLogprobs(build_tiny_model(0), temperature=1.0, pad_id=0, max_rows=2, max_tokens=None, max_width=8)


def test_a_capture_out_of_memory_names_the_bucket_and_the_ways_out(monkeypatch):
    import jetrl.train.graphs as graphs
    from jetrl.tiny import build_tiny_model
    from jetrl.train.policy import MixedPrecisionAdamW

    _eager_captures(monkeypatch)
    model = build_tiny_model(0)
    MixedPrecisionAdamW(model, lr=1e-3)
    g = GraphedLogprobs(model, temperature=1.0, pad_id=0, max_rows=4, max_tokens=None, max_width=100)
    real = graphs._NoGradGraph

    def no_room(fn, sample, pool):
        if sample[0].shape[1] == 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(fn, sample, pool)

    monkeypatch.setattr(graphs, "_NoGradGraph", no_room)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"bucket 4x128 \(2 of 2: \['4x64', '4x128'\]\)") as e:
        g.capture_all()
    assert "algo.cuda_graphs=false" in str(e.value) and "Tried to allocate 2.00 GiB" in str(e.value)


@pytest.mark.parametrize("recipe", ["jetrl-unified", "bf16"])
def test_plumbing_on_cpu_with_eager_stand_ins_for_the_capture(monkeypatch, recipe):
    """On CPU with `_eager_captures`: every bucket gets its own graphs, the warm-up adds nothing to the
    gradients, a micro-batch is padded to its bucket and cut back, and its log-probs and every parameter's
    main_grad (FP8 Linears' and the others', which the backward graph adds) equal eager mode's."""
    from jetrl.convert import convert_model
    from jetrl.tiny import build_tiny_model
    from jetrl.train.policy import MixedPrecisionAdamW, forward_logprobs

    _eager_captures(monkeypatch)
    model = build_tiny_model(0)
    convert_model(model, recipe, backend="emulated")
    opt = MixedPrecisionAdamW(model, lr=1e-3)
    g = GraphedLogprobs(model, temperature=1.0, pad_id=0, max_rows=4, max_tokens=None, max_width=100)
    g.capture_all()
    assert sorted(g._graphs) == [(4, 64), (4, 128)] and len({id(m) for m in g._graphs.values()}) == 2
    assert all(not p.main_grad.any() for p in opt.params), "the captures' warm-up added to the gradients"
    gen = torch.Generator().manual_seed(0)
    for rows, width in ((3, 40), (2, 90)):
        ids = torch.randint(3, 60, (rows, width), generator=gen)
        sub = TokenBatch(ids, torch.ones_like(ids), ids[:, 1:], None, None, None)
        weight = torch.rand(rows, width - 1, generator=gen)
        lp = g(sub, width)
        assert lp.shape == (rows, width - 1) and lp.requires_grad
        (lp * weight).sum().backward()
        got = [p.main_grad.clone() for p in opt.params]
        opt.zero_grad()
        assert g.bucket_of(rows, width) == g._bucket(sub, width) == (4, 64 if width <= 64 else 128)
        padded = TokenBatch(*pad_to(sub, *g.bucket_of(rows, width), 0), None, None, None)
        want_lp = forward_logprobs(model, padded)[0][:rows, : width - 1]
        assert torch.equal(lp.detach(), want_lp.detach())
        (want_lp * weight).sum().backward()
        for (name, _), a, b in zip(model.named_parameters(), got, [p.main_grad for p in opt.params], strict=True):
            assert torch.equal(a, b) and bool(a.any()), f"{name}: graphed main_grad differs from eager or is 0"
        opt.zero_grad()
        lp_ng, ent = g.no_grad(sub, width)
        assert torch.equal(lp_ng, lp.detach()) and ent.shape == lp.shape and not lp_ng.requires_grad
    assert g.replays == 4 and g._anchor.grad is None


@pytest.mark.skipif(not has_sm90(), reason="needs an sm_90 CUDA GPU (Triton FP8 kernels, DeepGEMM, CUDA graphs)")
@pytest.mark.parametrize(
    ("recipe", "fuse", "attn"),
    [
        ("jetrl-unified", False, "sdpa"),
        ("jetrl-unified", True, "sdpa"),
        ("bf16", False, "sdpa"),
        ("jetrl-unified", True, "sdpa_causal"),
        ("bf16", False, "sdpa_causal"),
    ],
)
def test_gpu_graphed_equals_eager_bit_for_bit_across_an_optimizer_step(recipe, fuse, attn):
    from jetrl.convert import convert_model
    from jetrl.linear import refresh_fp8_weights_
    from jetrl.recipe import Recipe
    from jetrl.tiny import build_tiny_model
    from jetrl.train.policy import MixedPrecisionAdamW, forward_logprobs, use_causal_sdpa

    model = build_tiny_model(0).cuda().train()
    if attn == "sdpa_causal":  # no mask in either: SDPA's causal kernels, eager and captured alike
        use_causal_sdpa(model)
    convert_model(model, Recipe.from_name(recipe), fuse=fuse)  # fuse: the RMSNorm/SwiGLU producers, graphed too
    opt = MixedPrecisionAdamW(model, lr=1e-3)
    graphed = GraphedLogprobs(model, temperature=1.0, pad_id=0, max_rows=4, max_tokens=None, max_width=100)
    graphed.capture_all()
    opt.zero_grad()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 40), generator=gen).cuda()
    am = torch.ones_like(ids)
    am[1, 30:] = 0
    sub = TokenBatch(ids, am, ids[:, 1:], None, None, None)
    weight = torch.rand(3, 39, generator=gen).cuda()

    def grads_of(logp, zero=True):
        (logp * weight).sum().backward()
        out = [p.main_grad.clone() for p in opt.params]
        if zero:
            opt.zero_grad()
        return out

    for step in range(2):
        padded = TokenBatch(*pad_to(sub, 4, 64, pad_id=0), None, None, None)
        with torch.no_grad():
            lp_ng, ent_ng = forward_logprobs(model, padded, with_entropy=True)
            g_lp, g_ent = graphed.no_grad(sub, 40)
        assert torch.equal(g_lp, lp_ng[:3, :39]) and torch.equal(g_ent, ent_ng[:3, :39]), f"step {step}: no-grad"
        eager = forward_logprobs(model, padded)[0][:3, :39]
        g_eager = grads_of(eager)
        assert all(bool(g.isfinite().all()) for g in g_eager), f"step {step}: an eager gradient is not finite"
        lp = graphed(sub, 40)
        g_graph = grads_of(lp, zero=False)
        assert torch.equal(lp.detach(), eager.detach()), f"step {step}: log-probs differ"
        for i, (a, b) in enumerate(zip(g_eager, g_graph, strict=True)):
            assert torch.equal(a, b), f"step {step}: gradient {i} differs"
        assert any(bool(g.abs().sum() > 0) for g in g_graph)
        opt.step()  # with the graphed gradients; the graphs must then see the new weights
        refresh_fp8_weights_(model)
    assert graphed.replays == 4
