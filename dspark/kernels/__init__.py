"""CPU kernels of the target's and drafter's products: packed few-row linears, attention choice, the LM-head projection."""
