"""Test-wide settings."""

import torch

# One intra-op thread: the models here are tiny, and on a shared 2-core machine a second busy process
# turns torch's thread pool into a spin-wait that makes in-process runs 10-100× slower.
torch.set_num_threads(1)
