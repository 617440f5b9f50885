"""The mesh's single-process pieces: ParallelDims, stage layers, head split, start-up checks, the step as
tensors, the result packing, the pipeline scheduler, and the loader's per-rank slices (checked against
the checkpoint's tensors sliced by hand)."""
from __future__ import annotations

import pytest
import torch

from moe_infer import LLM
from moe_infer.config import ParallelConfig
from moe_infer.engine.block_manager import BlockManager
from moe_infer.engine.sampling_params import SamplingParams
from moe_infer.engine.scheduler import Scheduler
from moe_infer.engine.sequence import Sequence
from moe_infer.engine.step_inputs import StepDecoder, StepEncoder, flat_inputs, message_layout, message_sizes, plan_requests
from moe_infer.layers.attention import head_split
from moe_infer.layers.tensor_parallel import ShardGroup
from moe_infer.models import ModelShard, load_model
from moe_infer.models.decoder import MissingLayer
from moe_infer.parallel import ParallelDims, init
from moe_infer.parallel.dims import stage_layers
from moe_infer.parallel.step_message import PATH_EAGER, pack_result, result_size, unpack_result
from tiny_hf import make_tiny_checkpoint, read_state_dict

pytestmark = pytest.mark.timeout(120)


def test_dims_derive_the_stage_and_check_the_world():
    d = ParallelDims(world_size=8, pp=2, tp=2, ep=4)
    assert (d.stage_size, d.dp, d.moe_tp) == (4, 2, 1)
    d = ParallelDims(world_size=2, tp=2, ep=1)  # tensor-parallel MoE
    assert (d.stage_size, d.dp, d.moe_tp) == (2, 1, 2)
    d = ParallelDims(world_size=4, pp=2, tp=1, ep=2)
    assert (d.stage_size, d.dp, d.moe_tp, d.coords(3), d.rank_of(1, 0)) == (2, 2, 1, (1, 1), 2)
    with pytest.raises(ValueError, match=r"torchrun started 4 process\(es\).*needs 1"):
        ParallelDims(world_size=4)  # torchrun without parallel sizes: no silent duplicate engines
    with pytest.raises(ValueError, match=r"parallel.pp=2 x lcm\(parallel.tp=2, parallel.ep=4\)=4 needs 8"):
        ParallelDims(world_size=4, pp=2, tp=2, ep=4)
    with pytest.raises(ValueError, match="ep must be positive"):
        ParallelDims(world_size=4, ep=0)


def test_stage_layers_even_uneven_and_given():
    assert stage_layers(8, 2) == [(0, 4), (4, 8)]
    assert stage_layers(7, 3) == [(0, 2), (2, 5), (5, 7)]  # the extra layer on a middle stage
    assert stage_layers(9, 4) == [(0, 2), (2, 4), (4, 7), (7, 9)]
    assert stage_layers(3, 2) == [(0, 2), (2, 3)]
    assert stage_layers(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="summing to the model's 5 layers"):
        stage_layers(5, 2, [2, 2])
    with pytest.raises(ValueError, match="every stage needs a layer"):
        stage_layers(2, 3)
    with pytest.raises(ValueError, match="parallel.pp_layer_partition"):
        ParallelConfig(pp=2, pp_layer_partition=[3])


def _group(rank: int, size: int) -> ShardGroup:
    return ShardGroup(object(), rank, size)  # no collective runs in these tests


def test_head_split_replicates_kv_heads_below_tp():
    s = head_split(8, 4, _group(1, 2))
    assert (s.num_heads, s.num_kv_heads, s.q_start, s.kv_start, s.kv_replicas) == (4, 2, 4, 2, 1)
    s = head_split(8, 2, _group(3, 4))  # 2 KV heads, 4 ranks: ranks 2, 3 share KV head 1
    assert (s.num_heads, s.num_kv_heads, s.q_start, s.kv_start, s.kv_replicas) == (2, 1, 6, 1, 2)
    assert 6 // (8 // 2) == s.kv_start  # query head 6 reads KV head 6 // G
    assert head_split(8, 2, _group(1, 4)).kv_start == 0  # query heads 2, 3 read KV head 0
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible"):
        head_split(6, 2, _group(0, 4))
    with pytest.raises(ValueError, match="num_key_value_heads=3 < tp=4 must divide tp"):
        head_split(12, 3, _group(0, 4))


