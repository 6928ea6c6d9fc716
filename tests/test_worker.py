"""CPU checks of the worker's host-side bookkeeping (the GPU suite runs the worker itself)."""

import torch

from sglang_dflash.worker import StepBuffers


def test_step_buffers_alternate_so_a_step_never_overwrites_the_previous_results():
    bufs = StepBuffers(block_size=4, device="cpu")
    first = bufs.take(3, torch.int64)
    second = bufs.take(3, torch.int64)
    third = bufs.take(3, torch.int64)
    for name in ("block_ids", "candidates", "out_tokens", "bonus", "commit_len", "new_seq_lens"):
        assert first[name].data_ptr() != second[name].data_ptr()  # step N+1 writes elsewhere
        assert first[name].data_ptr() == third[name].data_ptr()  # step N+2 reuses step N's set
    assert first["out_tokens"].shape == (3, 4) and first["accept_len"].dtype == torch.int32
    assert first["block_ids"].is_contiguous() and first["new_seq_lens"].dtype == torch.int64


def test_step_buffers_grow_with_the_batch_and_follow_the_seq_len_dtype():
    bufs = StepBuffers(block_size=2, device="cpu")
    small = bufs.take(2, torch.int64)
    bufs.take(2, torch.int64)
    big = bufs.take(40, torch.int64)
    assert big["positions"].shape == (40, 2) and big["positions"].data_ptr() != small["positions"].data_ptr()
    assert bufs.take(1, torch.int32)["new_seq_lens"].dtype == torch.int32
