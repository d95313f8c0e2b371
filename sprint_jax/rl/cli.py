"""`sprint-jax rl`: P-GRPO on parallel rollouts with the acceleration reward."""
from __future__ import annotations

DESCRIPTION = """Reinforcement learning on SPRINT's parallel rollouts: P-GRPO with the acceleration
reward (ThreadWeaver, Lian et al., arXiv 2512.07843, section 4).

  sprint-jax rl --config configs/rl_tiny_cpu.yaml --set policy.path=runs/demo/train/sprint/hf --out runs/rl
  sprint-jax rl --config configs/rl_tiny_cpu_rft.yaml --set policy.path=runs/demo/train/rft/hf --out runs/rl_rft
  sprint-jax eval compare runs/rl/eval runs/rl_rft/eval

Each step: G runs per prompt (rollout.group_size) in rollout.mode with temperature sampling and the
orchestrator's budgets; reward = correct + [correct] * min(rho * eta, rho_clip) with
eta = 1 - sequential / total tokens; advantage = reward - group mean, on every generated token of
every planner and executor call (trie layout, ancestor-only attention); one on-policy update
(REINFORCE with the group-mean baseline; PPO clip when loss.updates_per_batch > 1; optional KL
to the starting weights via loss.kl_coef). The RFT-side baseline: rollout.mode=sequential,
reward.rho=0 (configs/rl_tiny_cpu_rft.yaml).

Outputs in --out: metrics.jsonl (per step: reward, accuracy, sequential / total tokens, eta,
advantage stats, loss, tokens/s of rollout and update, time split; held-out eval_* fields),
tb/ (TensorBoard), rl_curves.png, checkpoints/ (orbax; rerunning the same command resumes with the
same data position and rollout seeds), eval_start/ and eval/ (held-out results of the SFT model
and of the final policy, readable by `eval compare`), hf/ (the final policy), summary.json.
"""


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="RL config (YAML), e.g. configs/rl_tiny_cpu.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set steps=20 (repeatable)")
    p.add_argument("--out", required=True, help="output directory (resumes when it holds checkpoints)")
    p.add_argument("--no-progress", action="store_true", help="no per-step lines")


def run(args) -> int:
    from sprint_jax.rl.config import load_rl_config
    from sprint_jax.rl.trainer import run_rl

    cfg = load_rl_config(args.config, args.set)
    s = run_rl(cfg, args.out, progress=not args.no_progress)
    last, ev0, ev1 = s["last"], s["eval_first"], s["eval_last"]
    if last:
        print(f"step {last['step']}: reward {last['reward']:.3f}, rollout accuracy {last['accuracy']:.2f}, "
              f"sequential tokens {last['sequential_tokens']:.1f}, eta {last['eta']:.3f}")
    if ev0 and ev1:
        print(f"held-out accuracy {ev0['eval_accuracy']:.3f} -> {ev1['eval_accuracy']:.3f}, sequential tokens "
              f"{ev0['eval_sequential_tokens']:.1f} -> {ev1['eval_sequential_tokens']:.1f} -> {args.out}")
    return 0