def test_start_up_checks_name_the_fix(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2 -m moe_infer.launch parallel.tp=2"):
        init(ParallelConfig(tp=2), device="cpu")
    with pytest.raises(RuntimeError, match="run as 8 processes"):
        init(ParallelConfig(tp=2, pp=2, ep=4), device="cpu")
    with pytest.raises(ValueError, match="offloaded experts work with expert parallelism only"):
        LLM(offload="cpu", tp=2, device="cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun --nproc-per-node 2 with no parallel sizes
    with pytest.raises(ValueError, match=r"torchrun started 2 process\(es\) \(WORLD_SIZE\)"):
        init(ParallelConfig(), device="cpu")


def _seq(n: int, first: int, **params) -> Sequence:
    return Sequence(f"r{first}", list(range(first, first + n)), SamplingParams(max_tokens=8, **params))


def test_step_message_carries_what_the_sampler_needs_and_params_once():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, 8, 64, 128)
    a, b = _seq(5, 10, seed=3, temperature=0.5), _seq(6, 40, repetition_penalty=1.3, logprobs=2)
    sched.add(a), sched.add(b)
    enc, dec = StepEncoder(4), StepDecoder()

    def encode(plan):
        flat, sizes = flat_inputs(plan, 4)
        return enc.encode(plan, sizes, PATH_EAGER, 0, flat.nbytes), flat

    plan = sched.schedule()
    msg, _ = encode(plan)
    assert msg.side.numel() > 0  # two new SamplingParams
    finished, reqs = dec.decode(msg)
    assert finished == [] and reqs == plan_requests(plan)
    sched.postprocess(plan, [7, 8])
    sched.abort(a)
    plan = sched.schedule()
    msg, flat = encode(plan)
    assert msg.side.numel() == 0  # b's params were sent already
    finished, reqs = dec.decode(msg)
    assert finished == [a.seq_id] and a.seq_id not in dec.params
    assert reqs == plan_requests(plan) and reqs[0].history == b.token_ids
    flat = flat.tolist()
    assert flat[:2] == [8, 6]  # b decodes: its token 8 (T = 1) at position 6
    assert message_layout(msg) == (message_sizes(msg), PATH_EAGER, 0, 8 * len(flat))


def test_result_packing_round_trips_tokens_and_logprobs():
    counts = [None, 0, 2]
    tokens = [5, 17, 3]
    lps = [None, (-0.5, 1, [], []), (-1.25, 2, [9, 3], [-0.75, -1.25])]
    buf = pack_result(tokens, lps, counts)
    assert buf.numel() == result_size(counts) == 1 + 3 + 7
    assert unpack_result(buf, counts) == (tokens, lps)


def test_pipeline_scheduler_keeps_in_flight_sequences_out():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, 128, num_batches=2)
    seqs = [_seq(3, 10 * (i + 1), ignore_eos=True) for i in range(4)]
    for q in seqs:
        sched.add(q)
    p1 = sched.schedule()
    p2 = sched.schedule()  # the other half: p1's sequences are in flight
    assert [s.seq_id for s in p1.seqs] == [q.seq_id for q in seqs[:2]]
    assert [s.seq_id for s in p2.seqs] == [q.seq_id for q in seqs[2:]]
    assert sched.schedule().is_empty  # everything is in flight
    sched.postprocess(p1, [1, 1])
    p3 = sched.schedule()
    assert [s.seq_id for s in p3.seqs] == [q.seq_id for q in seqs[:2]] and all(len(s.token_ids) == 1 for s in p3.seqs)


