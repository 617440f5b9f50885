"""The load-balance lab: plain functions over routing traces and load arrays (numpy), no engine.

    synthetic   synthetic routing traces (uniform, Zipf, bursty, drifting hot set), same file format
    loads       expert load per layer / step from a trace or from the engine's load statistics
    eplb        the EPLB planner: replicate hot experts, pack them onto nodes then GPUs
    plan_eval   a plan's imbalance, memory cost and placement files
    migration   from one placement to the next with the fewest weight copies
    capacity    replay of the engine's capacity policies on a trace (drop / reroute counts)
    quality     quality cost of a policy against dropless: KL, top-1 agreement, perplexity
    cost_model  step-time model calibrated from benchmarks/results (expert GEMMs, all-to-all)
    simulate    replay a trace over N GPUs: step time, straggler share, throughput per policy
    calibration_check  the simulator re-running the benchmarks it was calibrated on
    tables      CSV + JSON tables, and the rows of a Hydra multirun's jobs
    plots       matplotlib figures, saved next to the results; report: the page that shows them

The engine records traces (`moe_infer.routing.trace`) and loads placements; the experiments that
drive the engine live in `moe_infer.experiments`. `import moe_infer` does not import this package;
plots need the `lab` extra (matplotlib).
"""
