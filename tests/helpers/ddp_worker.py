"""torchrun worker for test_trainer.py: trains the tiny setup on N ranks and saves the parameters."""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, where the helpers package lives

from helpers.targets import make_tiny_target  # noqa: E402
from helpers.training import tiny_trainer  # noqa: E402

from dspark.training.distributed import setup_distributed  # noqa: E402


def main(out_dir: str, micro: int) -> None:
    rank, world, _ = setup_distributed()
    target = make_tiny_target("qwen3")
    trainer = tiny_trainer(target, out_dir, micro_batch_size=micro)
    trainer.fit()
    if rank == 0:
        torch.save({k: v.clone() for k, v in trainer.drafter.state_dict().items()}, f"{out_dir}/params.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
