"""Planning runs on accelerators that are not here (`sprint-jax plan`).

`plan train` compiles the SFT step for TPU slices with XLA's TPU compiler (libtpu's compile-only
topologies) and sets the compiler's per-chip memory beside the planner's own estimate, FLOPs,
HBM traffic and roofline step time. Modules: chips (the chip figures, slice names), estimate (the
planner's arithmetic), compile (the compile-only step), train (rows, search, way out), engine
(`plan engine`: the engine's own programs, their estimate, decode roofline, capacity, search),
records (SPRINT / RFT latency predicted from eval records), cli.
"""
