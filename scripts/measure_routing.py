"""Is the tiny MoE's routing learned? Expert load and next-layer predictability vs random init.

On validation text (the files `train_tiny_moe.py` held out, re-collected from the running
interpreter's standard library) this runs the checkpoint and the same architecture at random
initialisation, records each layer's router input x_TD and chosen experts topk_ids_TK, and reports:

  load      per layer: max/mean and min/mean expert load, normalised entropy of the load
            (1 = uniform), mean per-token router entropy (normalised by log E)
  predict   per layer pair l -> l+1, top-K recall of layer l+1's experts (|pred & true| / K), on
            the second half of the windows, from:
              probe        ridge regression x_l -> multi-hot(experts at l+1), fit on the first half
              next_gate    layer l+1's router weights applied to x_l (no training)
              prev_token   the experts layer l+1 chose for the previous token
              frequent     the K experts most used at layer l+1 on the first half
            chance is K/E.

    python scripts/measure_routing.py --out benchmarks/results/tiny_moe_routing_cpu.json

Legend: T tokens, D hidden, E experts, K top-k, L layers.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_moe  # noqa: E402 - same corpus split as training


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: moe_infer's shipped tiny_moe)")
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ridge", type=float, default=1e-2, help="L2 weight of the linear probe (x mean-scaled)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random-init model")
    return ap.parse_args(argv)


@torch.no_grad()
def record_routing(model, windows_BS: torch.Tensor, batch_size: int):
    """Run the model; per MoE layer return (x_TD router inputs, topk_ids_TK, router entropy_T)."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    records = [[] for _ in gates]
    hooks = [g.register_forward_hook(lambda mod, inp, out, rec=rec: rec.append((inp[0].float(), out[0], out[2])))
             for g, rec in zip(gates, records)]
    try:
        for i in range(0, windows_BS.shape[0], batch_size):
            model(input_ids=windows_BS[i:i + batch_size], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for rec in records:
        x_TD = torch.cat([r[0].reshape(-1, r[0].shape[-1]) for r in rec]).cpu()
        logits_TE = torch.cat([r[1] for r in rec]).float()
        probs_TE = logits_TE.softmax(-1)
        entropy_T = -(probs_TE * probs_TE.clamp_min(1e-12).log()).sum(-1).cpu()
        topk_ids_TK = torch.cat([r[2] for r in rec]).cpu()
        layers.append((x_TD, topk_ids_TK, entropy_T))
    return layers


def load_stats(topk_ids_TK: torch.Tensor, entropy_T: torch.Tensor, num_experts: int) -> dict:
    load_E = torch.bincount(topk_ids_TK.flatten(), minlength=num_experts).double()
    frac_E = load_E / load_E.sum()
    mean = load_E.mean()
    nz = frac_E[frac_E > 0]
    return {"max_over_mean": (load_E.max() / mean).item(), "min_over_mean": (load_E.min() / mean).item(),
            "load_entropy_norm": (-(nz * nz.log()).sum() / math.log(num_experts)).item(),
            "router_entropy_norm": (entropy_T.mean() / math.log(num_experts)).item(),
            "load_fraction": [round(v, 5) for v in frac_E.tolist()]}


def topk_recall(pred_TK: torch.Tensor, true_TK: torch.Tensor) -> float:
    """Mean over tokens of |pred & true| / K."""
    hits_TK = (pred_TK.unsqueeze(-1) == true_TK.unsqueeze(-2)).any(-1)
    return hits_TK.float().mean().item()


def multi_hot(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(topk_ids_TK.shape[0], num_experts).scatter_(1, topk_ids_TK, 1.0)


def predict_next(x_TD, next_ids_TK, next_gate_ED, num_experts, seq_len, ridge) -> dict:
    """Top-K recall of layer l+1's experts from layer l's router input x_TD (second half of windows)."""
    T, K = next_ids_TK.shape
    num_windows = T // seq_len
    split = (num_windows // 2) * seq_len
    fit, test = slice(0, split), slice(split, T)
    true_TK = next_ids_TK[test]
    # ridge probe on standardised features plus a bias column
    mu_D, sd_D = x_TD[fit].mean(0), x_TD[fit].std(0).clamp_min(1e-6)
    feats = lambda x: torch.cat([(x - mu_D) / sd_D, torch.ones(x.shape[0], 1)], 1).double()  # noqa: E731
    a_TD, y_TE = feats(x_TD[fit]), multi_hot(next_ids_TK[fit], num_experts).double()
    gram = a_TD.T @ a_TD + ridge * a_TD.shape[0] * torch.eye(a_TD.shape[1], dtype=torch.float64)
    w_DE = torch.linalg.solve(gram, a_TD.T @ y_TE)
    probe_TK = (feats(x_TD[test]) @ w_DE).topk(K, -1).indices
    gate_TK = (x_TD[test] @ next_gate_ED.float().T.cpu()).topk(K, -1).indices
    # previous token in the same window (the first position of each window has none)
    pos_T = torch.arange(T)[test] % seq_len
    prev_TK = next_ids_TK[torch.arange(T)[test] - 1]
    has_prev = pos_T > 0
    freq_K = torch.bincount(next_ids_TK[fit].flatten(), minlength=num_experts).topk(K).indices
    return {"probe": topk_recall(probe_TK, true_TK), "next_gate": topk_recall(gate_TK, true_TK),
            "prev_token": topk_recall(prev_TK[has_prev], true_TK[has_prev]),
            "frequent": topk_recall(freq_K.expand(true_TK.shape[0], K), true_TK),
            "chance": K / num_experts, "num_fit_tokens": split, "num_test_tokens": T - split}


def measure(model, windows_BS, args) -> dict:
    cfg = model.config
    layers = record_routing(model, windows_BS, args.batch_size)
    out = {"layers": [load_stats(ids, ent, cfg.num_experts) for _, ids, ent in layers], "next_layer": []}
    for l in range(len(layers) - 1):
        gate_ED = model.model.layers[l + 1].mlp.gate.weight
        out["next_layer"].append({"from_layer": l, **predict_next(layers[l][0], layers[l + 1][1], gate_ED,
                                                                   cfg.num_experts, args.seq_len, args.ridge)})
    return out


def summarise(result: dict) -> dict:
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"max_over_mean": mean([l["max_over_mean"] for l in result["layers"]]),
            "load_entropy_norm": mean([l["load_entropy_norm"] for l in result["layers"]]),
            "router_entropy_norm": mean([l["router_entropy_norm"] for l in result["layers"]]),
            **{k: mean([p[k] for p in result["next_layer"]])
               for k in ("probe", "next_gate", "prev_token", "frequent", "chance")}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.model is None:
        from moe_infer.assets import default_model_path

        args.model = default_model_path()
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model)
    defaults = train_tiny_moe.parse_args(["--out-dir", "unused"])
    _, val_docs, _ = train_tiny_moe.collect_corpus(defaults.max_file_bytes, defaults.val_permille)
    ids = train_tiny_moe.encode_docs(tok.backend_tokenizer, val_docs)
    num_windows = min(args.max_tokens, ids.size) // args.seq_len
    if num_windows < 2:
        raise ValueError(f"need at least 2 windows of {args.seq_len} validation tokens, have {ids.size} tokens")
    windows_BS = torch.from_numpy(ids[:num_windows * args.seq_len].astype("int64")).view(num_windows, -1).to(device)

    trained = Qwen3MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    torch.manual_seed(args.seed)
    random_init = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(args.model)).float().to(device).eval()
    result = {"device": device_name, "model": str(args.model), "python": sys.version.split()[0],
              "num_tokens": num_windows * args.seq_len, "seq_len": args.seq_len,
              "num_experts": trained.config.num_experts, "top_k": trained.config.num_experts_per_tok,
              "feature": "router input of layer l (post-attention RMSNorm output), predicting layer l+1's top-k",
              "trained": measure(trained, windows_BS, args), "random_init": measure(random_init, windows_BS, args)}
    result["summary"] = {name: summarise(result[name]) for name in ("trained", "random_init")}
    result["seconds"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'model':12s} {'max/mean':>8s} {'loadH':>6s} {'routH':>6s} {'probe':>6s} {'gate':>6s} "
          f"{'prev':>6s} {'freq':>6s} {'chance':>6s}")
    for name, s in result["summary"].items():
        print(f"{name:12s} {s['max_over_mean']:8.2f} {s['load_entropy_norm']:6.3f} {s['router_entropy_norm']:6.3f} "
              f"{s['probe']:6.3f} {s['next_gate']:6.3f} {s['prev_token']:6.3f} {s['frequent']:6.3f} {s['chance']:6.3f}")
    return result


if __name__ == "__main__":
    main()
