"""P-GRPO pieces: reward and advantages by hand, the trie layout of units, the loss gradient against
each unit run alone through the plain forward, and one update moving log-probs the right way."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from sprint_jax.rl.reward import RewardConfig, acceleration, group_advantages, reward


# ---------------------------------------------------------------------------------------------
# Reward and advantage, hand-computed
# ---------------------------------------------------------------------------------------------
def test_reward_hand_computed():
    cfg = RewardConfig()                                   # rho 0.5, clip 0.2
    assert acceleration(60, 100) == pytest.approx(0.4)
    assert reward(True, 60, 100, cfg) == pytest.approx((1.2, 0.4, 0.2))       # 0.5*0.4 = 0.2 = clip
    assert reward(True, 80, 100, cfg) == pytest.approx((1.1, 0.2, 0.1))       # 0.5*0.2 = 0.1
    assert reward(True, 30, 100, cfg) == pytest.approx((1.2, 0.7, 0.2))       # 0.35 clipped to 0.2
    assert reward(False, 30, 100, cfg) == pytest.approx((0.0, 0.7, 0.0))      # no bonus when wrong
    assert reward(True, 50, 50, cfg) == pytest.approx((1.0, 0.0, 0.0))        # sequential: eta 0
    assert reward(True, 0, 0, cfg)[0] == 1.0
    assert reward(True, 50, 100, RewardConfig(rho=1.0, rho_clip=0.3))[0] == pytest.approx(1.3)
    assert reward(True, 50, 100, RewardConfig(rho=0.0))[0] == 1.0             # the RFT-side recipe


def test_group_advantages_hand_computed():
    cfg = RewardConfig()
    np.testing.assert_allclose(group_advantages([1.2, 1.1, 1.2, 1.0], cfg), [0.075, -0.025, 0.075, -0.125])
    np.testing.assert_array_equal(group_advantages([0.0] * 4, cfg), [0.0] * 4)              # none correct
    np.testing.assert_allclose(group_advantages([1.1] * 4, cfg), [0.0] * 4, atol=1e-12)     # all correct, same eta
    np.testing.assert_allclose(group_advantages([1.2, 0.0, 1.0, 0.0], cfg), [0.65, -0.55, 0.45, -0.55])  # mixed
    a = group_advantages([1.0, 0.0, 0.0, 0.0], RewardConfig(std_normalise=True))
    np.testing.assert_allclose(a, np.array([0.75, -0.25, -0.25, -0.25]) / (np.sqrt(3) / 4 + 1e-6))


# ---------------------------------------------------------------------------------------------
# Units -> token trie
# ---------------------------------------------------------------------------------------------
def _stage_units():
    """A SPRINT-shaped trajectory: planner 1, two executors (one ends with EOS=2), planner 2."""
    from sprint_jax.rl.rollout import Unit

    prompt, plan, o1, o2 = [5, 6, 7], [10, 11, 12], [20], [21]
    b1, b2 = [30, 31], [40, 41, 42, 2]
    repair = [22]
    sync = o1 + b1 + o2 + b2[:-1] + repair
    return [Unit(prompt, plan, "planner"), Unit(prompt + plan + o1, b1, "executor"),
            Unit(prompt + plan + o2, b2, "executor"), Unit(prompt + plan + sync, [50, 51, 2], "planner")]


def test_layout_units_is_the_trie_of_the_calls():
    from sprint_jax.rl.layout import layout_units

    units = _stage_units()
    it = layout_units(units, 0.5)
    # every unit's path appears as an ancestor chain; every generated token is one node with loss
    n_generated = sum(len(u.completion) for u in units)
    assert int(it.mask.sum()) == n_generated
    assert np.all(it.advantages[it.mask > 0] == np.float32(0.5)) and np.all(it.advantages[it.mask == 0] == 0)
    for u in units:
        path = u.context + u.completion
        # walk down the trie along the path: each row's parent is the previous row, positions = depth
        rows = []
        for k, t in enumerate(path):
            cands = [r for r in range(len(it)) if it.tokens[r] == t and it.positions[r] == k
                     and (it.parents[r] == (rows[-1] if rows else -1))]
            assert len(cands) == 1, (path, k)
            rows.append(cands[0])
        for r in rows:      # ancestor-only visibility: every earlier row of the path is visible to r
            for a in rows[: rows.index(r)]:
                assert a <= r < it.span_end[a]
        assert all(it.mask[r] == 1 for r in rows[len(u.context):])
        generated_elsewhere = {t for v in units if v is not u for t in v.completion}
        assert all(it.mask[r] == 0 for r in rows[:len(u.context)] if it.tokens[r] not in generated_elsewhere)
    # executor 1's body is planner 2's context: the same rows, predicted once
    assert len(it) == len(set(map(tuple, [(t, p, q) for t, p, q in zip(it.tokens, it.positions, it.parents)])))
    # siblings never see each other: executor 2's rows are outside executor 1's spans
    r_b1 = [r for r in range(len(it)) if it.tokens[r] == 30][0]
    r_b2 = [r for r in range(len(it)) if it.tokens[r] == 40 and it.tokens[it.parents[r]] == 21 and it.positions[r] == 7]
    assert len(r_b2) == 1
    r_b2 = r_b2[0]
    # executor 2's body also appears in planner 2's context (after executor 1): there it is context
    in_trunk = [r for r in range(len(it)) if it.tokens[r] == 40 and r != r_b2]
    assert len(in_trunk) == 1 and it.mask[in_trunk[0]] == 0 and it.mask[r_b2] == 1
    assert not (r_b1 <= r_b2 < it.span_end[r_b1]) and not (r_b2 <= r_b1 < it.span_end[r_b2])


# ---------------------------------------------------------------------------------------------
# Loss gradient vs each unit alone through qwen2.forward
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    import jax
    from sprint_jax.model.config import Qwen2Config
    from sprint_jax.model import qwen2
    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    cfg = Qwen2Config(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=128,
                      rope_theta=10000.0, tie_word_embeddings=False, param_dtype="float32", dtype="float32")
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    setup = step_lib.build_step(cfg, OptimSection(lr=3e-3, clip_norm=0.0, b2=0.99), 10, mesh)
    params = qwen2.init_params(cfg, jax.random.key(3), std=0.3)
    return cfg, setup, params


def _unit_logp_sum(params, cfg, unit, temperature):
    """sum of log p(completion token) for one unit run alone, plain causal forward, positions 0..n-1."""
    import jax.numpy as jnp

    seq = jnp.asarray([unit.context + unit.completion], jnp.int32)
    return _logp_sum(params, cfg, seq, len(unit.context), temperature)


@functools.partial(jax.jit, static_argnums=(1, 3, 4))
def _logp_sum(params, cfg, seq, c, temperature):
    # jitted: one compile per sequence length, reused by the same unit's later calls (run eagerly,
    # every call would compile the forward's layer scan again)
    import jax.numpy as jnp
    from sprint_jax.model import qwen2

    logits = qwen2.forward(params, cfg, seq)[0] / temperature                   # [n, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    idx = jnp.arange(c, seq.shape[1])
    return jnp.sum(logp[idx - 1, seq[0, idx]])


def _batch(units_by_traj, advs, seq_len=64, rows=2):
    from sprint_jax.rl.layout import layout_units, pack_items
    items = [layout_units(u, a) for u, a in zip(units_by_traj, advs)]
    return pack_items(items, seq_len, rows, pad_token=0)


def _second_traj():
    from sprint_jax.rl.rollout import Unit
    return [Unit([5, 6, 7], [13, 14, 15, 16, 2], "planner")]     # a sequential run of the same prompt


def test_loss_gradient_equals_per_unit_reference(tiny):
    import jax
    import jax.numpy as jnp
    from sprint_jax.rl.loss import LossSettings, build_rl_step

    cfg, setup, params = tiny
    temp = 0.7
    trajs, advs = [_stage_units(), _second_traj()], [0.6, -0.4]
    packed = _batch(trajs, advs)
    rl = build_rl_step(setup, LossSettings(temperature=temp), with_old=False, with_ref=False)
    n = sum(len(u.completion) for t in trajs for u in t)
    assert packed.loss_tokens == n
    mb = {k: v[0] for k, v in packed.arrays.items()}
    zeros = jnp.zeros(mb["tokens"].shape, jnp.float32)
    (loss, aux), grads = rl.grad(params, mb, jnp.float32(n), zeros, zeros)

    def reference(p):
        tot = 0.0
        for units, a in zip(trajs, advs):
            for u in units:
                tot = tot + a * _unit_logp_sum(p, cfg, u, temp)
        return -tot / n
    ref_grads = jax.jit(jax.grad(reference))(params)
    # on-policy the ratio is 1: the loss value is -sum(A over completion tokens) / N
    expected = -sum(a * sum(len(u.completion) for u in t) for t, a in zip(trajs, advs)) / n
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-7)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-6)
    # and the log-probs themselves: sum over the batch == sum over the units alone
    ref_lp = sum(float(_unit_logp_sum(params, cfg, u, temp)) for t in trajs for u in t)
    assert float(aux["logp_sum"]) == pytest.approx(ref_lp, rel=1e-5)


def test_one_update_raises_positive_and_lowers_negative(tiny):
    import jax
    from sprint_jax.rl.loss import LossSettings, build_rl_step, update

    cfg, setup, params = tiny
    trajs, advs = [_stage_units(), _second_traj()], [0.5, -0.5]
    packed = _batch(trajs, advs)
    rl = build_rl_step(setup, LossSettings(temperature=1.0), with_old=False, with_ref=False)
    state = setup.init_state(0, params=jax.tree.map(lambda x: x.copy(), params))
    before = [sum(float(_unit_logp_sum(params, cfg, u, 1.0)) for u in t) for t in trajs]
    state, m = update(rl, state, packed.arrays, 1)
    after = [sum(float(_unit_logp_sum(state["params"], cfg, u, 1.0)) for u in t) for t in trajs]
    assert after[0] > before[0] + 1e-3, (before, after)        # positive advantage: more likely
    assert after[1] < before[1] - 1e-3, (before, after)        # negative advantage: less likely
    assert m["clip_frac"] == 0.0 and m["update_loss_tokens"] == packed.loss_tokens


def test_ppo_form_with_old_logp_equal_to_current_is_reinforce(tiny):
    """Several updates per batch use the clipped ratio against logp_old; at the first update
    (logp_old = current policy) the gradient equals the on-policy REINFORCE gradient."""
    import jax
    from sprint_jax.rl.loss import LossSettings, build_rl_step

    cfg, setup, params = tiny
    packed = _batch([_stage_units(), _second_traj()], [0.3, -0.3])
    mb = {k: v[0] for k, v in packed.arrays.items()}
    s = LossSettings(temperature=1.0, clip_eps=0.2)
    on = build_rl_step(setup, s, with_old=False, with_ref=False)
    ppo = build_rl_step(setup, s, with_old=True, with_ref=False)
    old = ppo.logp(params, mb)
    zeros = old * 0
    (_, _), g_on = on.grad(params, mb, jax.numpy.float32(10), zeros, zeros)
    (_, aux), g_ppo = ppo.grad(params, mb, jax.numpy.float32(10), old, zeros)
    for a, b in zip(jax.tree.leaves(g_on), jax.tree.leaves(g_ppo)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-6)  # logp_old from another jit: ulps
    # ratio far above 1 + eps with positive advantages: every token is clipped, no gradient at all
    pos = {k: v[0] for k, v in _batch([_stage_units(), _second_traj()], [0.3, 0.2]).arrays.items()}
    (_, aux2), g_far = ppo.grad(params, pos, jax.numpy.float32(10), ppo.logp(params, pos) - 5.0, zeros)
    assert float(aux2["clipped_tokens"]) == packed.loss_tokens
    assert max(float(abs(x).max()) for x in jax.tree.leaves(g_far)) == 0.0
    assert max(float(abs(x).max()) for x in jax.tree.leaves(g_ppo)) > 0.0


def test_reference_kl_k3(tiny):
    """Optional KL (k3 estimator) to a frozen reference: zero with gradient zero at the reference,
    exp(-1) per token when the reference's log-probs are 1 lower everywhere."""
    import jax
    import jax.numpy as jnp
    from sprint_jax.rl.loss import LossSettings, build_rl_step

    cfg, setup, params = tiny
    pos = {k: v[0] for k, v in _batch([_stage_units(), _second_traj()], [0.0, 0.0]).arrays.items()}
    n = int(pos["mask"].sum())
    rl = build_rl_step(setup, LossSettings(kl_coef=0.5), with_old=False, with_ref=True)
    ref = rl.logp(params, pos)
    zeros = ref * 0
    (loss, aux), g = rl.grad(params, pos, jnp.float32(n), zeros, ref)
    assert abs(float(aux["kl_sum"])) < 1e-4 and abs(float(loss)) < 1e-5
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) < 1e-5
    (loss, aux), g = rl.grad(params, pos, jnp.float32(n), zeros, ref - 1.0)
    assert float(aux["kl_sum"]) == pytest.approx(n * np.exp(-1.0), rel=1e-4)
    assert float(loss) == pytest.approx(0.5 * np.exp(-1.0), rel=1e-4)


