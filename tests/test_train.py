"""The trainer on CPU: a tiny HF target, its own responses, a draft the plugin accepts at start-up."""

import json
import os

import pytest
import torch
from conftest import write_char_tokenizer

from sglang_dflash.config import TargetInfo, load_and_validate
from sglang_dflash.reference import speculative_generate, target_generate
from sglang_dflash.train import __main__ as cli
from sglang_dflash.train.data import HELD_OUT, regenerate, render, training_prompts
from sglang_dflash.train.batch import FrozenTarget, batch_loss, block_accept_lengths, block_batch, lm_loss
from sglang_dflash.train.held_out import accept_lengths_everywhere, evaluate, served_steps, split_eval
from sglang_dflash.train.trainer import TrainConfig, load_trained_draft, lr_at, run_progress, train

PROMPTS = [f"count {i} {'ab' * (i % 3)} go" for i in range(24)]


def write_tiny_target(path, config_class, model_class, **shape):
    """A random target with a character tokenizer and clear greedy choices, and its own responses."""
    tok = write_char_tokenizer(path)
    cfg = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                       eos_token_id=tok.eos_token_id, **shape)
    torch.manual_seed(0)
    model = model_class(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # clear greedy choices
    model.save_pretrained(path)
    examples = regenerate(path, PROMPTS, max_new_tokens=40, engine="hf", hf_model=model, tokenizer=tok)
    return path, model, tok, examples


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return write_tiny_target(str(tmp_path_factory.mktemp("target")), Qwen3Config, Qwen3ForCausalLM,
                             num_hidden_layers=6)


def acceptance(model, draft, tok, block_size):
    target = FrozenTarget(model, draft.cfg.target_layer_ids)
    from sglang_dflash.reference import draft_proposer

    accepted, steps = 0, 0
    for p in PROMPTS[:6]:
        ids = render(tok, p)
        truth = target_generate(target, ids, 24)
        got = speculative_generate(target, draft_proposer(draft, target), ids, 24, block_size,
                                   draft.cfg.mask_token_id, draft.cfg.target_layer_ids)
        assert got.tokens == truth  # lossless with a trained draft too
        accepted += sum(got.accept_lengths)
        steps += len(got.accept_lengths)
    return accepted / steps


def test_training_learns_the_target_and_writes_a_loadable_draft(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    assert all(len(e.ids) > e.response_start for e in examples)
    out = str(tmp_path / "draft")
    cfg = TrainConfig(out_dir=out, block_size=4, draft_layers=2, steps=160, batch_size=8, lr=3e-3,
                      anchors=16, save_every=80, max_length=128)
    train(model, tok, examples, cfg, log=lambda *a: None)
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    assert len(log) == 160
    first, last = sum(h["loss"] for h in log[:20]) / 20, sum(h["loss"] for h in log[-20:]) / 20
    assert last < 0.7 * first, (first, last)
    # The plugin's own start-up check accepts it against this target.
    resolved = load_and_validate(out, TargetInfo.from_pretrained(path))
    assert resolved.block_size == 4 and resolved.mask_token_id == tok.mask_token_id
    trained = acceptance(model, load_trained_draft(out), tok, 4)
    untrained_cfg = TrainConfig(out_dir=str(tmp_path / "untrained"), block_size=4, draft_layers=2, steps=0)
    train(model, tok, examples, untrained_cfg, log=lambda *a: None)
    untrained = acceptance(model, load_trained_draft(untrained_cfg.out_dir), tok, 4)
    assert trained > untrained + 0.3, (trained, untrained)


def test_resume_continues_from_the_saved_step(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    base = dict(out_dir=out, block_size=4, draft_layers=1, batch_size=4, anchors=8, save_every=5, max_length=96)
    train(model, tok, examples, TrainConfig(steps=10, **base), log=lambda *a: None)
    messages = []
    train(model, tok, examples, TrainConfig(steps=15, **base), resume=True, log=messages.append)
    assert messages == ["resumed from step 10"]
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 15
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "train_log.jsonl"))] == list(range(1, 16))


