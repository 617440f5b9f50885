"""Train the tiny Qwen3-MoE that moe_infer ships as its embedded default model (issue 3).

One seeded run does everything: collect the corpus (the running interpreter's standard-library
`.py` sources, docstrings included, split train/validation by file), train a byte-level BPE
tokenizer with `tokenizers`, tokenize, train a transformers `Qwen3MoeForCausalLM` (bf16 autocast
on GPU, AdamW, warmup + cosine, router load-balancing aux loss on), log the validation loss
curve, and save `config.json` + `model.safetensors` (bf16) + tokenizer into `--out-dir`.

    python scripts/train_tiny_moe.py --out-dir moe_infer/assets/tiny_moe \
        --log-json benchmarks/results/tiny_moe_train_h100.json       # ~2 min on one H100
    python scripts/train_tiny_moe.py --smoke --out-dir /tmp/tiny_smoke  # CPU, seconds

The learning-rate schedule runs on progress = max(step / max_steps, elapsed / train_seconds), so
the cosine always finishes: with the step limit binding the run is step-for-step reproducible;
where the time limit binds first (slow machine) it stops early and the log says so.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True, help="checkpoint folder (config, safetensors, tokenizer)")
    ap.add_argument("--log-json", default=None, help="training log (corpus, loss curve, timing)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=6144)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--num-experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--train-seconds", type=float, default=270.0, help="training-loop time limit")
    ap.add_argument("--deadline-seconds", type=float, default=510.0, help="whole-script limit (8.5 min)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-val-seqs", type=int, default=256)
    ap.add_argument("--val-permille", type=int, default=30, help="share of files kept for validation (per 1000)")
    ap.add_argument("--max-file-bytes", type=int, default=400_000)
    ap.add_argument("--smoke", action="store_true", help="tiny corpus slice and a few steps (CPU check)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab_size, args.seq_len, args.batch_size = 512, 64, 4
        args.max_steps, args.warmup_steps, args.eval_every, args.max_val_seqs = 6, 2, 3, 4
    return args


def collect_corpus(max_file_bytes: int, val_permille: int, max_files: int | None = None):
    """Standard-library `.py` files of the running interpreter, split by a hash of the relative path.

    Returns (train_docs, val_docs, root), docs as sorted lists of (relpath, text). Undecodable
    (non-UTF-8) and larger-than-`max_file_bytes` files are skipped; site-packages is excluded.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    paths = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    train_docs, val_docs = [], []
    for path in paths[:max_files] if max_files else paths:
        if not path.is_file() or path.stat().st_size > max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(root).as_posix()
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 1000
        (val_docs if bucket < val_permille else train_docs).append((rel, text))
    if not train_docs or not val_docs:
        raise RuntimeError(f"corpus split is empty under {root}: {len(train_docs)} train, {len(val_docs)} val files")
    return train_docs, val_docs, root


def train_tokenizer(train_docs, vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with EOS and PAD specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for _, text in train_docs), trainer=trainer)
    return tok


def wrap_tokenizer(tok, model_max_length: int):
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=model_max_length)


def encode_docs(tok, docs) -> np.ndarray:
    """One token stream: each document's ids followed by EOS. Returns ids_S as uint16."""
    eos_id = tok.token_to_id(EOS_TOKEN)
    out = []
    for enc in tok.encode_batch([text for _, text in docs]):
        out.extend(enc.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.uint16)


def build_config(args, tok):
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    return Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.moe_intermediate * args.top_k, moe_intermediate_size=args.moe_intermediate,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2 * args.seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        output_router_logits=True, router_aux_loss_coef=args.aux_loss_coef,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id)


def lr_at(progress: float, step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model, args, device):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


