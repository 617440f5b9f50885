"""Pieces of benchmarks/offload.py: the machine's limits, the prefetch rule of a run, the table, trace
replay, the accelerate baseline.

Limits measured in the same run: pinned host-to-device GB/s of one expert, the CPU's time for one
expert (bf16, 1 and 8 rows), the disk's sequential O_DIRECT read (dd). Traces: the trained tiny
model (transformers' own Qwen3-MoE class) run over Python source, recording per token and layer
the router's top-4 and the pre-gate's (layer l's router on layer l-1's MoE input) probabilities,
folded from 16 experts to 8 for the Mixtral shape: the router's picks as e // 2 (the first two
distinct), the pre-gate's probabilities summed in pairs, its top-2 renormalized as Mixtral's router
weights them.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import subprocess
import sysconfig
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from e2e_generate import sync

from moe_infer.layers.forward_context import get_forward_context
from moe_infer.offload.compute import swiglu
from moe_infer.offload.host import HostRegion
from moe_infer.offload.prefetch import Prefetcher


def link_and_cpu_limits(D: int, F: int, dtype: torch.dtype, device: torch.device) -> Dict[str, float]:
    """Pinned H2D GB/s for one expert (w13 + w2), and the CPU's ms per expert at 1 and 8 rows."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = 3 * D * F * elem
    region = HostRegion(nbytes, pin=device.type == "cuda")
    host = region.data.view(dtype)
    host.normal_()
    dev = torch.empty(host.numel(), dtype=dtype, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    w13, w2 = host[:2 * F * D].view(2 * F, D), host[2 * F * D:].view(D, F)
    cpu_ms = {rows: host_expert_ms(w13, w2, rows) for rows in (1, 8)}
    region.release()
    return {"expert_mb": nbytes / 1e6, "h2d_gbps": nbytes / min(times[1:]) / 1e9,
            "cpu_ms_1row": cpu_ms[1], "cpu_ms_8rows": cpu_ms[8]}


def host_expert_ms(w13_2FD: torch.Tensor, w2_DF: torch.Tensor, rows: int, repeats: int = 8,
                   warm_s: float = 0.25, weights: Optional[Callable[[], Tuple[torch.Tensor, torch.Tensor]]] = None
                   ) -> float:
    """The host cores' best time (ms) for one SwiGLU expert (weights in host memory) at `rows` rows, after
    warm_s seconds of the same work (at least one call: from idle the cores' first tens of milliseconds can be
    slower, and the bound built on them loose). weights: the expert's (w13, w2) fetched per call in place of the
    two tensors (a quantized expert: dequantized per call, as the engine's host path does, and timed with it)."""
    get = weights or (lambda: (w13_2FD, w2_DF))
    x = torch.randn(rows, get()[0].shape[1]).to(get()[0].dtype)
    end = time.perf_counter() + warm_s
    swiglu(x, *get())
    while time.perf_counter() < end:
        swiglu(x, *get())
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        swiglu(x, *get())
        t.append(time.perf_counter() - t0)
    return min(t) * 1e3


def disk_read_gbps(path: str) -> float:
    """The disk's own sequential read of `path` (dd, O_DIRECT, 16 MiB blocks)."""
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    return size / (time.perf_counter() - t0) / 1e9


def use_policies(llm, rule: str, miss: str) -> None:
    """The prefetch rule (a fresh decision and calibration) and the miss policy of the running engine."""
    m = llm.engine.runner.offload
    m.cfg = dataclasses.replace(m.cfg, prefetch_rule=rule, miss_policy=miss)
    m.prefetcher = Prefetcher(m.cfg, m)


def print_table(result: dict) -> None:
    acc = result.get("accelerate", {}).get("extrapolated_tok_s")
    print(f"\n{'shape':8} {'layers':>6} {'routing':7} {'streams':>7} {'prefetch':8} {'misses':6} {'graphs':6} {'chunk':>5} {'tok/s':>7} {'hit':>5} "
          f"{'pregate':>7} {'GB':>6} {'wasted':>6} {'GB/s':>6} {'of H2D':>6} {'CPU':>5} {'step/bound (after)':>18} {'x accel':>8}")
    for r in result["runs"]:
        over = f"{r['step_over_bound']:.2f}" if r["step_over_bound"] else "-"
        if r.get("step_over_bound_after_run"):
            over += f" ({r['step_over_bound_after_run']:.2f})"
        vs = f"{r['tok_s'] / acc:.0f}" if acc and r["shape"] == "mixtral" and r["streams"] == 1 else "-"
        print(f"{r['shape']:8} {r['layers']:>6} {r['routing']:7} {r['streams']:>7} {r['prefetch_rule']:8} "
              f"{r.get('miss_policy', 'auto'):6} {('on' if r.get('layer_graphs') else 'off') + ('+eg' if r.get('expert_graphs') else ''):6} {r.get('stream_chunk', '-'):>5} "
              f"{r['tok_s']:>7.2f} {r['hit_rate']:>5.2f} {r['prefetch_token_recall']:>7.2f} {r['gb_h2d']:>6.1f} "
              f"{r['gb_prefetch_wasted']:>6.1f} {r['h2d_gbps']:>6.1f} {r['h2d_of_limit']:>6.2f} {r['cpu_share']:>5.2f} "
              f"{over:>18} {vs:>8}")


# ------------------------------------------------------------------ tiny-model traces
def python_text(max_chars: int) -> str:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    out, n = [], 0
    for f in files[::7]:  # a spread of modules
        try:
            out.append(open(f, encoding="utf-8").read())
        except (OSError, UnicodeDecodeError):
            continue
        n += len(out[-1])
        if n >= max_chars:
            break
    return "\n".join(out)[:max_chars]


@torch.no_grad()
def record_tiny_traces(num_streams: int, tokens_per_stream: int, device: torch.device) -> Dict[str, torch.Tensor]:
    """ids [S, N, 6, 4] (router top-4) and pred_probs [S, N, 6, 16] (the pre-gate's softmax for layer l from
    layer l-1's input; layer 0 from layer 5 of the same token) on the trained tiny model, 16 experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_infer.assets import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = tok(python_text(num_streams * tokens_per_stream * 6), return_tensors="pt").input_ids[0]
    ids = ids[:num_streams * tokens_per_stream].view(num_streams, tokens_per_stream).to(device)
    inputs: List[torch.Tensor] = []
    mlps = [layer.mlp for layer in model.model.layers]
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for m in mlps]
    model(ids)
    for h in hooks:
        h.remove()
    gates = [m.gate.weight for m in mlps]
    L = len(mlps)
    top = [(x.float() @ gates[i].float().t()).topk(4, dim=-1).indices for i, x in enumerate(inputs)]
    pred = [(inputs[(i - 1) % L].float() @ gates[i].float().t()).softmax(-1) for i in range(L)]
    return {"ids": torch.stack(top, 2).cpu(), "pred_probs": torch.stack(pred, 2).cpu()}


def fold(ids_NK: torch.Tensor, num_experts: int, k: int) -> torch.Tensor:
    """16 tiny experts onto num_experts (e * num_experts // 16), keeping the first k distinct picks."""
    folded = ids_NK * num_experts // 16
    out = torch.empty(folded.shape[0], k, dtype=torch.int64)
    for n, row in enumerate(folded.tolist()):
        seen = list(dict.fromkeys(row))
        seen += [e for e in range(num_experts) if e not in seen]
        out[n] = torch.tensor(seen[:k])
    return out


def fold_probs(probs_X16: torch.Tensor, num_experts: int, k: int) -> tuple:
    """(ids [X, k], weights [X, k]): 16 tiny experts' probabilities summed onto num_experts, the top-k
    renormalized to sum to 1 (Mixtral's router weights)."""
    probs_XE = probs_X16.reshape(probs_X16.shape[0], num_experts, -1).sum(-1)
    weights, ids = probs_XE.topk(k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


class TraceReplay:
    """Routes each MoE layer of an engine by the trace: layer l replays tiny layer l % 6 at the token's
    (sequence of the batch, position); its store's pre-gate replays the tiny model's pre-gate (ids and
    renormalized weights)."""

    def __init__(self, traces: Dict[str, torch.Tensor], num_experts: int, top_k: int, device) -> None:
        S, N, L, _ = traces["ids"].shape
        self.N, self.L = N, L
        self.ids = fold(traces["ids"].reshape(-1, 4), num_experts, top_k).view(S, N, L, top_k).to(device)
        pred, pred_w = fold_probs(traces["pred_probs"].reshape(S * N * L, -1), num_experts, top_k)
        self.pred, self.pred_w = pred.view(S, N, L, top_k).to(device), pred_w.view(S, N, L, top_k).to(device)
        self.E, self.K = num_experts, top_k

    def _rows(self, table: torch.Tensor, layer: int, T: int) -> torch.Tensor:
        attn = get_forward_context().attn
        q = attn.query_start_loc_B1.long()
        seq_T = torch.searchsorted(q[1:], torch.arange(T, device=q.device), right=True) % table.shape[0]
        return self.at(table, seq_T, attn.positions_T, layer)

    def at(self, table: torch.Tensor, seq_T: torch.Tensor, pos_T: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of `table` (ids, pred or pred_w) for tokens (sequence, position) of MoE layer `layer`."""
        return table[seq_T % table.shape[0], pos_T % self.N, layer % self.L]

    def install(self, moe_layers) -> None:
        for i, layer in enumerate(moe_layers):
            def route(x_TD, i=i):
                ids_TK = self._rows(self.ids, i, x_TD.shape[0])
                w_TK = torch.full(ids_TK.shape, 1.0 / self.K, device=x_TD.device)
                return torch.zeros(x_TD.shape[0], self.E, device=x_TD.device), w_TK, ids_TK

            def pre_gate(x_TD, i=i):
                T = x_TD.shape[0]
                return None, self._rows(self.pred_w, i, T), self._rows(self.pred, i, T)

            layer.route = route
            if not layer.store.is_resident:
                layer.store.router = pre_gate


# ------------------------------------------------------------------ transformers + accelerate
def accelerate_seconds_per_token(hf_config, gpu_bytes: int, device: torch.device, tokens: int = 3) -> float:
    """transformers' Mixtral with accelerate's device_map offload (whole decoder layers on the CPU,
    moved to the GPU for each forward) at `gpu_bytes` of GPU memory: seconds per decoded token."""
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import MixtralForCausalLM

    from moe_infer.models.dummy import fill_repeating

    with torch.device("meta"):
        model = MixtralForCausalLM(hf_config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    block = ((torch.rand(1 << 22, generator=gen) * 2 - 1) * 0.02).to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_(False)
        fill_repeating(p.data, torch.ones_like(block) if "norm" in name else block)
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)  # buffers lost by to_empty
    if device.type == "cuda":
        max_memory = {0: gpu_bytes, "cpu": 1 << 40}
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=["MixtralDecoderLayer"])
    else:
        device_map = {"": "cpu"}
    model = dispatch_model(model.eval(), device_map=device_map)
    first = next(iter(device_map.values()))
    ids = torch.randint(3, hf_config.vocab_size, (1, 8), device=device if first != "cpu" else "cpu")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        sync(device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=1 + tokens, do_sample=False)
        sync(device)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / tokens
