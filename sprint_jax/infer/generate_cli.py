"""`sprint-jax generate`: plain decoding from a checkpoint (HF or orbax directory)."""
from __future__ import annotations

import time

DESCRIPTION = """Generate text from a checkpoint with the JAX engine (plain decoding, no orchestration).

  sprint-jax generate --model DIR "Once upon a time" --max-new-tokens 50
  sprint-jax generate --model DIR --token-ids 1,2,3 --max-new-tokens 20

The tokenizer is loaded from the checkpoint directory (HF tokenizer files or vocab_tokenizer.json);
--tokenizer qwen2 uses the Qwen2 BPE shipped with the package instead, --tokenizer DIR another directory.

A prompt text is put in the model's prompt format (its trailing whitespace set to the one of the
prompts `sprint-jax train` trained it on, MODEL/sprint_jax.json; see `sprint-jax infer --help`), with
a note on stderr when that changes it; --token-ids are given as they are. The time printed is split
into running and compiling (the first use of a shape in the process compiles it).
"""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="HF safetensors or orbax model directory (Qwen2 or Qwen3)")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    from sprint_jax.infer.infer_cli import add_dtype_argument, add_tokenizer_argument
    add_tokenizer_argument(p)
    add_dtype_argument(p)


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.sampling import Sampling
    from sprint_jax.infer.single import SingleRun
    from sprint_jax.eval.evaluate import CompileClock
    from sprint_jax.infer.infer_cli import formatted_prompt, load_model_arg, load_tokenizer_arg, split_seconds

    if (args.prompt is None) == (args.token_ids is None):
        raise UserError("give either a prompt text or --token-ids")
    # every flag is checked before the weights are read
    if args.prompt is not None and not args.prompt:
        raise UserError("the prompt is empty (give some text, or --token-ids)")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(s == "" for s in args.stop):
        raise UserError('--stop "" would stop before the first token; give a non-empty stop string')
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise UserError(f"--{str(e).split(' ')[0].replace('_', '-')}: {e}") from None
    from sprint_jax.model.capacity import check_positions
    from sprint_jax.model.config import Qwen2Config
    from pathlib import Path
    if not args.model or not Path(args.model).is_dir():
        load_model_arg(args.model, args.dtype)          # the one-line error for a missing --model
    mcfg = Qwen2Config.from_hf_config(Path(args.model))
    check_positions(mcfg, args.max_new_tokens, "--max-new-tokens")
    tok = None
    if args.tokenizer or args.prompt is not None or args.stop:
        tok = load_tokenizer_arg(args.tokenizer, args.model)
        from sprint_jax.model.tokenizer import check_tokenizer_fits
        check_tokenizer_fits(tok, mcfg.vocab_size, f"the model in {args.model}")
    if args.token_ids is not None:
        try:
            ids = [int(x) for x in args.token_ids.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}")
    else:
        _, ids = formatted_prompt(args.model, args.prompt, lambda text: tok.encode(text, add_special_tokens=False),
                                  "prompt")
    if not ids:
        raise UserError("the prompt encodes to no tokens" if args.prompt is not None else "--token-ids is empty")
    bad = [i for i in ids if not 0 <= i < mcfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the model's vocabulary (size {mcfg.vocab_size})")
    check_positions(mcfg, len(ids) + args.max_new_tokens, "the prompt plus --max-new-tokens")
    model = load_model_arg(args.model, args.dtype)

    class _IdsOnly:
        eos_token_id = None

        def decode(self, t):
            return " ".join(map(str, t))

        def encode(self, s, add_special_tokens=False):
            raise UserError("stop strings need a tokenizer")

    # one sequence, no forks: the child slots are kept minimal
    engine = SingleRun(Engine(model, tok or _IdsOnly(), max_seqs=1, max_seq_len=len(ids) + args.max_new_tokens + 1,
                              max_children=1, max_branch_tokens=1, prefill_chunk=512))
    clock = CompileClock().start()
    try:
        t0 = time.perf_counter()
        state = engine.prefill(ids)
        g = engine.generate(state, args.max_new_tokens, stop=args.stop, sampling=sampling)
        dt = time.perf_counter() - t0
        took = split_seconds(dt, clock)
    finally:
        clock.stop()
    print(g.text)
    print(f"\n[{len(g.tokens)} tokens, stop: {g.stop_reason}, {took}; ids: {g.tokens}]")
    return 0