def test_time_budget_stops_early_and_still_writes_the_checkpoint(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    cfg = TrainConfig(out_dir=out, block_size=4, draft_layers=1, batch_size=4, anchors=8, save_every=1000,
                      max_length=96, steps=100_000, max_minutes=0.02)
    train(model, tok, examples, cfg, log=lambda *a: None)
    steps = [json.loads(x)["step"] for x in open(os.path.join(out, "train_log.jsonl"))]
    assert 1 <= len(steps) < 100_000 and steps == list(range(1, len(steps) + 1))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == len(steps)


def test_pause_then_resume_keeps_the_step_schedule(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    base = dict(out_dir=out, block_size=4, draft_layers=1, batch_size=4, anchors=8, save_every=1000, max_length=96)
    train(model, tok, examples, TrainConfig(steps=40, pause_after_minutes=0.0, **base), log=lambda *a: None)
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 1
    train(model, tok, examples, TrainConfig(steps=40, **base), resume=True, log=lambda *a: None)
    steps = [json.loads(x)["step"] for x in open(os.path.join(out, "train_log.jsonl"))]
    assert steps == list(range(1, 41))


def test_time_budget_spans_resumes_and_pause_counts_from_the_command_start(tiny_target, tmp_path):
    import time

    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    base = dict(out_dir=out, block_size=4, draft_layers=1, batch_size=4, anchors=8, save_every=1000, max_length=96,
                steps=100_000, max_minutes=0.05)
    # The command began an hour ago (regeneration, say): the pause is due after the first step.
    train(model, tok, examples, TrainConfig(pause_after_minutes=1.0, **base), log=lambda *a: None,
          started=time.monotonic() - 3600)
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 1 and 0 < state["train_seconds"] < 3
    train(model, tok, examples, TrainConfig(**base), resume=True, log=lambda *a: None)
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert state["train_seconds"] == pytest.approx(3.0, abs=1.0)  # the budget, not a fresh 3 s on top
    messages = []
    train(model, tok, examples, TrainConfig(**base), resume=True, log=messages.append)
    assert messages[-1].startswith("the training budget is spent")
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == state["step"]


def test_init_from_starts_with_the_given_weights_and_refuses_another_shape(tiny_target, tmp_path):
    from safetensors.torch import load_file

    path, model, tok, examples = tiny_target
    base = dict(block_size=4, draft_layers=1, batch_size=4, anchors=8, max_length=96)
    first = str(tmp_path / "first")
    train(model, tok, examples, TrainConfig(out_dir=first, steps=5, **base), log=lambda *a: None)
    again = str(tmp_path / "again")
    train(model, tok, examples, TrainConfig(out_dir=again, steps=0, init_from=first, **base), log=lambda *a: None)
    a, b = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit, match="fc.weight is .* this draft needs"):
        train(model, tok, examples, TrainConfig(out_dir=str(tmp_path / "two"), steps=0, init_from=first,
                                                **{**base, "draft_layers": 2}), log=lambda *a: None)


def test_held_out_examples_are_scored_at_each_save_and_never_trained_on(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    train_part, held = split_eval(examples, 4, seed=0)
    assert len(held) == 4 and len(train_part) == len(examples) - 4  # a response a prompt: 4 prompts
    assert not {id(e) for e in held} & {id(e) for e in train_part}
    assert held == split_eval(examples, 4, seed=0)[1]  # the same on a resume
    out = str(tmp_path / "draft")
    cfg = TrainConfig(out_dir=out, block_size=4, draft_layers=1, batch_size=4, anchors=8, max_length=96,
                      steps=10, save_every=5, lr=3e-3, eval_examples=4)
    train(model, tok, examples, cfg, log=lambda *a: None)
    rows = [json.loads(x) for x in open(os.path.join(out, "eval_log.jsonl"))]
    assert [r["step"] for r in rows] == [5, 10]
    assert all(r["eval_loss"] > 0 and 0 <= r["eval_acc"] <= 1 and 1 <= r["eval_accept_len"] <= 4 for r in rows)
    assert all(1 <= r["eval_served_accept_len"] <= 4 for r in rows)
    with pytest.raises(SystemExit, match="leaves nothing to train on"):
        split_eval(examples, len(examples), seed=0)


def test_a_held_out_prompt_takes_all_its_responses_out_of_training(tiny_target):
    from sglang_dflash.train.data import Example

    _, _, _, examples = tiny_target
    # Three responses to each prompt, as --samples 3 writes them: siblings must not straddle the split.
    siblings = [Example(e.ids[:e.response_start] + e.ids[e.response_start:][::k], e.response_start)
                for e in examples for k in (1, 2, 3)]
    train_part, held = split_eval(siblings, 5, seed=0)
    prompt = lambda e: tuple(e.ids[:e.response_start])  # noqa: E731
    assert {prompt(e) for e in held}.isdisjoint({prompt(e) for e in train_part})
    assert len(held) == 6 and len(train_part) == len(siblings) - 6  # two whole prompts
    with pytest.raises(SystemExit, match="leaves nothing to train on"):
        split_eval(siblings, len(siblings) - 1, seed=0)


def test_served_steps_walk_a_response_by_the_accept_length_where_each_step_starts():
    lengths = [3, 1, 9, 2, 1, 4, 1, 1]  # blocks anchored at a 9-token response's tokens 0..7
    assert served_steps(lengths) == [3, 2, 3]  # from 0: +3 -> 3, +2 -> 5, +4 cut to 3 -> 8, the last token
    assert served_steps([]) == []  # prefill's token alone: no step
    # Random positions weigh the long run at 4 as much as each short one; the walk lands on it once.
    assert served_steps([1] * 4 + [16] * 16) == [1, 1, 1, 1, 16]


def test_the_served_accept_length_counts_the_steps_of_the_reference_loop(tiny_target, tmp_path):
    """On responses the float32 target wrote greedily, the walk over blocks anchored everywhere gives
    the reference loop's own steps: each step's length but the last (the loop records the last before
    max_new_tokens cuts it), and so the same count of steps."""
    from sglang_dflash.reference import draft_proposer
    from sglang_dflash.train.data import Example

    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    cfg = TrainConfig(out_dir=out, block_size=4, draft_layers=1, steps=40, batch_size=8, lr=3e-3, anchors=8,
                      save_every=1000, max_length=128)
    train(model, tok, examples, cfg, log=lambda *a: None)
    draft = load_trained_draft(out)
    target = FrozenTarget(model, draft.cfg.target_layer_ids)
    loops, walked = [], []
    for i, p in enumerate(PROMPTS[:8]):
        ids = render(tok, p)
        got = speculative_generate(target, draft_proposer(draft, target), ids, 6 + 4 * i, 4, draft.cfg.mask_token_id,
                                   draft.cfg.target_layer_ids)  # responses of many lengths in one batch
        loops.append(got.accept_lengths)
        walked.append(Example(ids + got.tokens, len(ids)))
    # Three anchors a pass: the walk's blocks come from several passes per row.
    steps = [served_steps(lengths) for lengths in accept_lengths_everywhere(
        draft, target, walked, TrainConfig(**{**cfg.__dict__, "anchors": 3}), draft.cfg.mask_token_id,
        tok.pad_token_id or 0)]
    assert [s[:-1] for s in steps] == [s[:-1] for s in loops]
    assert [len(s) for s in steps] == [len(s) for s in loops]
    # The trainer's held-out scoring shares one target forward between both figures: each equals
    # the figure computed on its own.
    eval_cfg = TrainConfig(**{**cfg.__dict__, "anchors": 3, "batch_size": 3})
    mask, pad = draft.cfg.mask_token_id, tok.pad_token_id or 0
    scores = evaluate(draft, target, walked, eval_cfg, mask, pad)
    assert scores["eval_served_accept_len"] == pytest.approx(
        sum(sum(s) + 1 for s in steps) / sum(len(s) for s in steps))
    gen = torch.Generator().manual_seed(eval_cfg.seed)
    alone = [batch_loss(draft, target, walked[i:i + 3], eval_cfg, mask, pad, gen, accept_lengths=True)
             for i in range(0, len(walked), 3)]
    assert scores["eval_accept_len"] == pytest.approx(float(torch.cat([a[2].float() for a in alone]).mean()))
    assert scores["eval_loss"] == pytest.approx(sum(float(a[0]) for a in alone) / len(alone))
    lengths = [n for s in loops for n in s[:-1]]
    assert 1 in lengths and max(lengths) == 4  # the draft misses and lands: the walk is tested on both


def test_chunked_lm_loss_equals_the_whole_loss_with_its_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    lm_head = torch.randn(50, 16)
    labels = torch.randint(0, 50, (37,))
    weights = torch.rand(37)
    whole, whole_hits = lm_loss(hidden, lm_head, labels, weights, chunk=1000)
    (g_whole,) = torch.autograd.grad(whole, hidden)
    chunked, chunked_hits = lm_loss(hidden, lm_head, labels, weights, chunk=5)
    (g_chunked,) = torch.autograd.grad(chunked, hidden)
    ce = torch.nn.functional.cross_entropy(hidden @ lm_head.T, labels, reduction="none")
    assert whole.item() == pytest.approx(((ce * weights).sum() / weights.sum()).item(), rel=1e-5)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5)
    assert torch.equal(chunked_hits, whole_hits) and torch.equal(whole_hits, (hidden @ lm_head.T).argmax(-1) == labels)
    torch.testing.assert_close(g_chunked, g_whole)


def test_block_accept_lengths_follow_the_serving_rule():
    from sglang_dflash.reference import accept_block

    torch.manual_seed(1)
    rows, blocks, size = 3, 4, 5
    candidates = torch.randint(0, 3, (rows * blocks, size))  # a small vocabulary: long matching runs
    targets = torch.randint(0, 3, (rows * blocks, size))
    expected = accept_block(candidates, targets).commit_len.view(rows, blocks)
    supervised = torch.ones(rows, blocks, size, dtype=torch.bool)
    supervised[..., 0] = False  # slot 0 is the given token, never a label
    flags = torch.zeros(rows, blocks, size, dtype=torch.bool)
    flags[..., 1:] = (candidates[:, 1:] == targets[:, :-1]).view(rows, blocks, size - 1)
    supervised[2, 3, 2:] = False  # a block cut by the end of the response after one draft slot
    valid = torch.ones(rows, blocks, dtype=torch.bool)
    valid[1, 0] = False  # an unused anchor slot
    got = block_accept_lengths(flags[supervised], supervised.view(rows, -1), valid, size)
    expected[2, 3] = 1 + int(flags[2, 3, 1])
    assert got[valid].tolist() == expected[valid].tolist() and not got[~valid].any()
    assert expected.max() > 2  # the draws include accepted runs


def test_target_labels_are_greedy_choices_cut_where_the_text_leaves_the_greedy_path():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.tensor([[1]])
    greedy = torch.full_like(ids, 0)
    greedy[0, :-1] = ids[0, 1:]  # greedy text: the target's choices are the text itself
    as_text = block_batch(ids, loss_mask, anchors, 4, 99, 7.0)
    as_target = block_batch(ids, loss_mask, anchors, 4, 99, 7.0, greedy)
    for a, b in zip(as_text, as_target):
        assert torch.equal(a, b)
    assert as_text[2].tolist() == [[-100, 7, 8, 9]]
    greedy[0, 2] = 42  # after 6, 7 the target would say 42: the text steps off its path at slot 2
    block_ids, pos, labels, weights = block_batch(ids, loss_mask, anchors, 4, 99, 7.0, greedy)
    assert block_ids.tolist() == [[6, 99, 99, 99]] and pos.tolist() == [[1, 2, 3, 4]]
    assert labels.tolist() == [[-100, 7, 42, -100]]  # slot 3's context (the text's 8) is never served
    assert (weights > 0).tolist() == [[False, True, True, False]]


def test_unknown_label_source_is_refused(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    with pytest.raises(ValueError, match="labels must be 'target' or 'text'"):
        train(model, tok, examples, TrainConfig(out_dir=str(tmp_path / "d"), steps=1, labels="greedy"),
              log=lambda *a: None)


def test_sampled_prefixes_give_several_greedy_paths_per_prompt(tiny_target):
    path, model, tok, _ = tiny_target
    torch.manual_seed(0)
    got = regenerate(path, PROMPTS[:4], max_new_tokens=20, engine="hf", hf_model=model, tokenizer=tok,
                     samples=3, sampled_prefix=3, temperature=3.0)
    assert len(got) == 12
    for i, e in enumerate(got):
        prompt = render(tok, PROMPTS[i // 3])
        assert e.ids[:len(prompt)] == prompt and e.response_start == len(prompt)
        head = e.ids[:len(prompt) + 3]
        rest = e.ids[len(head):]
        if tok.eos_token_id in e.ids[len(prompt):len(head)]:
            assert rest == []
            continue
        greedy = model.generate(torch.tensor([head]), max_new_tokens=17, do_sample=False,
                                pad_token_id=tok.eos_token_id)[0, len(head):].tolist()
        assert rest == greedy  # only the prefix is sampled
    assert len({tuple(e.ids) for e in got}) > 4  # the samples of a prompt differ


def test_lr_schedule_follows_whichever_budget_runs_out_first():
    cfg = TrainConfig(out_dir="-", steps=1000, lr=1e-3, warmup_ratio=0.1, max_minutes=10)
    assert run_progress(100, 0.0, cfg) == 0.1 and run_progress(100, 300.0, cfg) == 0.5
    assert lr_at(0.05, cfg) == pytest.approx(5e-4) and lr_at(0.1, cfg) == pytest.approx(1e-3)
    assert lr_at(0.55, cfg) == pytest.approx(5e-4) and lr_at(1.0, cfg) == pytest.approx(0.0, abs=1e-12)
    assert run_progress(100, 1e9, TrainConfig(out_dir="-", steps=1000)) == 0.1  # no time budget


def test_plot_train_log_draws_runs_in_sequence_and_refuses_other_files(tmp_path):
    from sglang_dflash.train import plot

    logs = []
    for run in range(2):
        path = tmp_path / f"log{run}.jsonl"
        path.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s, "acc": s / 50}) + "\n" for s in range(1, 41)))
        logs.append(str(path))
    assert plot.moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    out = tmp_path / "curve.png"
    assert plot.main(logs + ["--labels", "a", "b", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(SystemExit, match="not a train_log"):
        plot.main([str(tmp_path / "bad.jsonl"), "--out", str(out)])


def test_held_out_prompts_never_reach_training(tmp_path):
    rows = [f"q{i}" for i in range(250)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    got = training_prompts(["gsm8k"], str(tmp_path), per_dataset=1000)
    assert got == rows[HELD_OUT["gsm8k"]:] and "q0" not in got


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--target", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        cli.parse_args(["--target", str(tmp_path), "--out", "o", "--block-size", "1"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--target", str(tmp_path), "--out", "o", "--samples", "4"])
    assert "--samples > 1 needs --sampled-prefix" in capsys.readouterr().err


def test_cli_refuses_a_bad_mask_or_layer_before_regenerating(tiny_target, tmp_path, monkeypatch):
    """No response is regenerated (minutes to hours on a real target) for a run that cannot train."""
    from tokenizers import Tokenizer, models

    path = tiny_target[0]
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 10))

    def regenerate(*a, **k):
        raise AssertionError("regenerated before the arguments were checked")

    monkeypatch.setattr(cli, "regenerate", regenerate)
    base = ["--datasets", "gsm8k", "--data-dir", str(data), "--block-size", "4", "--draft-layers", "1",
            "--out", str(tmp_path / "d")]
    with pytest.raises(SystemExit, match="--mask-token-id 99999 is outside the target vocabulary"):
        cli.main(["--target", path, "--mask-token-id", "99999", *base])
    with pytest.raises(SystemExit, match=r"--target-layer-ids \[1, 6\]: the target has layers 0..5"):
        cli.main(["--target", path, "--target-layer-ids", "1,6", *base])
    with pytest.raises(SystemExit, match=r"--target-layer-ids \[1, 5\]: layer 5 is the target's last; tap layers 0..4"):
        cli.main(["--target", path, "--target-layer-ids", "1,5", *base])
    # A target whose tokenizer has no mask token, and no --mask-token-id.
    no_mask = tmp_path / "no_mask"
    no_mask.mkdir()
    (no_mask / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
                            eos_token="<unk>").save_pretrained(str(no_mask))
    with pytest.raises(SystemExit, match="no mask token in the tokenizer: pass --mask-token-id"):
        cli.main(["--target", str(no_mask), *base])
    assert not (tmp_path / "d").exists()  # nothing written either


