"""Log-probs of a ThreadWeaver-format policy (a tiny model trained here in the merge layout on
2-chain digit problems written in ThreadWeaver's tags): a greedy run with the merge join, decoded
by the engine, against the merge layout's training forward of its own text (an independent
reference: the trainer's item of the run's text, one plain forward); and the RL invariant (the
loss's log-prob of every sampled token == the engine's) for ThreadWeaver rollouts in every layout;
and `sprint-jax rl` reading the policy's format from its export."""
from __future__ import annotations

import json

import numpy as np
import pytest

CHAINS, LENGTH = 2, 2
TOL = 1e-4


@pytest.fixture(scope="module")
def tw_policy(tmp_path_factory):
    """A tiny ThreadWeaver model (merge layout), its export directory, tokenizer and four queries."""
    from sprint_jax.model import from_pretrained
    from sprint_jax.tasks import chains
    from sprint_jax.train.trainer import train
    from conftest import chains_policy_config

    root = tmp_path_factory.mktemp("tw_logprob")
    tc, tok, tasks = chains_policy_config(root, "threadweaver", "merge", CHAINS, LENGTH)
    export = train(tc, root / "train", tokenizer=tok, progress=False)["export_dir"]
    return from_pretrained(export), export, tok, [chains.prompt_for(t) for t in tasks[:4]]


def _engine(model, tok, seqs: int):
    from sprint_jax.infer.engine import Engine
    return Engine(model, tok, max_seqs=seqs, max_children=CHAINS, max_seq_len=160, max_branch_tokens=24,
                  decode_chunk=4, prefill_chunk=64, trace=True)


def _layout_logprobs(model, item, n_valid: int, merge_rule: bool = True) -> np.ndarray:
    """Per row of a training item: log p(token | what its parent row saw) from one forward of the
    item as the trainer lays it out (log-softmax over the tokenizer's ids; row 0: nan)."""
    import jax.numpy as jnp

    from sprint_jax.model import forward

    rule = {"stage": jnp.asarray(item.stage)[None], "branch": jnp.asarray(item.branch)[None]} if merge_rule else {}
    logits = np.asarray(forward(model.params, model.config, jnp.asarray(item.tokens)[None],
                                jnp.asarray(item.positions)[None], span_end=jnp.asarray(item.span_end)[None],
                                attention_impl="xla", **rule))[0, :, :n_valid].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))
    return np.asarray([logp[p, t] if p >= 0 else np.nan for p, t in zip(item.parents, item.tokens)])


