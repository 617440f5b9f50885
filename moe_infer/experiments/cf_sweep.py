"""Task `cf_sweep`: what one capacity policy drops, how it balances, and what it costs in quality.

The model runs teacher-forced over the held-out windows twice: dropless, and under the job's
`routing` config (policy, capacity_factor, min_capacity, drop_by), the same windows in the same
forwards (in a multirun the dropless logits are computed once and shared through the sweep folder). The job writes its row (`result.json`) into its folder; under `--multirun` the Hydra
callback `SweepTable` gathers the rows of every job into one table (`cf_sweep.csv/json`), figures
and a report page in the sweep folder. A single run writes the one-row table itself.

Row: dropped / rerouted share of the routed rows; per layer the imbalance (max - mean) / mean of
the router's choice and of the rows the experts processed after the policy; KL(dropless ||
policy) of the next-token distributions, top-1 agreement, perplexity of both.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from moe_infer.config import RoutingConfig
from moe_infer.experiments import TASKS
from moe_infer.experiments.common import heldout_windows, model_path, out_dir, write_run_info
from moe_infer.lab import plots
from moe_infer.lab.loads import imbalance
from moe_infer.lab.quality import QualityMeter, next_token_targets
from moe_infer.lab.report import Section, save_section, write_report
from moe_infer.lab.tables import write_json, write_table
from moe_infer.routing.trace import save_trace

COLUMNS = ["policy", "drop_by", "capacity_factor", "min_capacity", "tokens_per_forward", "dropped_frac",
           "rerouted_frac", "imbalance_routed", "imbalance_processed", "kl", "top1_agreement", "ppl", "ppl_dropless"]


def _device_dtype(job):
    import torch

    from moe_infer.engine.llm_engine import resolve_device, resolve_dtype

    device = resolve_device(job.model.device)
    return str(device), resolve_dtype(job.model.dtype, device), torch


@TASKS.register("cf_sweep")
def cf_sweep(job) -> Dict:
    from moe_infer.engine.llm_engine import load_tokenizer
    from moe_infer.experiments.scoring import PrefillScorer

    lab, out, path = job.lab, out_dir(job.lab), model_path(job)
    device, dtype, torch = _device_dtype(job)
    torch.manual_seed(job.seed)
    windows = heldout_windows(job, load_tokenizer(path))
    d = lab.data
    test = PrefillScorer(path, job.routing, d.windows_per_forward, d.seq_len, device, dtype,
                         record_trace=lab.sweep.save_trace)
    key = {"model": path, "data": vars(d), "dtype": str(dtype), "device": device, "backend": job.routing.backend}
    refs = _dropless_logits(key, windows, lambda: PrefillScorer(
        path, RoutingConfig(backend=job.routing.backend), d.windows_per_forward, d.seq_len, device, dtype))
    meter = QualityMeter()
    for (chunk, test_logits), ref_logits in zip(test.batches(windows), refs):
        meter.update(ref_logits, test_logits, next_token_targets(chunk).to(ref_logits.device))
    moe = test.model.arch.moe_layer_ids
    stats = [row for row in test.stats.summary() if row["layer"] in moe]
    routed = np.array([r["routed"] for r in stats], dtype=np.float64)
    r = job.routing
    row = {"policy": r.policy, "drop_by": r.drop_by, "capacity_factor": r.capacity_factor,
           "min_capacity": r.min_capacity, "tokens_per_forward": d.windows_per_forward * d.seq_len,
           "windows": d.num_windows,
           "dropped_frac": sum(sum(s["dropped"]) for s in stats) / routed.sum(),
           "rerouted_frac": sum(sum(s["rerouted"]) for s in stats) / routed.sum(),
           "imbalance_routed": [round(float(v), 4) for v in imbalance(routed)],
           "imbalance_processed": [round(float(v), 4) for v in imbalance([s["processed"] for s in stats])],
           **meter.result(), "stats": stats}
    row["commit"] = write_run_info(out, job)["commit"]
    write_json(os.path.join(out, "result.json"), row)
    if test.trace is not None:
        save_trace(test.routing_trace({"source": "cf_sweep policy run", "policy": dict(vars(r))}),
                   os.path.join(out, "policy_trace.safetensors"))
    if not _in_multirun():
        finish_sweep([row], out)
    print(f"{r.policy}/{r.drop_by} cf={r.capacity_factor} min={r.min_capacity}: dropped {row['dropped_frac']:.4f}, "
          f"KL {row['kl']:.5f}, top-1 {row['top1_agreement']:.4f}, ppl {row['ppl']:.3f} (dropless {row['ppl_dropless']:.3f})")
    return row


def _dropless_logits(key: Dict, windows, make_scorer) -> List:
    """The dropless model's logits of every forward. In a multirun the first job saves them in the sweep
    folder (`dropless_reference.pt`, with `key`: model, data, dtype, device) and the others load them:
    the reference is the same for every job of a sweep."""
    import torch

    cache = None
    if _in_multirun():
        from hydra.core.hydra_config import HydraConfig

        cache = os.path.join(HydraConfig.get().sweep.dir, "dropless_reference.pt")
        if os.path.isfile(cache):
            saved = torch.load(cache, weights_only=True)
            if saved["key"] == json.dumps(key, sort_keys=True):
                return saved["logits"]
    logits = [out for _, out in make_scorer().batches(windows)]
    if cache is not None:
        torch.save({"key": json.dumps(key, sort_keys=True), "logits": logits}, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    return logits


def _in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except (ImportError, ValueError):
        return False


def finish_sweep(rows: List[Dict], folder: str) -> Section:
    """The sweep's table (without the per-expert statistics), figure and report page in `folder`."""
    table = [{k: v for k, v in row.items() if k != "stats"} for row in rows]
    table.sort(key=lambda t: (t["policy"], t["drop_by"], t["min_capacity"], t["capacity_factor"]))
    write_table(table, folder, "cf_sweep")
    plots.capacity_curves(table, os.path.join(folder, "cf_curves.png"))
    shown = [{**t, "imbalance_routed": max(t["imbalance_routed"]), "imbalance_processed": max(t["imbalance_processed"])}
             for t in table]
    section = Section(
        title="Capacity-factor sweep",
        text=(f"Commit {table[0].get('commit')}. {len(table)} runs on {table[0]['windows']} held-out windows, {table[0]['tokens_per_forward']} tokens "
              "per forward (the tokens each capacity-policy call counts over). Quality against dropless on the "
              "same inputs: KL(dropless || policy) in nats per position, top-1 agreement, perplexity. "
              "Imbalance columns: the worst layer's (max - mean) / mean, of the router's choice and of the "
              "rows the experts processed after the policy."),
        table=shown, columns=COLUMNS, images=["cf_curves.png"])
    save_section(section, folder)
    write_report(folder, "Capacity-factor sweep", [section])
    return section