def test_cli_checks_datasets_before_loading_anything(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    base = ["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path)]
    for argv, message in ((["--datasets", "gsm8k,nope"], "unknown datasets ['nope']"),
                          (["--datasets", "gsm8k"], "run sglang-dflash-fetch-datasets --datasets gsm8k"),
                          (["--target-layer-ids", "1,x"], "--target-layer-ids: expected comma-separated integers"),
                          (["--samples", "2", "--sampled-prefix", "4", "--max-new-tokens", "4"],
                           "above --sampled-prefix")):
        with pytest.raises(SystemExit):
            cli.parse_args(base + argv)
        assert message in capsys.readouterr().err
    assert cli.parse_args(base + ["--datasets", "gsm8k", "--steps", "0"]).datasets == ["gsm8k"]  # nothing regenerated


def test_cli_trains_on_earlier_examples_without_regenerating(tiny_target, tmp_path, capsys):
    import lzma

    from sglang_dflash.train.data import save_examples

    path, _, _, examples = tiny_target
    save_examples(examples, str(tmp_path / "earlier.jsonl"))
    with open(tmp_path / "earlier.jsonl", "rb") as f, lzma.open(tmp_path / "earlier.jsonl.xz", "wb") as xz:
        xz.write(f.read())
    base = ["--target", path, "--datasets", "", "--block-size", "4", "--draft-layers", "1", "--steps", "3",
            "--batch-size", "2", "--anchors", "4", "--max-length", "128"]
    assert cli.main(base + ["--out", str(tmp_path / "d"), "--extra-examples", str(tmp_path / "earlier.jsonl.xz")]) == 0
    assert f"{len(examples)} earlier examples from" in capsys.readouterr().err
    assert len(open(tmp_path / "d" / "train_log.jsonl").readlines()) == 3
    assert not (tmp_path / "d" / "examples.jsonl").exists()  # nothing was regenerated, no empty cache to trust
    with pytest.raises(SystemExit):
        cli.main(base + ["--out", str(tmp_path / "e")])
    assert "no training examples: give --datasets or --extra-examples" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(base + ["--out", "o", "--extra-examples", str(tmp_path / "missing.jsonl")])
    assert "--extra-examples: no such file" in capsys.readouterr().err


def test_offline_accept_length_walks_the_steps_of_the_reference_loop_on_benchmark_prompts(tiny_target, tmp_path):
    from sglang_dflash.bench import offline_accept_length as offline

    path, model, tok, examples = tiny_target
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    cfg = TrainConfig(out_dir=str(tmp_path / "draft"), block_size=4, draft_layers=1, steps=40, batch_size=8, lr=3e-3,
                      anchors=8, save_every=1000, max_length=128)  # trained a little: its drafts land and miss
    train(model, tok, examples, cfg, log=lambda *a: None)
    out = tmp_path / "tau.json"
    assert offline.main(["--target", path, "--draft", cfg.out_dir, "--datasets", "gsm8k", "--data-dir", str(data),
                         "--num-prompts", "3", "--max-new-tokens", "12", "--output", str(out)]) == 0
    got = json.loads(out.read_text())["datasets"]["gsm8k"]
    assert len(got["per_prompt"]) == 3 and 3 <= got["completion_tokens"] <= 36
    assert got["accept_length"] == pytest.approx(got["completion_tokens"] / got["verify_steps"])
    assert 1.2 <= got["accept_length"] <= 3.9
    assert json.loads(out.read_text())["method"] == "walk"
    # The loop, the definition, takes the same steps on the same responses.
    assert offline.main(["--target", path, "--draft", cfg.out_dir, "--datasets", "gsm8k", "--data-dir", str(data),
                         "--num-prompts", "3", "--max-new-tokens", "12", "--method", "loop", "--output", str(out)]) == 0
    loop = json.loads(out.read_text())["datasets"]["gsm8k"]
    same = ("completion_tokens", "verify_steps", "per_prompt", "steps_committing_at_least")
    assert {k: loop[k] for k in same} == {k: got[k] for k in same}
    at_least = got["steps_committing_at_least"]
    assert len(at_least) == 4 and at_least[0] == 1 and at_least == sorted(at_least, reverse=True) and at_least[1] > 0
    with pytest.raises(SystemExit):
        offline.main(["--target", path, "--draft", str(tmp_path / "none")])


# --- issue 81 item 5: bad input refused in one line, before any slow work ---


def copy_target_without_tokenizer(src, dst):
    import shutil

    os.makedirs(dst)
    for name in os.listdir(src):
        if name in ("config.json", "generation_config.json") or name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def refusal(argv, capsys):
    """The one stderr line (and exit status) a refused command ends with."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    code = info.value.code
    line = err if isinstance(code, int) else code
    assert code != 0 and code is not None
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith("sglang-dflash-train: "), line
    return line


def test_each_bad_argument_is_refused_in_one_line_before_any_work(tiny_target, tmp_path, capsys, monkeypatch):
    from sglang_dflash.train import data as train_data

    path = tiny_target[0]
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 10))
    (data / "mbpp.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 5))  # 120 < 200

    def regenerate(*a, **k):
        raise AssertionError("regenerated before the arguments were checked")

    monkeypatch.setattr(cli, "regenerate", regenerate)
    out = str(tmp_path / "d")
    base = ["--target", path, "--out", out, "--datasets", "gsm8k", "--data-dir", str(data), "--block-size", "4",
            "--draft-layers", "1", "--max-length", "128"]
    cases = [
        (["--block-size", "1"], "--block-size 1: must be >= 2"),
        (["--steps", "-1"], "--steps -1: must be >= 0"),
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--anchors", "0"], "--anchors 0: must be >= 1"),
        (["--max-length", "4"], "--max-length 4: must be above --block-size 4"),
        (["--max-length", "0"], "--max-length 0: must be above --block-size 4"),
        (["--target", str(tmp_path / "nowhere")], "no such folder"),
        (["--datasets", "gsm8k,nope"], "unknown datasets ['nope']"),
        (["--datasets", "mbpp"], "--datasets mbpp: no training prompts: " + str(data) + " holds 120, and the first "
                                 "200 are held out"),
        (["--datasets", "", "--steps", "5"], "no training examples: give --datasets or --extra-examples"),
        (["--max-length", "70"], "no prompt fits: all 40 are longer than 6 tokens (--max-length minus 64)"),
        (["--target", copy_target_without_tokenizer(path, tmp_path / "bare")], "has no tokenizer (none of"),
        (["--init-from", str(tmp_path)], "has no model.safetensors"),
    ]
    lines = {}
    for extra, message in cases:
        # The prompt-length check sits in regenerate itself, ahead of the engine's start.
        monkeypatch.setattr(cli, "regenerate", train_data.regenerate if "70" in extra else regenerate)
        lines[message] = refusal(base + extra, capsys)
        assert message in lines[message], (message, lines[message])
    assert not os.path.exists(out)  # nothing written, not even the output folder
    if os.environ.get("SHOW_REFUSALS"):
        print("\n".join(lines.values()), file=open(os.environ["SHOW_REFUSALS"], "w"))


def test_a_draft_that_does_not_fit_is_refused_with_the_size_it_needs(tiny_target, tmp_path, capsys, monkeypatch):
    from sglang_dflash.train import memory

    path = tiny_target[0]
    monkeypatch.setattr(memory, "free_memory", lambda device: (10**6, "cuda:0"))
    base = ["--target", path, "--out", str(tmp_path / "d"), "--datasets", "", "--steps", "0", "--block-size", "4",
            "--draft-layers", "1"]
    line = refusal(base, capsys)
    assert "the draft does not fit cuda:0: training needs about" in line and "0.0 GB is free" in line, line
    assert "target weights" in line and "draft weights, gradients and Adam" in line and "activations" in line
    assert not os.path.exists(tmp_path / "d")
    assert cli.main(base + ["--no-memory-check"]) == 0  # the escape hatch


def test_memory_estimate_counts_the_real_parameters_and_the_loss_chunk_dominates_smollm2():
    from types import SimpleNamespace

    from sglang_dflash.config import DFlashDraftConfig, expected_draft_tensors
    from sglang_dflash.reference import ReferenceDraft
    from sglang_dflash.train.memory import GB, config_parameter_count, training_memory
    from sglang_dflash.train.trainer import draft_config_dict

    # SmolLM2-135M-Instruct's shape and the trainer's defaults (block 16, 3 layers, batch 8, 1024 tokens, 64 anchors).
    smol = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5,
                           rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True)
    draft_cfg = DFlashDraftConfig.from_dict(draft_config_dict(smol, TrainConfig(out_dir="-", draft_layers=3), 0))
    draft_params = sum(__import__("math").prod(s) for s in expected_draft_tensors(draft_cfg).values())
    assert draft_params == sum(p.numel() for p in ReferenceDraft(draft_cfg).parameters())
    target_params = config_parameter_count(smol)
    assert 134e6 < target_params < 135e6  # SmolLM2-135M
    need = training_memory(draft_cfg, smol, target_params, draft_params, 8, 1024, 64, 8192, "cuda")
    loss_chunk = 8192 * 49152 * 14
    assert need["activations"] > loss_chunk > need["target weights"] + need["draft weights, gradients and Adam"]
    assert 6 * GB < need["total"] < 10 * GB, need["total"] / GB


def test_target_parameters_are_read_from_the_safetensors_headers(tiny_target):
    from sglang_dflash.train.memory import safetensors_parameter_count

    path, model, _, _ = tiny_target
    assert safetensors_parameter_count(path) == sum(p.numel() for p in model.parameters())


def test_refusal_is_one_line_with_a_non_zero_exit_in_a_real_process(tiny_target, tmp_path):
    import subprocess
    import sys

    bare = copy_target_without_tokenizer(tiny_target[0], tmp_path / "bare")
    # This checkout's package, whatever an installed copy points at.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    got = subprocess.run([sys.executable, "-m", "sglang_dflash.train", "--target", bare, "--out", str(tmp_path / "o"),
                          "--datasets", "", "--steps", "0"], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 1
    assert got.stderr.strip().splitlines() == [
        f"sglang-dflash-train: error: --target {bare!r} has no tokenizer (none of tokenizer.json, tokenizer.model, "
        "vocab.json, vocab.txt, spiece.model, sentencepiece.bpe.model, tiktoken.model)"]
    got = subprocess.run([sys.executable, "-m", "sglang_dflash.train", "--target", bare, "--out", "o",
                          "--block-size", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        "sglang-dflash-train: error: --block-size 1: must be >= 2 (the given token and at least one drafted token)"]


def test_resume_refuses_a_saved_state_of_another_shape(tiny_target, tmp_path, capsys):
    path, _, _, examples = tiny_target
    from sglang_dflash.train.data import save_examples

    save_examples(examples, str(tmp_path / "ex.jsonl"))
    base = ["--target", path, "--out", str(tmp_path / "d"), "--datasets", "", "--extra-examples",
            str(tmp_path / "ex.jsonl"), "--draft-layers", "1", "--steps", "2", "--batch-size", "2", "--anchors", "4",
            "--max-length", "96"]
    assert cli.main(base + ["--block-size", "4"]) == 0
    line = refusal(base + ["--block-size", "8", "--resume"], capsys)
    assert line.endswith("trained --block-size 4, this run asks for 8"), line


# --- issue 81 item 5: a killed run resumes where it stopped; no checkpoint is half written ---


RESUME_CFG = dict(block_size=4, draft_layers=1, batch_size=4, anchors=8, save_every=4, max_length=96, steps=12,
                  lr=3e-3)


def final_state(out):
    from safetensors.torch import load_file

    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    log = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    return state, load_file(os.path.join(out, "model.safetensors")), log


def test_a_killed_run_resumes_to_the_same_weights_as_an_uninterrupted_one(tiny_target, tmp_path, monkeypatch):
    """On CPU the resumed run is bitwise the uninterrupted one: weights, Adam moments, losses. It restores
    the weights, the optimizer, the step (the LR schedule is a function of it) and the batch, anchor and
    torch RNG states. (With --max-minutes the schedule follows wall time, and bf16 autocast on CUDA is not
    bitwise reproducible run to run: there only the step, data order and RNG streams are the same.)"""
    from sglang_dflash.train import trainer

    path, model, tok, examples = tiny_target
    whole = str(tmp_path / "whole")
    train(model, tok, examples, TrainConfig(out_dir=whole, **RESUME_CFG), log=lambda *a: None)

    killed = str(tmp_path / "killed")
    real_batch_loss, calls = trainer.batch_loss, []

    def dies_in_step_7(*a, **k):
        calls.append(1)
        if len(calls) == 7:  # past the checkpoint at step 4: steps 5 and 6 are lost with the process
            raise KeyboardInterrupt
        return real_batch_loss(*a, **k)

    monkeypatch.setattr(trainer, "batch_loss", dies_in_step_7)
    with pytest.raises(KeyboardInterrupt):
        train(model, tok, examples, TrainConfig(out_dir=killed, **RESUME_CFG), log=lambda *a: None)
    monkeypatch.setattr(trainer, "batch_loss", real_batch_loss)
    assert torch.load(os.path.join(killed, "trainer_state.pt"), weights_only=False)["step"] == 4
    messages = []
    train(model, tok, examples, TrainConfig(out_dir=killed, **RESUME_CFG), resume=True, log=messages.append)
    assert messages == ["resumed from step 4"]

    (a_state, a_model, a_log), (b_state, b_model, b_log) = final_state(whole), final_state(killed)
    assert b_state["step"] == 12 and [r["step"] for r in b_log] == list(range(1, 13))
    assert a_log == b_log  # every step's loss and accuracy, bitwise
    assert all(torch.equal(a_state["draft"][k], b_state["draft"][k]) for k in a_state["draft"])
    assert all(torch.equal(a_model[k], b_model[k]) for k in a_model)
    for a, b in zip(a_state["optimizer"]["state"].values(), b_state["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_paused_run_resumes_bitwise_too(tiny_target, tmp_path):
    path, model, tok, examples = tiny_target
    whole, paused = str(tmp_path / "whole"), str(tmp_path / "paused")
    train(model, tok, examples, TrainConfig(out_dir=whole, **RESUME_CFG), log=lambda *a: None)
    train(model, tok, examples, TrainConfig(out_dir=paused, pause_after_minutes=0.0, **RESUME_CFG),
          log=lambda *a: None)
    assert torch.load(os.path.join(paused, "trainer_state.pt"), weights_only=False)["step"] == 1
    train(model, tok, examples, TrainConfig(out_dir=paused, **RESUME_CFG), resume=True, log=lambda *a: None)
    (a_state, _, a_log), (b_state, _, b_log) = final_state(whole), final_state(paused)
    assert a_log == b_log and all(torch.equal(a_state["draft"][k], b_state["draft"][k]) for k in a_state["draft"])


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_whole(tiny_target, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from sglang_dflash.train import trainer

    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    cfg = dict(RESUME_CFG, save_every=2)
    train(model, tok, examples, TrainConfig(out_dir=out, **dict(cfg, steps=2)), log=lambda *a: None)
    before_model = load_file(os.path.join(out, "model.safetensors"))
    before_state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)

    def half_written(obj, target, *a, **k):
        with open(target, "wb") as f:  # some bytes reach the disk, then the write fails
            f.write(b"\0" * 64)
        raise OSError("No space left on device")

    for module, name in ((trainer, "save_file"), (torch, "save")):  # the weights, then the trainer state
        with monkeypatch.context() as m:
            m.setattr(module, name, half_written)
            with pytest.raises(OSError, match="No space left"):
                train(model, tok, examples, TrainConfig(out_dir=out, **dict(cfg, steps=4)), resume=True,
                      log=lambda *a: None)
        after = load_file(os.path.join(out, "model.safetensors"))
        state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
        assert state["step"] == 2  # the previous state, whole and loadable
        assert all(torch.equal(state["draft"][k], before_state["draft"][k]) for k in state["draft"])
        if module is trainer:  # the weights' write failed: the old ones are there
            assert all(torch.equal(after[k], before_model[k]) for k in before_model)
        assert not [f for f in os.listdir(out) if f.endswith(".tmp")]  # no temporary file left behind
    # The run goes on from the intact state.
    train(model, tok, examples, TrainConfig(out_dir=out, **dict(cfg, steps=4)), resume=True, log=lambda *a: None)
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 4
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "train_log.jsonl"))] == [1, 2, 3, 4]


# --- issue 81 item 4: progress with done/total and an ETA ---


def test_training_and_regeneration_show_done_total_and_an_eta(tiny_target, tmp_path, capsys):
    path, model, tok, examples = tiny_target
    out = str(tmp_path / "draft")
    train(model, tok, examples, TrainConfig(out_dir=out, **dict(RESUME_CFG, steps=6, save_every=3)),
          log=lambda *a: None)
    err = capsys.readouterr().err
    assert "training draft" in err and "6/6 [" in err and "<00:00" in err  # done/total [elapsed<remaining
    train(model, tok, examples, TrainConfig(out_dir=out, **dict(RESUME_CFG, steps=8, save_every=3, max_minutes=5)),
          resume=True, log=lambda *a: None)
    err = capsys.readouterr().err
    assert "8/8 [" in err and "budget_left=" in err
    regenerate(path, PROMPTS[:3], max_new_tokens=4, engine="hf", hf_model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert "regenerating responses" in err and "3/3 [" in err


def test_progress_is_quiet_without_tqdm(tiny_target, tmp_path, capsys, monkeypatch):
    import sys

    path, model, tok, examples = tiny_target
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    out = str(tmp_path / "draft")
    train(model, tok, examples, TrainConfig(out_dir=out, **dict(RESUME_CFG, steps=3)), log=lambda *a: None)
    regenerate(path, PROMPTS[:2], max_new_tokens=4, engine="hf", hf_model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert "%|" not in err and "it/s" not in err, err
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 3


def test_sglang_regeneration_counts_requests_as_they_finish(capsys):
    """The SGLang path (GPU) through a stand-in engine: one async request per prompt, results in order."""
    import asyncio

    from sglang_dflash.train.data import _SGLangGenerator

    class Engine:
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, sampling_params):
            await asyncio.sleep(0.01 * (5 - len(input_ids)))  # shorter prompts finish later: order must hold
            n = sampling_params["max_new_tokens"]
            return {"output_ids": [len(input_ids)] * n, "meta_info": {"finish_reason": {"type": "length"}}}

    gen = _SGLangGenerator("-")
    gen.llm = Engine()
    got = gen([[1], [1, 2, 3], [1, 2]], 2, 0.0)
    assert got == [([1, 1], False), ([3, 3], False), ([2, 2], False)]
    assert "3/3" in capsys.readouterr().err
    Engine.loop.close()


def test_a_hybrid_target_trains_a_draft_the_plugin_accepts_and_that_stays_lossless(tmp_path):
    """A second target family: a gated-delta-net hybrid (Qwen3.5: three linear-attention layers to
    one full-attention layer), through the same trainer, on transformers' own CPU kernels."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    path, model, tok, examples = write_tiny_target(
        str(tmp_path / "target"), Qwen3_5TextConfig, Qwen3_5ForCausalLM, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    out = str(tmp_path / "draft")
    train(model, tok, examples, TrainConfig(out_dir=out, block_size=4, draft_layers=2, steps=120, batch_size=8,
                                            lr=3e-3, anchors=16, save_every=120, max_length=128), log=lambda *a: None)
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    assert sum(h["loss"] for h in log[-20:]) < 0.8 * sum(h["loss"] for h in log[:20])
    resolved = load_and_validate(out, TargetInfo.from_pretrained(path))
    assert resolved.block_size == 4 and resolved.num_target_layers == 4
    # Lossless on every prompt, and most drafts land (3.97 of 4 here; an untrained draft, about 1).
    assert acceptance(model, load_trained_draft(out), tok, 4) > 2.5


def test_an_eval_file_is_scored_at_each_save_and_never_trained_on(tiny_target, tmp_path, capsys):
    from sglang_dflash.train.data import save_examples

    path, _, _, examples = tiny_target
    save_examples(examples[:20], str(tmp_path / "train.jsonl"))
    save_examples(examples[20:], str(tmp_path / "held.jsonl"))
    base = ["--target", path, "--datasets", "", "--block-size", "4", "--draft-layers", "1", "--steps", "4",
            "--batch-size", "2", "--anchors", "4", "--max-length", "128", "--save-every", "2",
            "--extra-examples", str(tmp_path / "train.jsonl")]
    assert cli.main(base + ["--out", str(tmp_path / "d"), "--eval-file", str(tmp_path / "held.jsonl")]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "d" / "eval_log.jsonl")]
    assert [r["step"] for r in rows] == [2, 4] and all(r["eval_accept_len"] >= 1 for r in rows)
    with pytest.raises(SystemExit):
        cli.parse_args(base + ["--out", "o", "--eval-file", str(tmp_path / "held.jsonl"), "--eval-examples", "3"])
    assert "give one" in capsys.readouterr().err


def test_the_ablation_runs_each_variant_on_the_same_held_out_examples(tiny_target, tmp_path):
    import subprocess
    import sys

    from sglang_dflash.train.data import save_examples

    path, _, _, examples = tiny_target
    save_examples(examples, str(tmp_path / "all.jsonl"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ablation"
    run = subprocess.run(
        [sys.executable, "-m", "lab.train_ablation", str(out), "--target", path, "--examples", str(tmp_path / "all.jsonl"),
         "--eval-examples", "4", "--save-every", "2", "--minutes", "5", "--variant", "base=",
         "--variant", "half=--examples-share 0.5 --anchors 8",
         "--", "--block-size", "4", "--draft-layers", "1", "--steps", "4", "--batch-size", "2", "--anchors", "4",
         "--max-length", "128"], cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads((out / "ablation.json").read_text())["variants"]
    assert [v["name"] for v in got] == ["base", "half"]
    assert [v["trained_examples"] for v in got] == [len(examples) - 4, round(0.5 * (len(examples) - 4))]
    assert all(v["steps"] == 4 and v["accept_length"] >= 1 and len(v["curve"]) == 2 for v in got)
    assert all(v["accept_length_random_positions"] >= 1 for v in got)
    assert got[1]["args"] == "--anchors 8 --examples-share 0.5"
    assert len((out / "held-out.jsonl").read_text().splitlines()) == 4
    assert "| half | `--anchors 8 --examples-share 0.5` |" in (out / "ablation.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "lab.train_ablation", str(out), "--target", path, "--examples",
                          str(tmp_path / "all.jsonl"), "--eval-examples", "4", "--variant", "x=--examples-share 2"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--examples-share takes a fraction in (0, 1], got 2.0" in bad.stderr
