"""Qwen2 / Qwen3 port vs HF transformers' PyTorch Qwen2ForCausalLM / Qwen3ForCausalLM (eager attention):
the independent reference."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import load_hf
from sprint_jax.model import from_pretrained, save_pretrained
from sprint_jax.model.qwen2 import forward

B, T = 2, 13


def _tokens(seed=0, b=B, t=T, vocab=307):
    return np.random.default_rng(seed).integers(3, vocab, (b, t))


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_tied", "hf_qwen3_untied", "hf_qwen3_tied"])
def test_logits_match_hf_fp32(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = load_hf(path)
    ours = from_pretrained(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    toks = _tokens()
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.numpy()
    got = np.asarray(ours(toks))
    err = np.abs(got - ref).max()
    print(f"{fixture} fp32 max abs diff {err:.2e}")
    assert err <= 1e-4


def test_logits_match_hf_with_padding_and_segments(hf_untied):
    hf = load_hf(hf_untied)
    ours = from_pretrained(hf_untied)
    toks = _tokens(1)
    # right padding on row 0 (last 4 tokens pad), none on row 1
    mask = np.ones((B, T), np.int64)
    mask[0, -4:] = 0
    with torch.no_grad():
        ref = hf(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.numpy()
    got = np.asarray(ours(toks, segment_ids=jnp.asarray(mask)))
    valid = mask.astype(bool)
    err = np.abs(got - ref)[valid].max()
    assert err <= 1e-4

    # two packed segments in one row == each run alone (positions restart per segment)
    a, b = _tokens(2, 1, 7)[0], _tokens(3, 1, 6)[0]
    packed = np.concatenate([a, b])[None]
    seg = np.array([[1] * 7 + [2] * 6])
    pos = np.array([list(range(7)) + list(range(6))])
    got = np.asarray(ours(packed, positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg)))
    with torch.no_grad():
        ra = hf(torch.tensor(a[None])).logits.numpy()[0]
        rb = hf(torch.tensor(b[None])).logits.numpy()[0]
    assert np.abs(got[0, :7] - ra).max() <= 1e-4
    assert np.abs(got[0, 7:] - rb).max() <= 1e-4


def test_bf16_load_computes_in_bf16_and_matches_hf_bf16(hf_untied):
    """from_pretrained(param_dtype=bf16, compute_dtype=bf16) holds, computes and caches in bf16
    (nothing patched afterwards), and its logits match HF's bf16 model element by element."""
    from conftest import tiny_vocab_tokenizer
    from sprint_jax.infer.engine import Engine

    ours = from_pretrained(hf_untied, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    toks = _tokens(4)
    assert {x.dtype for x in jax.tree.leaves(ours.params)} == {jnp.dtype(jnp.bfloat16)}
    hidden = jax.eval_shape(lambda p, t: forward(p, ours.config, t, return_hidden=True), ours.params, toks)
    assert hidden.dtype == jnp.bfloat16                       # the residual stream, not only the weights
    engine = Engine(ours, tiny_vocab_tokenizer(), max_seqs=1, max_children=1, max_seq_len=32, prefill_chunk=16)
    engine.run([engine.open(toks[0].tolist())])
    assert {a.dtype for a in jax.tree.leaves(engine.cache)} == {jnp.dtype(jnp.bfloat16)}
    # the default is float32 throughout, whatever the checkpoint's files store
    plain = from_pretrained(hf_untied)
    assert (plain.config.param_dtype, plain.config.dtype) == ("float32", "float32")

    hf = load_hf(hf_untied, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = hf(torch.tensor(toks)).logits.float().numpy()
        ref32 = load_hf(hf_untied)(torch.tensor(toks)).logits.numpy()
    got = np.asarray(ours(toks))
    print(f"bf16 max abs diff {np.abs(got - ref).max():.3e}; hf bf16 vs fp32 {np.abs(ref - ref32).max():.3e}")
    # per element: both round to bf16 (8 significant bits) at every layer, in different places;
    # HF bf16 itself is ~0.04 from fp32 on these logits (magnitude <= ~3)
    np.testing.assert_allclose(got, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_qwen3_tied"])
def test_greedy_generation_matches_hf_generate(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = load_hf(path)
    ours = from_pretrained(path)
    prompt = _tokens(5, 1, 7)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=20).numpy()[0, 7:]
    seq = list(prompt[0])
    fwd = jax.jit(lambda p, t: forward(p, ours.config, t))
    buf = np.zeros((1, 7 + 20), np.int32)  # right padding: causal, so it never reaches earlier rows
    for _ in range(20):  # plain full recompute, no cache; one compiled shape
        buf[0, :len(seq)] = seq
        logits = fwd(ours.params, jnp.asarray(buf))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    assert seq[7:] == list(ref)


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_qwen3_untied", "hf_qwen3_tied"])
def test_round_trip_bit_identical_and_transformers_loads(fixture, request, tmp_path):
    from safetensors.numpy import load_file

    src = request.getfixturevalue(fixture)
    ours = from_pretrained(src)
    out = tmp_path / "export"
    save_pretrained(ours, out)
    a = load_file(src / "model.safetensors")
    b = load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert out_cfg["model_type"] == src_cfg["model_type"]
    assert out_cfg["architectures"] == src_cfg["architectures"]
    hf1, hf2 = load_hf(src), load_hf(out)
    assert type(hf2) is type(hf1)
    for key in ("tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        assert getattr(hf2.config, key) == getattr(hf1.config, key), key
    assert hf2.model.layers[0].self_attn.head_dim == hf1.model.layers[0].self_attn.head_dim
    toks = _tokens(6)
    with torch.no_grad():
        assert np.array_equal(hf2(torch.tensor(toks)).logits.numpy(), hf1(torch.tensor(toks)).logits.numpy())


def test_sharded_export_with_index(hf_tied, tmp_path):
    ours = from_pretrained(hf_tied)
    out = tmp_path / "sharded"
    save_pretrained(ours, out, max_shard_size="60KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = from_pretrained(out)
    for x, y in zip(jax.tree.leaves(ours.params), jax.tree.leaves(back.params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    hf2 = load_hf(out)
    toks = _tokens(7)
    with torch.no_grad():
        ref = hf2(torch.tensor(toks)).logits.numpy()
    assert np.abs(np.asarray(back(toks)) - ref).max() <= 1e-4


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_qwen3_tied"])
def test_gradients_match_hf_backward(fixture, request, tmp_path):
    """The training gradient (flash attention under the span rule, the SwiGLU's own backward,
    everything else autodiff) == HF torch's autograd through its eager model, for every
    parameter: the mean next-token cross-entropy of a batch, both sides in fp32."""
    from safetensors.numpy import load_file

    from sprint_jax.model import save_params
    from sprint_jax.model.qwen2 import swiglu

    path = request.getfixturevalue(fixture)
    hf = load_hf(path)
    ours = from_pretrained(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    toks = _tokens(seed=5, t=21)
    span_end = np.full(toks.shape, toks.shape[1], np.int32)

    def loss(params):
        logits = forward(params, ours.config, jnp.asarray(toks), span_end=jnp.asarray(span_end))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(toks)[:, 1:, None], axis=-1))

    value, grads = jax.value_and_grad(loss)(ours.params)
    save_params(ours.config, jax.device_get(grads), tmp_path / "grads")
    got = {}
    for f in (tmp_path / "grads").glob("*.safetensors"):
        got.update(load_file(f))
    hf.train()
    ref_loss = hf(torch.tensor(toks), labels=torch.tensor(toks)).loss
    ref_loss.backward()
    assert abs(float(value) - ref_loss.item()) <= 1e-5
    named = dict(hf.named_parameters())
    assert set(got) == set(named), set(got) ^ set(named)
    for name, p in named.items():
        ref = p.grad.numpy()
        err = np.abs(got[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert err <= 1e-4, (name, err)
    # the SwiGLU backward against torch's autograd of the plain formula, bf16 inputs included
    # (its backward computes in fp32 and rounds once; torch's bf16 autograd rounds each step)
    rng = np.random.default_rng(0)
    g, u, dy = (rng.standard_normal((7, 33)).astype(np.float32) * 3 for _ in range(3))
    for dt, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        out, vjp = jax.vjp(swiglu, jnp.asarray(g, dt), jnp.asarray(u, dt))
        dg, du = vjp(jnp.asarray(dy, dt))
        tg, tu = (torch.tensor(np.asarray(jnp.asarray(x, dt).astype(jnp.float32))).requires_grad_() for x in (g, u))
        tout = torch.nn.functional.silu(tg) * tu
        tout.backward(torch.tensor(np.asarray(jnp.asarray(dy, dt).astype(jnp.float32))))
        for a, b in ((out, tout.detach()), (dg, tg.grad), (du, tu.grad)):
            b = b.numpy()
            assert np.abs(np.asarray(a.astype(jnp.float32)) - b).max() <= tol * max(np.abs(b).max(), 1.0)
