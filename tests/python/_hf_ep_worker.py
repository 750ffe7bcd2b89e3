"""One rank of the transformers expert-parallel test (test_hf.py): python _hf_ep_worker.py RANK
WORLD DIR. Loads DIR/model (a tiny saved model) with transformers' expert parallelism over the
gloo world, once per EP mode ("all_to_all": tokens exchanged; "all_reduce": every rank runs its
own experts on the whole batch, other ranks' routes passed as off-rank ids), runs one forward and
backward with transformers' "grouped_mm" experts, then with moegrad.hf.apply, and writes
DIR/rank{RANK}.pt: per mode, both runs' loss, logits and local gradients, moegrad's report and
how many off-rank ids its experts received."""
import os
import sys

import torch
import torch.distributed as dist

rank, world, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                  LOCAL_WORLD_SIZE=str(world))
dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rdv')}", rank=rank,
                        world_size=world)

import transformers as tf  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import moegrad.hf as mh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ep_worker import finish  # noqa: E402

case = torch.load(os.path.join(out_dir, "case.pt"))


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def step(model):
    out = model(case["ids"], labels=case["ids"])
    out.loss.backward()
    grads = {n: local(p.grad).detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return dict(loss=out.loss.detach(), logits=out.logits.detach(), grads=grads)


results = {}
for mode in ("all_to_all", "all_reduce"):
    model = tf.AutoModelForCausalLM.from_pretrained(
        os.path.join(out_dir, "model"), experts_implementation="grouped_mm",
        distributed_config=DistributedConfig(ep_size=world, tp_plan={}, ep_implementation=mode))
    model.train()
    ref = step(model)
    report = mh.apply(model)
    off_rank = []
    run_experts = mh._run_experts

    def counting(m, plan, x, idx, w):  # the ids as the backend receives them
        off_rank.append(int((idx >= m.num_experts).sum()))
        return run_experts(m, plan, x, idx, w)
    mh._run_experts = counting
    got = step(model)
    mh._run_experts = run_experts
    results[mode] = dict(ref=ref, got=got, report=str(report), off_rank=sum(off_rank),
                         patched=[e.name for e in report.patched if e.kind == "experts"])
torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
finish()
