"""The gated-delta-net verify without per-token state snapshots (sglang_dflash/gdn_state.py, on with
SGLANG_DFLASH_GDN_STATE=saved).

tests/gdn_state_check.py runs the installed release's recurrent kernel under the Triton interpreter,
the plugin's way and SGLang's, over seven steps: widths 4, 2, 4, 1, 4, 2, 2, short and whole accepts,
track boundaries crossed (also by a whole accept, and by a row without a track slot), a padded verify
row, a verify padded past the snapshot buffer's rows and one padded past 64 rows. Outputs and the whole state pool must be the same bits after every step.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash import gdn_state
from sglang_dflash.config import GDN_STATE_ENV, DFlashConfigError, gdn_state_mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_saved_state_commits_the_snapshot_verifys_states_bit_for_bit():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-m", "tests.gdn_state_check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    steps = json.loads(out.stdout.strip().splitlines()[-1])
    assert [s["width"] for s in steps] == [4, 2, 4, 1, 4, 2, 2]
    assert all(s["outputs_equal"] and s["states_equal"] and s["states_moved"] for s in steps), steps


@pytest.mark.gpu
def test_on_the_gpu_too_through_sglangs_scatter_and_its_launch():
    out = subprocess.run([sys.executable, "-m", "tests.gdn_state_check", "cuda"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert len(json.loads(out.stdout.strip().splitlines()[-1])) == 7


def test_the_mode_is_named_or_refused_in_one_line(monkeypatch):
    monkeypatch.delenv(GDN_STATE_ENV, raising=False)
    assert gdn_state_mode() == "snapshots"
    monkeypatch.setenv(GDN_STATE_ENV, " Saved ")
    assert gdn_state_mode() == "saved"
    monkeypatch.setenv(GDN_STATE_ENV, "replay")
    with pytest.raises(DFlashConfigError, match="'replay' is not one of snapshots, saved"):
        gdn_state_mode()


def fake_backend(flashinfer=False, snapshots=(2, 3, 4, 1, 2, 2), **cache_fields):
    cache = SimpleNamespace(temporal=torch.zeros(2, 3, 1, 2, 2), intermediate_ssm=torch.zeros(*snapshots),
                            conv=[], intermediate_conv_window=[], **cache_fields)
    dispatcher = SimpleNamespace(target_verify=lambda **kw: "snapshot", verify_kernel_is_flashinfer=flashinfer)
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(mamba_cache=cache))
    return SimpleNamespace(linear_attn_backend=SimpleNamespace(kernel_dispatcher=dispatcher, req_to_token_pool=pool))


def test_what_keeps_the_snapshots_is_named():
    assert gdn_state.saved_state_unserved(fake_backend()) is None
    assert gdn_state.saved_state_unserved(SimpleNamespace()) == "the linear-attention backend has no kernel dispatcher"
    assert gdn_state.saved_state_unserved(fake_backend(flashinfer=True)) == "FlashInfer's gated-delta-net verify"
    assert "fewer than two steps" in gdn_state.saved_state_unserved(fake_backend(snapshots=(2, 3, 1, 1, 2, 2)))
    assert gdn_state.saved_state_unserved(fake_backend(replayssm_d=torch.zeros(1))) == "--enable-linear-replayssm-spec"
    for side, field in (("short_conv_pool", "conv_state"), ("ngram_pool", "context")):
        backend = fake_backend()
        setattr(backend.linear_attn_backend.req_to_token_pool, side, SimpleNamespace(**{field: torch.zeros(1)}))
        assert f"a side state beside the recurrent one ({side};" in gdn_state.saved_state_unserved(backend)
        setattr(backend.linear_attn_backend.req_to_token_pool, side, SimpleNamespace(**{field: None}))
        assert gdn_state.saved_state_unserved(backend) is None
    backend = fake_backend()
    backend.linear_attn_backend.req_to_token_pool.mamba_pool.mamba_cache.intermediate_ssm = None
    assert "no per-token state snapshots" in gdn_state.saved_state_unserved(backend)


def test_pipeline_parallel_scratch_rows_keep_the_snapshots(monkeypatch):
    monkeypatch.setattr(gdn_state, "pp_spec_stable_rows", lambda: True)
    assert "SGLANG_ENABLE_PP_SPEC" in gdn_state.saved_state_unserved(fake_backend())
    monkeypatch.undo()
    assert gdn_state.pp_spec_stable_rows() is False  # off unless asked for, and absent before 0.5.22


def test_a_tree_verify_keeps_sglangs_snapshot_verify():
    class Dispatcher:
        def target_verify(self, **kwargs):
            return "snapshot"

    dispatcher = Dispatcher()
    backend = SimpleNamespace(linear_attn_backend=SimpleNamespace(kernel_dispatcher=dispatcher))
    saved = SimpleNamespace(verify=lambda **kwargs: "saved")
    gdn_state.install(backend, saved)
    gdn_state.install(backend, saved)  # once per backend: widths may share one
    assert dispatcher.target_verify(q=1) == "saved"
    assert dispatcher.target_verify(q=1, retrieve_parent_token=torch.zeros(1)) == "snapshot"
    assert Dispatcher().target_verify() == "snapshot"  # the class is untouched


def test_the_saved_states_and_inputs_lie_inside_the_snapshot_buffer():
    cache = fake_backend(snapshots=(2, 3, 4, 2, 8, 8)).linear_attn_backend.req_to_token_pool.mamba_pool.mamba_cache
    saved = gdn_state.GdnSavedState(cache)
    assert saved.layer_of(cache.intermediate_ssm[1]) == 1
    saved.saved()[1, 2].fill_(7.0)
    assert (cache.intermediate_ssm[1].view(-1)[2 * 128: 3 * 128] == 7.0).all()
    k, v = torch.ones(1, 12, 1, 8, dtype=torch.bfloat16), torch.ones(1, 12, 2, 8, dtype=torch.bfloat16)
    a = b = torch.ones(12, 2, dtype=torch.bfloat16)
    saved._lay_out_inputs(k, v, a, b)
    ends = []
    for name in gdn_state.INPUTS:
        t = saved.inputs[name]
        assert t.shape[:2] == (2, 12) and t.dtype == torch.bfloat16
        start = t.data_ptr() - cache.intermediate_ssm.data_ptr()
        assert start % gdn_state.ALIGN == 0 and start >= 3 * 128 * 4
        ends.append(start + t[0].numel() * 2)
    assert max(ends) <= cache.intermediate_ssm[0].numel() * 4
    saved.inputs["b"][1].fill_(1.0)  # layer 1's inputs lie in layer 1's buffer
    assert cache.intermediate_ssm[0].abs().sum() == 0 and cache.intermediate_ssm[1].abs().sum() > 0
