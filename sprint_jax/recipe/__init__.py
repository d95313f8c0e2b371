"""`sprint-jax recipe`: the paper's experiment as one resumable run.

curate (teacher traces -> paired SPRINT / RFT example sets) -> SFT of both -> eval of both on each
configured set -> `eval compare` -> DIR/report.md. Every stage records digests of its inputs and
outputs in DIR/state.json; a rerun skips a finished stage whose inputs are unchanged
(sprint_jax.recipe.runner).
"""