def test_token_logprobs_over_the_tokenizers_ids(tiny):
    """With n_valid the log-probs are those of the engines' sampling distribution: a softmax over the
    tokenizer's ids only (reference: plain forward, logits sliced to the first n_valid ids)."""
    import jax
    import jax.numpy as jnp
    from sprint_jax.model import qwen2
    from sprint_jax.rl.loss import token_logprobs

    cfg, _, params = tiny
    n_valid, temp = 53, 0.8                                   # 61 ids in the model, 8 of them padding
    units = _second_traj()
    mb = {k: jnp.asarray(v[0]) for k, v in _batch([units], [1.0]).arrays.items()}
    lp = token_logprobs(params, cfg, mb, temp, n_valid=n_valid)
    u = units[0]
    seq = jnp.asarray([u.context + u.completion], jnp.int32)
    ref = jax.nn.log_softmax(qwen2.forward(params, cfg, seq)[0, :, :n_valid] / temp, axis=-1)
    c = len(u.context)
    want = [float(ref[c - 1 + k, t]) for k, t in enumerate(u.completion)]
    got = np.asarray(lp)[np.asarray(mb["mask"]) > 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    full = np.asarray(token_logprobs(params, cfg, mb, temp))[np.asarray(mb["mask"]) > 0]
    assert np.all(full < got)                                 # the padded ids did hold mass


def test_sampling_never_yields_a_padded_id(tiny):
    """Sampled at temperature 50 (near uniform over 61 ids, 7 of them padding: without the mask a
    padded id would come up in ~1 of 9 draws), the engine only ever emits ids the tokenizer knows:
    generate rows decoding together, and the children of a fork."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.sampling import Sampling
    from sprint_jax.infer.single import SingleRun
    from sprint_jax.model.tokenizer import VocabTokenizer

    cfg, _, params = tiny
    vocab = ["<pad>", "<eos>"] + [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
    tok = VocabTokenizer(vocab, eos_token="<eos>", pad_token="<pad>")       # 54 ids: 54..60 are padding
    n = len(tok)

    class Model:
        config, params = None, None
    model = Model()
    model.config, model.params = cfg, params
    prompt = tok.encode("abc")
    eng = Engine(model, tok, max_seqs=4, max_children=2, max_seq_len=96, max_branch_tokens=48, eos_token_ids=[1])
    seen = []
    for seed in (7, 8):
        seqs = [eng.open(prompt).seq for _ in range(4)]
        ops = [eng.generate(s, 40, sampling=Sampling(temperature=50.0, seed=seed + 10 * k)) for k, s in enumerate(seqs)]
        eng.run(ops)
        seen += [t for op in ops for t in op.result.tokens]
        for s in seqs:
            eng.close(s)
    run = SingleRun(eng)
    gens = run.decode_branches(run.prefill(prompt), [[2], [3]], 30, sampling=Sampling(temperature=50.0, seed=3))
    seen += [t for g in gens for t in g.tokens]
    assert len(seen) > 60 and max(seen) < n
    assert len(set(seen)) > 20                                # the high temperature did spread the draws


def test_keyed_chains_hand_computed():
    """Keyed chains (the RL demo's task): a chain by hand, answers, disjoint held-out problems, and
    SFT examples of every plan shape that parse back with the chains in order."""
    from sprint_jax import format as fmt
    from sprint_jax.rl import keyed

    # digit map (tasks/chains.py): 3 -> 9 -> 1 -> 5; key 1101 = map, map, copy, map
    assert keyed.chain(3, "1101") == "39115"
    assert keyed.chain(3, "0000") == "33333"
    assert keyed.chain(0, "1101") == "07339"                  # 0 -> 7 -> 3, copy, -> 9
    assert keyed.solve([3, 0], "1101") == 9 and keyed.solve([3], "1101") == 5
    train, held = keyed.split(200, 50, length=6)
    assert not {(tuple(t.answer["starts"]), t.answer["key"]) for t in train} & \
        {(tuple(t.answer["starts"]), t.answer["key"]) for t in held}
    t = train[0]
    assert keyed.prompt_for(t) == "Q: " + " ".join(map(str, t.answer["starts"])) + f" : {t.answer['key']}\n"
    for shape in keyed.SHAPES:
        traj, problems = fmt.parse_completion(keyed.sprint_completion(t, shape))
        assert not problems
        assert [len(st.executions) for st in traj.stages] == list(shape) + [0]
        assert [e for st in traj.stages for e in st.executions] == [keyed.chain(s, t.answer["key"])
                                                                    for s in t.answer["starts"]]
        assert traj.final_answer == str(t.answer["value"])
    rec = {"stages": [{"executions": [{"text": keyed.chain(s, t.answer["key"]) + " </execution_1.1>"}]}
                      for s in t.answer["starts"]], "final_answer": str(t.answer["value"])}
    assert keyed.execution_quality([rec], [t]) == {"executions_exact": 1.0, "answer_matches_executions": 1.0}
    rec["stages"][0]["executions"][0]["text"] = "12"
    assert keyed.execution_quality([rec], [t])["executions_exact"] == 0.75


def test_keyed_shape_weights(tmp_path):
    """SFT plan shapes drawn with weights: a pure function of the task id, the drawn frequencies follow
    the weights (binomial bounds), a zero weight never draws its shape, no weights keeps the uniform
    draw, and the written SPRINT set uses the drawn shapes. Bad weights: one line, exit 2."""
    from collections import Counter

    from sprint_jax import format as fmt
    from sprint_jax.rl import keyed

    tasks, _ = keyed.split(3000, 0)
    w = keyed.parse_weights("1,2,4")
    assert w == (1.0, 2.0, 4.0) and keyed.parse_weights("") is None
    drawn = [keyed.shape_of(t, weights=w) for t in tasks]
    assert drawn == [keyed.shape_of(t, weights=w) for t in tasks]                     # deterministic
    c = Counter(drawn)
    for shape, p in zip(keyed.SHAPES, (1 / 7, 2 / 7, 4 / 7)):
        sd = np.sqrt(3000 * p * (1 - p))
        assert abs(c[shape] - 3000 * p) < 4 * sd, (shape, c[shape], 3000 * p)
    assert (4,) not in {keyed.shape_of(t, weights=(0.0, 1.0, 1.0)) for t in tasks}
    # without weights: uniform over the shapes, the draw the shipped config was trained with
    import random
    assert [keyed.shape_of(t) for t in tasks[:50]] == [keyed.SHAPES[random.Random(t.id).randrange(3)]
                                                       for t in tasks[:50]]
    paths = keyed.write_sft_data(tasks[:40], tmp_path, w)
    import json
    rows = [json.loads(x) for x in paths["sprint"].read_text().splitlines()]
    for t, row in zip(tasks[:40], rows):
        traj, _ = fmt.parse_completion(row["completion"])
        assert tuple(len(st.executions) for st in traj.stages[:-1]) == keyed.shape_of(t, weights=w)
    for bad in ("1,2", "a,b,c", "-1,1,1", "0,0,0"):
        with pytest.raises(ValueError):
            keyed.parse_weights(bad)
    with pytest.raises(SystemExit) as e:
        keyed.main(["--out", str(tmp_path / "x"), "--shape-weights", "1,2"])
    assert e.value.code == 2


def test_length_parts_hand_computed():
    """The sequential tokens split into planner and critical-path executor tokens, on a hand-built run:
    stage 1 plans 5 tokens, executors 7 and 4; stage 2 plans 3, executor 6; final call 2 tokens."""
    from sprint_jax.infer.orchestrator import ExecutionRecord, RunRecord, StageRecord
    from sprint_jax.rl.trainer import length_parts, mean_parts

    ex = lambda n: ExecutionRecord(index=1, prompt="p", text="t", tokens=n, stop_reason="stop", forced_tokens=1)  # noqa: E731
    rec = RunRecord(query="q", mode="parallel", config={}, final_tokens=2,
                    stages=[StageRecord(1, "", 5, "stop", executions=[ex(7), ex(4)]),
                            StageRecord(2, "", 3, "stop", executions=[ex(6)]),
                            StageRecord(3, "", 4, "stop")])
    want = {"planner_tokens": 5 + 3 + 4 + 2, "executor_critical_tokens": 7 + 6, "executor_tokens": 17,
            "executor_stages": 2}
    assert length_parts(rec) == want
    assert length_parts(rec.to_json()) == want
    assert want["planner_tokens"] + want["executor_critical_tokens"] == rec.sequential_tokens == 27
    assert want["planner_tokens"] + want["executor_tokens"] == rec.total_tokens == 31
    assert mean_parts([rec, rec.to_json()], "eval_")["eval_executor_critical_tokens"] == 13.0


def test_shape_metrics_hand_computed():
    """Plan shapes and per-shape accuracy on hand-built runs: two 1+1 runs (one right), one 2-in-one
    run (right), one run without executors (wrong); the RunRecord and its json agree, and the
    shape-weighted accuracy is the overall accuracy."""
    from sprint_jax.infer.orchestrator import ExecutionRecord, RunRecord, StageRecord
    from sprint_jax.rl.trainer import plan_shape, shape_metrics

    ex = ExecutionRecord(index=1, prompt="p", text="t", tokens=3, stop_reason="stop", forced_tokens=1)

    def run(*counts):
        stages = [StageRecord(i + 1, "", 2, "stop", executions=[ex] * n) for i, n in enumerate(counts)]
        return RunRecord(query="q", mode="parallel", config={}, final_tokens=1, stages=stages)

    runs = [run(1, 1, 0), run(2, 0), run(1, 1, 0), run(0)]
    correct = [True, True, False, False]
    assert [plan_shape(r) for r in runs] == ["1+1", "2", "1+1", "none"]
    assert [plan_shape(r.to_json()) for r in runs] == ["1+1", "2", "1+1", "none"]
    want = {"shape_frac/1+1": 0.5, "shape_acc/1+1": 0.5, "shape_frac/2": 0.25, "shape_acc/2": 1.0,
            "shape_frac/none": 0.25, "shape_acc/none": 0.0}
    assert shape_metrics(runs, correct) == want
    assert shape_metrics([r.to_json() for r in runs], correct, "eval_") == {"eval_" + k: v for k, v in want.items()}
    m = shape_metrics(runs, correct)
    assert sum(m[f"shape_frac/{s}"] * m[f"shape_acc/{s}"] for s in ("1+1", "2", "none")) == sum(correct) / len(correct)
    with pytest.raises(ValueError):
        shape_metrics(runs, correct[:3])


def test_keyed_digits_combine():
    """The `digits` combining plan lists the chains' last digits in chain order (by hand), parses for
    every plan shape, tokenizes losslessly in the keyed vocabulary, and the answer is their max."""
    from sprint_jax import format as fmt
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.rl import keyed
    from sprint_jax.tasks.types import Task

    t = Task(id="k", kind="chains", problem="", answer={"starts": [3, 0], "length": 4, "key": "1101", "value": 9})
    assert keyed.combine_text(t, "digits") == "Last digits: 5 9"          # 39115, 07339
    assert keyed.combine_text(t) == keyed.chains.COMBINE
    with pytest.raises(ValueError):
        keyed.combine_text(t, "sum")
    tok = VocabTokenizer(keyed.vocabulary(), eos_token="<eos>", pad_token="<pad>")
    task = keyed.split(3, 0)[0][0]
    for shape in keyed.SHAPES:
        c = keyed.sprint_completion(task, shape, "digits")
        traj, problems = fmt.parse_completion(c)
        assert not problems and traj.final_answer == str(task.answer["value"])
        lasts = [int(keyed.chain(s, task.answer["key"])[-1]) for s in task.answer["starts"]]
        assert traj.stages[-1].plan == ["Last digits: " + " ".join(map(str, lasts))]
        assert max(lasts) == task.answer["value"]
        assert tok.decode(tok.encode(c)) == c
    with pytest.raises(SystemExit) as e:
        keyed.main(["--out", "/nonexistent/x", "--combine", "sum"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------
# Config ranges and task sets that cannot exist: one line naming the field, before any work
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,bad,low", [
    ("tasks.n", 0, 1), ("tasks.eval_n", -1, 0), ("tasks.chains", 0, 1), ("tasks.chain_length", 0, 1),
    ("policy.loss_chunk", -1, 0), ("rollout.prompts_per_step", 0, 1), ("rollout.concurrency", -1, 0),
    ("rollout.max_seq_len", 1, 2), ("rollout.decode_chunk", 0, 1), ("rollout.prefill_chunk", 0, 1),
    ("loss.seq_len", 1, 2), ("loss.rows_per_micro", 0, 1), ("loss.updates_per_batch", 0, 1),
    ("loss.kl_coef", -0.5, 0), ("eval.every", -1, 0), ("steps", 0, 1), ("seed", -1, 0),
])
def test_rl_config_rejects_out_of_range_fields(field, bad, low):
    from sprint_jax.config import ConfigError, load_config
    from sprint_jax.rl.config import RLConfig

    with pytest.raises(ConfigError, match=rf"^{field} must be >= {low}, got {bad}$"):
        load_config(RLConfig, None, [f"{field}={bad}"])
    load_config(RLConfig, None, [f"{field}={low}"])                 # the bound itself is accepted


def test_rl_cli_rejects_a_zero_chain_count_in_one_line(tmp_path, capsys):
    """`--set tasks.chains=0` used to end in the task generator's traceback."""
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")            # never read: the config is refused first
    rc = main(["rl", "--config", str(CONFIG_DIR / "rl_tiny_cpu.yaml"), "--out", str(tmp_path / "out"),
               "--set", f"policy.path={tmp_path / 'model'}", "--set", "tasks.chains=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "tasks.chains must be >= 1, got 0" in err[0]
    assert not (tmp_path / "out").exists()


def _never_loop_forever(monkeypatch, module, space):
    """Wrap `module.generate` so that a call asking for problems outside an `exclude` set that holds
    every possible problem (`space(args)` of them) fails at once instead of drawing forever."""
    real = module.generate

    def generate(n, *args, exclude=None, **kw):
        assert not (n and exclude is not None and len(exclude) >= space(*args)), \
            "asked for held-out problems outside a set that holds every problem: this draws forever"
        return real(n, *args, exclude=exclude, **kw)
    monkeypatch.setattr(module, "generate", generate)


def test_held_out_tasks_that_cannot_be_disjoint_are_refused(monkeypatch):
    """1 chain has 10 start tuples and 1 chain of 2 key bits 40 (starts, key) pairs: 300 training
    problems use them all, so the disjoint held-out set used to be drawn forever."""
    from sprint_jax.config import ConfigError, load_config
    from sprint_jax.rl import keyed
    from sprint_jax.rl.config import RLConfig
    from sprint_jax.rl.trainer import load_tasks
    from sprint_jax.tasks import chains

    _never_loop_forever(monkeypatch, chains, lambda seed, lo, hi, length: 10 ** hi)
    _never_loop_forever(monkeypatch, keyed, lambda seed, n_chains, length: 10 ** n_chains * 2 ** length)
    sets = ["tasks.n=300", "tasks.chains=1", "tasks.chain_length=2", "tasks.eval_n=5"]
    with pytest.raises(ConfigError, match=r"^tasks: the 300 training problems use all 10 start digit tuples"):
        load_tasks(load_config(RLConfig, None, sets + ["tasks.source=chains"]))
    with pytest.raises(ConfigError, match=r"^tasks: the 300 training problems use all 40 \(starts, key\) pairs"):
        load_tasks(load_config(RLConfig, None, sets + ["tasks.source=keyed_chains"]))
    for source in ("chains", "keyed_chains"):                       # no held-out set asked for: fine
        train, held = load_tasks(load_config(RLConfig, None, sets + [f"tasks.source={source}", "tasks.eval_n=0"]))
        assert len(train) == 300 and held == []
    train, held = load_tasks(load_config(RLConfig, None, ["tasks.n=300", "tasks.chains=3", "tasks.eval_n=5"]))
    seen = {tuple(t.answer["starts"]) for t in train}
    assert len(held) == 5 and not seen & {tuple(t.answer["starts"]) for t in held}
