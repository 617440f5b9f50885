import sys, torch, tempfile, pathlib, importlib.util
sys.path.insert(0, "tests")
import parity_cases as pc
from tiny_hf import load_hf_model
from moe_infer.models import load_model
from paged_sim import PagedSim, run_schedule
print("kernels pkg:", importlib.util.find_spec("kernels") is not None)
tmp = pathlib.Path(tempfile.mkdtemp())
fam, ov = pc.CASES["gpt_oss"]
path = pc.make_tiny_checkpoint(fam, tmp / "g", seed=3, **ov)
out = {}
for dev in ["cpu", "cuda"]:
    m = load_model(path, torch.float32, dev, attn_backend="torch")
    tokens = pc.make_tokens(m.arch.vocab_size, seed=1)
    o = run_schedule(PagedSim(m, block_size=4, num_blocks=32, seed=2, device=dev), tokens, pc.SCHEDULE)
    out["ours", dev] = torch.cat([o[s].cpu() for s in tokens])
    hf = load_hf_model(path).to(dev)
    print(dev, "hf mlp forward:", type(hf.model.layers[0].mlp).forward, getattr(hf.model.layers[0].mlp, "kernel_layer_name", None))
    out["hf", dev] = torch.cat([v.cpu() for v in pc.hf_logits(hf, tokens, dev).values()])
for a in out:
    for b in out:
        if a < b:
            print(a, b, float((out[a] - out[b]).abs().max()))
# layer by layer: hf cpu vs cuda on one sequence with hooks
hf_c = load_hf_model(path); hf_g = load_hf_model(path).cuda()
ids = torch.tensor([tokens[0]])
acts = {}
def hook(name, store):
    def f(mod, inp, outp):
        store[name] = (outp[0] if isinstance(outp, tuple) else outp).detach().float().cpu()
    return f
sc, sg = {}, {}
for n, mod in hf_c.named_modules():
    if n.count(".") <= 3 and n: mod.register_forward_hook(hook(n, sc))
for n, mod in hf_g.named_modules():
    if n.count(".") <= 3 and n: mod.register_forward_hook(hook(n, sg))
with torch.no_grad():
    hf_c(ids); hf_g(ids.cuda())
for n in sc:
    if n in sg and sc[n].shape == sg[n].shape:
        d = float((sc[n] - sg[n]).abs().max())
        if d > 1e-4: print("diverge", n, d)
