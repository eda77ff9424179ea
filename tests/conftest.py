import pytest
import torch

# One intra-op thread: `invoke test` runs two workers on two cores, and the gloo tests' ranks each
# take one; at these widths a second thread gains little, and two spinning OpenMP threads on a
# core another process holds are many times slower.
torch.set_num_threads(1)


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides that make the default recipe a seconds-long run writing into tmp_path."""
    return ["train.steps=30", "train.micro_batch_size=4", "train.seq_len=64", "train.warmup_steps=5",
            "model.hidden_size=64", "model.num_heads=4", "model.head_dim=16",
            "model.moe_intermediate_size=64", "model.num_layers=2", "data.max_bytes=300000",
            "log.every=10", f"log.run_dir={tmp_path / 'run'}"]


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that leaves this process's default process group set breaks every later test that
    builds one (the memory plan's fake world, the one-rank gloo tests): fail the test that did it."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialised")
