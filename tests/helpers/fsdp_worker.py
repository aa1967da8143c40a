"""torchrun worker for test_trainer_fsdp.py: the tiny setup under FSDP2, one launch for every check.

In `out_root` it runs, on all ranks:
  full/    an uninterrupted run (micro-batch 1: two accumulated micro-batches per rank),
           then an evaluation over 3 held-out samples (an uneven split over 2 ranks);
  killed/  a run stopped after 3 steps (last checkpoint at step 2), then resumed to the end;
  comm/    one step with micro-batch 1 and one with micro-batch 2, counting gradient
           reduce-scatters (accumulation must not add any).
Rank 0 writes full.pt, resumed.pt and comm.pt.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, where the helpers package lives

from helpers.targets import make_tiny_target  # noqa: E402
from helpers.training import fit_killed_after, synthetic_samples, tiny_trainer  # noqa: E402

from dspark.data.dataset import RenderedSource  # noqa: E402
from dspark.training.distributed import setup_distributed  # noqa: E402


def fsdp_trainer(target, out_dir: str):
    return tiny_trainer(target, out_dir, distributed="fsdp", micro_batch_size=1)


def reduce_scatters_in_one_step(target, out_dir: str, micro: int) -> int:
    """Gradient reduce-scatters FSDP issues in one optimizer step (2 samples per rank)."""
    trainer = tiny_trainer(target, out_dir, distributed="fsdp", micro_batch_size=micro)
    original, calls = dist.reduce_scatter_single, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        trainer.train_step()
    finally:
        dist.reduce_scatter_single = original
    return len(calls)


def main(out_root: str) -> None:
    rank, world, _ = setup_distributed()
    assert world == 2, "launch with --nproc_per_node=2"
    target = make_tiny_target("qwen3")

    full = fsdp_trainer(target, f"{out_root}/full")
    assert full.fsdp
    full.fit()
    sharded = all(isinstance(p, DTensor) for p in full.drafter.parameters())
    params = full.drafter_state_dict()
    full.eval_data = RenderedSource(synthetic_samples(target.vocab_size, n=3, seed=5))
    evaluation = full.evaluate()

    killed = fsdp_trainer(target, f"{out_root}/killed")
    fit_killed_after(killed, 3)
    resumed = fsdp_trainer(target, f"{out_root}/killed")
    resumed.fit(resume=True)
    resumed_params = resumed.drafter_state_dict()

    comm = {micro: reduce_scatters_in_one_step(target, f"{out_root}/comm{micro}", micro) for micro in (1, 2)}

    if rank == 0:
        torch.save({"params": params, "history": full.history, "eval": evaluation, "sharded": sharded}, f"{out_root}/full.pt")
        torch.save({"params": resumed_params, "step": resumed.step}, f"{out_root}/resumed.pt")
        torch.save(comm, f"{out_root}/comm.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