@torch.no_grad()
def eval_loss(model, val_BS: torch.Tensor, batch_size: int, amp) -> float:
    """Mean next-token cross entropy over the fixed validation windows (no aux loss)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, val_BS.shape[0], batch_size):
        x = val_BS[i:i + batch_size]
        with amp():
            out = model(input_ids=x, labels=x, output_router_logits=False)
        total += out.loss.item() * x.shape[0]
        count += x.shape[0]
    model.train()
    return total / count


def pick_experts_impl(model, x, amp) -> str:
    """grouped_mm where its fwd+bwd runs on this machine (fp32 weights under autocast), else eager."""
    for impl in ("grouped_mm", "eager"):
        try:
            if hasattr(model, "set_experts_implementation"):
                model.set_experts_implementation(impl)
            else:  # older transformers: the config field is read at each forward
                model.config._experts_implementation = impl
            with amp():
                model(input_ids=x[:2], labels=x[:2]).loss.backward()
            model.zero_grad(set_to_none=True)
            return impl
        except Exception as exc:  # noqa: BLE001 - any failure means: try the next implementation
            print(f"experts implementation {impl} failed here ({type(exc).__name__}: {exc}); trying the next")
    raise RuntimeError("no experts implementation ran a forward/backward step")


@torch.no_grad()
def greedy_samples(model, hf_tok, device, prompts=("def fibonacci(n):", "import os\n", "class Stack:\n")):
    """Greedy continuations (48 tokens) from the just-trained model, printed as a first look."""
    model.eval()
    samples = {}
    for prompt in prompts:
        ids = hf_tok(prompt, return_tensors="pt").input_ids.to(device)
        out = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=hf_tok.pad_token_id)
        samples[prompt] = hf_tok.decode(out[0])
        print(f"--- {prompt!r}\n{samples[prompt]}")
    return samples


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_docs, val_docs, root = collect_corpus(args.max_file_bytes, args.val_permille,
                                                max_files=120 if args.smoke else None)
    tok = train_tokenizer(train_docs, args.vocab_size)
    train_ids = encode_docs(tok, train_docs)
    val_ids = encode_docs(tok, val_docs)
    t_data = time.time() - t0
    corpus = {"python": sys.version.split()[0], "stdlib_root": str(root),
              "num_train_files": len(train_docs), "num_val_files": len(val_docs),
              "train_bytes": sum(len(t.encode()) for _, t in train_docs),
              "val_bytes": sum(len(t.encode()) for _, t in val_docs),
              "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
              "val_files": [rel for rel, _ in val_docs]}
    print(f"corpus: {len(train_docs)} train / {len(val_docs)} val files, {train_ids.size} / {val_ids.size} "
          f"tokens, vocab {tok.get_vocab_size()}, data prep {t_data:.1f}s")

    config = build_config(args, tok)
    model = Qwen3MoeForCausalLM(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    S = args.seq_len
    num_val = min(args.max_val_seqs, val_ids.size // S)
    val_BS = torch.from_numpy(val_ids[:num_val * S].astype(np.int64)).view(num_val, S).to(device)
    train_t = torch.from_numpy(train_ids.astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)

    def batch():
        starts = torch.randint(0, train_t.numel() - S, (args.batch_size,), generator=gen)
        return torch.stack([train_t[s:s + S] for s in starts.tolist()]).to(device, non_blocking=True)

    impl = pick_experts_impl(model, batch(), amp)
    torch.manual_seed(args.seed)
    opt = make_optimizer(model, args, device)
    curve = [{"step": 0, "tokens": 0, "val_loss": eval_loss(model, val_BS, args.batch_size, amp)}]
    print(f"model: {num_params / 1e6:.2f}M params, experts impl {impl}, step 0 val loss {curve[0]['val_loss']:.3f}")
    train_log, stop_reason, step = [], "max_steps", 0
    t_train = time.time()
    train_limit = min(args.train_seconds, args.deadline_seconds - (time.time() - t0) - 60.0)
    while step < args.max_steps:
        elapsed = time.time() - t_train
        if elapsed > train_limit:
            stop_reason = f"time limit {train_limit:.0f}s"
            break
        lr = lr_at(max(step / args.max_steps, elapsed / train_limit), step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch()
        with amp():
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step % args.eval_every == 0 or step == args.max_steps:
            aux = out.aux_loss.item()
            train_log.append({"step": step, "loss": out.loss.item() - args.aux_loss_coef * aux, "aux_loss": aux,
                              "lr": lr, "grad_norm": grad_norm.item(), "seconds": time.time() - t_train})
        if step % args.eval_every == 0 or step == args.max_steps:
            curve.append({"step": step, "tokens": step * args.batch_size * S, "seconds": time.time() - t_train,
                          "val_loss": eval_loss(model, val_BS, args.batch_size, amp)})
            print(f"step {step} lr {lr:.2e} train {train_log[-1]['loss']:.3f} aux {train_log[-1]['aux_loss']:.3f} "
                  f"val {curve[-1]['val_loss']:.3f} ({time.time() - t_train:.0f}s)")
    if curve[-1]["step"] != step:
        curve.append({"step": step, "tokens": step * args.batch_size * S, "seconds": time.time() - t_train,
                      "val_loss": eval_loss(model, val_BS, args.batch_size, amp)})
    train_seconds = time.time() - t_train

    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size="64MB")
    hf_tok = wrap_tokenizer(tok, config.max_position_embeddings)
    hf_tok.save_pretrained(out_dir)
    samples = greedy_samples(model, hf_tok, device)
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log = {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
           "args": vars(args), "corpus": corpus, "num_params": num_params, "experts_impl": impl,
           "steps": step, "stop_reason": stop_reason, "train_seconds": train_seconds,
           "total_seconds": time.time() - t0, "checkpoint_bytes": size, "val_curve": curve, "train_log": train_log,
           "greedy_samples_bf16": samples}
    if args.log_json:
        Path(args.log_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log_json).write_text(json.dumps(log, indent=1))
    print(f"saved {out_dir} ({size / 1e6:.1f} MB) after {step} steps ({stop_reason}), "
          f"final val loss {curve[-1]['val_loss']:.3f}, total {time.time() - t0:.0f}s")
    return log


def Qwen3MoeForCausalLM(config):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(config)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