@pytest.mark.slow
def test_threadweaver_merge_join_logprobs_equal_the_merge_layout_forward(tw_policy):
    """Greedy ThreadWeaver runs with the merge join (the threads side by side from the fork,
    `\\n</Parallel>` past the longest): every token the engine generated, with the log-prob it
    reported, is a loss row of the merge layout's item of the run's own text (query + completion,
    `data.layout_example(..., "merge", data_format="threadweaver")`), in text order, and the
    forward of that item gives the same log-prob within 1e-4. Without the merge rule (the same
    rows, plain causal attention in text order: the second thread sees the first) they differ."""
    from sprint_jax.infer.orchestrator import OrchestratorConfig, run_many
    from sprint_jax.infer.sampling import valid_vocab
    from sprint_jax.schema import Example
    from sprint_jax.train import data as D
    from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

    model, _, tok, queries = tw_policy
    n_valid = valid_vocab(tok, model.config.vocab_size)
    assert n_valid is not None and n_valid < model.config.vocab_size
    orch = OrchestratorConfig(max_prompts=CHAINS, max_planner_tokens=40, max_branch_tokens=8, max_total_tokens=120,
                              layout="merge", format="threadweaver")
    records = run_many(_engine(model, tok, 4), queries, "parallel", orch)
    blind_gaps = []
    for query, rec in zip(queries, records):
        assert rec.termination == "final_answer" and rec.problems == [], (rec.termination, rec.problems)
        assert [s.join for s in rec.stages] == ["merge"] and len(rec.stages[0].executions) == CHAINS
        ex = Example("run", "sprint", query, rec.text)
        item = D.layout_example(tok, ex, "merge", dict(SPAN_WEIGHTS_DEFAULT), data_format="threadweaver")
        rows = np.flatnonzero(item.weights > 0)
        # the engine's tokens in text order: the planner call, each thread, the answer call (+ EOS)
        st = rec.stages[0]
        written = st.planner_text + "".join(e.text for e in st.executions) + rec.final_text + tok.eos_token
        engine_lp = np.asarray(st.planner_logprobs + [x for e in st.executions for x in e.logprobs]
                               + rec.final_logprobs)
        assert len(rows) == len(engine_lp) == rec.total_tokens
        assert tok.decode(item.tokens[rows].tolist()) == written
        gap = np.abs(_layout_logprobs(model, item, n_valid)[rows] - engine_lp)
        assert gap.max() < TOL, gap.max()
        blind_gaps.append(np.abs(_layout_logprobs(model, item, n_valid, merge_rule=False)[rows] - engine_lp).max())
    assert max(blind_gaps) > 1e-3, blind_gaps


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["flat", "trie", "merge"])
def test_threadweaver_rl_logprob_invariant_per_layout(tw_policy, layout):
    """P-GRPO rollouts of the ThreadWeaver policy (temperature 1, all runs at once) with the
    layout's token convention and join: the loss's log-prob of every sampled token, laid out from
    the rollout's trace, equals the one the engine sampled it with, within 1e-4, and every sampled
    token (planner calls, threads, the answer call with its EOS) is in the loss."""
    import jax.numpy as jnp

    from sprint_jax.infer.orchestrator import OrchestratorConfig
    from sprint_jax.infer.sampling import valid_vocab
    from sprint_jax.rl.layout import layout_trace, pack_items
    from sprint_jax.rl.loss import token_logprobs
    from sprint_jax.rl.rollout import Rollouts

    model, _, tok, queries = tw_policy
    n_valid = valid_vocab(tok, model.config.vocab_size)
    orch = OrchestratorConfig(max_prompts=CHAINS, max_planner_tokens=40, max_branch_tokens=8, max_total_tokens=120,
                              temperature=1.0, layout=layout, format="threadweaver")
    trajs = Rollouts(_engine(model, tok, 8), orch).run(queries * 2, list(range(8)), "parallel")
    joins = {s.join for t in trajs for s in t.record.stages if s.executions}
    assert joins == {"merge" if layout == "merge" else "reprefill"}, joins
    packed = pack_items([layout_trace(t.trace, 1.0) for t in trajs], 256, 1, 0)
    assert packed.truncated_loss_tokens == 0
    arrays = packed.arrays
    lp = np.stack([np.asarray(token_logprobs(model.params, model.config,
                                             {k: jnp.asarray(v[m]) for k, v in arrays.items()}, 1.0, n_valid=n_valid))
                   for m in range(arrays["tokens"].shape[0])])
    mask = arrays["mask"] > 0
    gap = np.abs(lp - arrays["rollout_logp"])[mask]
    assert gap.max() < TOL, gap.max()
    assert int(mask.sum()) == sum(t.generated_tokens for t in trajs) == sum(t.record.total_tokens for t in trajs)


@pytest.mark.slow
def test_threadweaver_rl_step_rolls_out_in_the_policys_format(tw_policy, tmp_path):
    """`sprint-jax rl` on the ThreadWeaver policy, one step: the rollouts run in the format its
    export names (rollout.format auto), so they parse, answer and are graded, and the update's
    log-probs are the rollouts' (`rollout_logp_gap`); rollout.orchestrator.format is refused."""
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR, ConfigError
    from sprint_jax.rl.config import load_rl_config

    _, export, _, _ = tw_policy
    sets = [f"policy.path={export}", f"tasks.chains={CHAINS}", f"tasks.chain_length={LENGTH}", "tasks.n=200",
            "tasks.seed=1", "tasks.eval_n=2", "rollout.group_size=2", "rollout.prompts_per_step=2",
            "rollout.orchestrator.max_prompts=2", "rollout.orchestrator.max_planner_tokens=40",
            "rollout.orchestrator.max_branch_tokens=8", "rollout.orchestrator.max_total_tokens=120",
            "rollout.max_seq_len=160", "rollout.prefill_chunk=64", "loss.seq_len=256", "loss.rows_per_micro=4",
            "checkpoint.every=0", "eval.every=0", "tensorboard=false", "plot=false", "export.enabled=false",
            "steps=1"]
    with pytest.raises(ConfigError, match="set rollout.format"):
        load_rl_config(CONFIG_DIR / "rl_tiny_cpu.yaml", sets + ["rollout.orchestrator.format=threadweaver"])
    out = tmp_path / "rl"
    assert main(["rl", "--config", str(CONFIG_DIR / "rl_tiny_cpu.yaml"), "--out", str(out), "--no-progress"]
                + [x for s in sets for x in ("--set", s)]) == 0
    step = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in x][-1]
    assert step["rollout_logp_gap"] < TOL
    # the greedy held-out runs (the rollouts' engine and orchestrator config, temperature 0) are
    # ThreadWeaver runs that fork and answer; read as SPRINT they would never close a plan
    held = [json.loads(x) for x in (out / "eval_start" / "records.jsonl").read_text().splitlines()]
    assert [(r["config"]["format"], r["format_valid"], r["n_stages"]) for r in held] == [("threadweaver", True, 1)] * 2
