"""EngineCore with two clients (two API server processes' pipes), run in a thread over a real tiny LLMEngine: each
client gets its own requests' deltas only, rebuilt into the offline engine's outputs; a request id in use by the
other client fails alone; an error outside a step fails each client's own requests, and the loop goes on; a
client that says "shutdown" gets ("stopped", None), its requests are aborted and the other client goes on; the
loop ends when both have left."""
from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from moe_infer import LLM, SamplingParams
from moe_infer.assets import default_model_path
from moe_infer.engine.core_proc import DirectSender, EngineCore
from moe_infer.engine.llm_engine import LLMEngine
from moe_infer.engine.output_delta import OutputAssembler

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a1": "def f(x):", "a2": "class Stack:", "b1": "import os", "b2": "def main():"}


class Client:
    def __init__(self) -> None:
        self.cmd_read, self.cmd_write = mp.Pipe(duplex=False)
        self.res_read, self.res_write = mp.Pipe(duplex=False)
        self.assemblers = {}

    def add(self, engine: LLMEngine, rid: str, params=GREEDY) -> None:
        ids = engine.tokenizer(PROMPTS[rid])["input_ids"]
        self.assemblers[rid] = OutputAssembler(rid, PROMPTS[rid], ids, params.n)
        self.cmd_write.send(("add", rid, {"prompt_token_ids": ids, "prompt": PROMPTS[rid]}, params))

    def read_until(self, done, timeout: float = 60.0) -> list:
        """Messages until done(messages) holds; outputs are applied to the assemblers."""
        msgs = []
        while not done(msgs):
            assert self.res_read.poll(timeout), f"no message in {timeout} s; so far {msgs}"
            msg = self.res_read.recv()
            msgs.append(msg)
            if msg[0] == "outputs":
                for wire in msg[1]:
                    assert wire[0] in self.assemblers, f"another client's delta: {wire[0]}"
                    self.assemblers[wire[0]].apply(wire)
        return msgs


def finished(client: Client, rids) -> bool:
    return all(client.assemblers[r].choices[0].finish_reason is not None for r in rids)


def test_two_clients_share_one_engine_core(monkeypatch):
    path = default_model_path()
    llm = LLM(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4)
    offline = {rid: o.outputs[0].token_ids for rid, o in
               zip(PROMPTS, llm.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False))}
    engine = LLMEngine(llm.engine.cfg, path, detokenize=False)
    a, b = Client(), Client()
    core = EngineCore(engine, [a.cmd_read, b.cmd_read], [DirectSender(a.res_write), DirectSender(b.res_write)])
    loop = threading.Thread(target=core.serve, daemon=True)
    loop.start()

    for rid in ("a1", "a2"):
        a.add(engine, rid)
    for rid in ("b1", "b2"):
        b.add(engine, rid)
    a.read_until(lambda _: finished(a, ["a1", "a2"]))
    b.read_until(lambda _: finished(b, ["b1", "b2"]))
    for client in (a, b):
        for rid, asm in client.assemblers.items():
            assert asm.choices[0].token_ids == offline[rid] and asm.choices[0].finish_reason == "length", rid

    # a request id the other client has in flight fails alone
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    b.add(engine, "b1", long)
    b.read_until(lambda m: any(x[0] == "outputs" for x in m))  # b1 runs
    a.assemblers["b1"] = None
    a.cmd_write.send(("add", "b1", {"prompt_token_ids": [1, 2, 3]}, GREEDY))
    msgs = a.read_until(lambda m: any(x[0] == "failed" for x in m))
    assert msgs[-1][:2] == ("failed", ["b1"]) and "in use" in msgs[-1][2]
    del a.assemblers["b1"]

    # an error outside a step: each client hears of its own requests only, and the loop goes on
    a.add(engine, "a1", long)
    real_step, calls = engine.step, {"n": 0}

    def broken_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("scheduler bug")
        return real_step(*args, **kw)

    monkeypatch.setattr(engine, "step", broken_step)
    fa = a.read_until(lambda m: any(x[0] == "failed" for x in m))[-1]
    fb = b.read_until(lambda m: any(x[0] == "failed" for x in m))[-1]
    assert fa == ("failed", ["a1"], "RuntimeError: scheduler bug")
    assert fb == ("failed", ["b1"], "RuntimeError: scheduler bug")
    monkeypatch.setattr(engine, "step", real_step)

    # b leaves with a request running: it is aborted, b is told, a goes on
    b.add(engine, "b2", long)
    b.read_until(lambda m: any(x[0] == "outputs" for x in m))
    b.cmd_write.send(("shutdown",))
    assert b.read_until(lambda m: m and m[-1][0] == "stopped")[-1] == ("stopped", None)
    a.add(engine, "a2")
    a.read_until(lambda _: finished(a, ["a2"]))
    assert a.assemblers["a2"].choices[0].token_ids == offline["a2"]
    assert loop.is_alive() and not engine.requests  # b2 is gone: aborted when b left

    a.cmd_write.send(("shutdown",))
    assert a.read_until(lambda m: m and m[-1][0] == "stopped")[-1] == ("stopped", None)
    loop.join(30)
    assert not loop.is_alive()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