def test_pipeline_scheduler_never_preempts_a_sequence_in_flight():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, 8, 64, 128, num_batches=2)
    old, new = _seq(8, 10, ignore_eos=True), _seq(8, 30, ignore_eos=True)
    sched.add(old), sched.add(new)
    p1 = sched.schedule()  # old (2 blocks)
    p2 = sched.schedule()  # new (2 blocks): the cache is full
    sched.postprocess(p1, [1])  # old now has 9 tokens; its next step needs a third block
    p3 = sched.schedule()
    assert p3.is_empty and new.in_flight and sched.num_preemptions == 0  # new is in flight: wait for it
    sched.postprocess(p2, [1])
    p4 = sched.schedule()
    assert sched.num_preemptions == 1 and [s.seq_id for s in p4.seqs] == [old.seq_id]


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_loader_reads_each_ranks_slices(family, tmp_path):
    """Rank 1 of tp=2, moe_tp=2, stage 1 of 2: its heads, F rows and vocab rows, nothing of stage 0."""
    path = make_tiny_checkpoint(family, tmp_path / family, seed=3, vocab_size=161, num_hidden_layers=3)
    sd = read_state_dict(path)
    tp = _group(1, 2)
    shard = ModelShard(tp=tp, moe_tp=tp, layer_start=2, layer_end=3, is_first_stage=False, stage=1, num_stages=2)
    model = load_model(path, torch.float32, "cpu", shard=shard)
    assert isinstance(model.layers[0], MissingLayer) and model.embed_tokens is None
    a = model.arch
    d, H, Hkv = a.head_dim, a.num_heads // 2, a.num_kv_heads // 2
    att = model.layers[2].self_attn
    q = sd["model.layers.2.self_attn.q_proj.weight"][H * d:2 * H * d]
    k = sd["model.layers.2.self_attn.k_proj.weight"][Hkv * d:2 * Hkv * d]
    assert torch.equal(att.qkv_proj.weight[:H * d], q) and torch.equal(att.qkv_proj.weight[H * d:(H + Hkv) * d], k)
    assert torch.equal(att.o_proj.weight, sd["model.layers.2.self_attn.o_proj.weight"][:, H * d:])
    w13, w2 = model.layers[2].mlp.store.weights()
    F = a.moe_intermediate_size
    gate_up = sd["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(w13[:, :F // 2], gate_up[:, F // 2:F]) and torch.equal(w13[:, F // 2:], gate_up[:, F + F // 2:])
    assert torch.equal(w2, sd["model.layers.2.mlp.experts.down_proj"][:, :, F // 2:])
    head = sd["lm_head.weight"]
    assert model.lm_head.weight.shape[0] == 81 and torch.equal(model.lm_head.weight[:80], head[81:])
    assert not model.lm_head.weight[80:].any()  # padding row (vocab 161 over 2 ranks)
    if family == "olmoe":  # q/k norm over the whole projection: this rank's slice of the weights
        assert torch.equal(att.q_norm.weight, sd["model.layers.2.self_attn.q_norm.weight"][H * d:])


def test_force_mesh_runs_the_one_rank_collectives_and_the_same_tokens(monkeypatch, tmp_path):
    """parallel.force_mesh at tp = pp = ep = 1: the mesh's path with process groups of one rank whose collectives
    still run (what benchmarks/mesh_scaling.py measures the mesh's cost with), greedy tokens of the plain engine."""
    import torch.distributed as dist

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "force_mesh", seed=7)
    want = [o.outputs[0].token_ids for o in LLM(model=path, device="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False)]
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    llm = LLM(model=path, device="cpu", dtype="float32", force_mesh=True)
    try:
        assert llm.engine.parallel.is_distributed and llm.engine.executor.lookahead
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()  # the process group of one rank goes: the tests after this one run without it
    assert got == want
    layers = llm.engine.runner.arch.num_layers
    assert len(calls) >= 2 * layers * 7  # each step: attention's and the MoE layer's all-reduce in every layer


def test_mesh_shutdown_frees_the_graphs_before_the_process_groups(monkeypatch, tmp_path):
    """NCCL's communicator teardown hangs while a CUDA graph that captured its collectives is alive
    (pytorch/pytorch#115388; both ranks hung in destroy_process_group on 2 x H200): `LLM.shutdown` frees the engine's
    graphs first. CPU: stand-in graphs in the runner's graph holders, the order of reset and destroy recorded."""
    from types import SimpleNamespace

    import torch.distributed as dist

    events = []

    class Graph:
        def reset(self):
            events.append("reset")

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "teardown", seed=7)
    llm = LLM(model=path, device="cpu", dtype="float32", force_mesh=True)
    real = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: (events.append("destroy"), real(*a, **k))[1])
    runner = llm.engine.runner
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        holders = [SimpleNamespace(graphs={(1, 2): ([Graph(), Graph()], None)}), SimpleNamespace(graphs={})]
        runner.graphs, runner.extend_graphs = holders
    finally:
        llm.shutdown()
    assert events == ["reset", "reset", "destroy"] and holders[0].graphs == {}
