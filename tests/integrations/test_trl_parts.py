"""RedrollRollout's parts, each against TRL's own code where TRL has it: the sampling settings, the
prompt tokenization, what an empty record becomes, failures raised by request, a PEFT model's
merged weights, the refusal of sharded training. The fleet tests call the rollout function as
TRL does, with a stand-in for the trainer that has what TRL's trainer gives it."""

from __future__ import annotations

import types

import pytest

from examples.trl_grpo import build_model, build_tokenizer
from redroll.engine_worker.engines.tiny_model import teacher_forced_logprobs
from redroll.integrations.trl import (
    RedrollRollout,
    RolloutError,
    policy_tensors,
    sampling_params,
    to_trl_output,
    tokenize_prompts,
)
from redroll.shared.types import CompletionRecord, RecordStatus

CHATS = [[{"role": "user", "content": "a i q"}], [{"role": "system", "content": "x1 x2"},
                                                  {"role": "user", "content": "b j r"}]]


def config(tmp_path, **fields):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, max_completion_length=6,
                      num_generations=2, per_device_train_batch_size=2, report_to="none", **fields)


class StandInTrainer:
    """What a rollout function reads from TRL's GRPOTrainer, for one process."""

    def __init__(self, model, args, step: int = 0):
        self.model = self.model_wrapped = model
        self.args = args
        self.processing_class = build_tokenizer()
        self.state = types.SimpleNamespace(global_step=step)
        self.accelerator = types.SimpleNamespace(process_index=0, num_processes=1, is_main_process=True,
                                                 distributed_type="NO", wait_for_everyone=lambda: None,
                                                 unwrap_model=lambda m: m)
        self.eos_token_ids = [self.processing_class.eos_token_id]
        self.tools, self.chat_template, self.chat_template_kwargs = None, None, {}


def test_sampling_settings_are_the_trainer_s_under_redroll_s_names(tmp_path):
    trainer = StandInTrainer(None, config(tmp_path, temperature=0.7, top_p=0.9))
    assert sampling_params(trainer) == {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
                                        "min_p": 0.0, "repetition_penalty": 1.0, "stop_token_ids": [1]}
    # TRL's top_k 0 and min_p None are "off" (grpo_config.py); set, they pass as they are.
    trainer.args = config(tmp_path, top_k=5, min_p=0.1, repetition_penalty=1.2)
    assert {k: sampling_params(trainer)[k] for k in ("top_k", "min_p", "repetition_penalty")} == {
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}
    # generation_kwargs reach only TRL's own generators: refused, not ignored.
    trainer.args = config(tmp_path, generation_kwargs={"no_repeat_ngram_size": 2})
    with pytest.raises(RolloutError, match="generation_kwargs"):
        sampling_params(trainer)


def test_prompts_are_tokenized_exactly_as_trl_tokenizes_them(tmp_path):
    from trl import GRPOTrainer

    trainer = StandInTrainer(None, config(tmp_path))
    trl_side = types.SimpleNamespace(_is_vlm=False, environment_factories=None, tools=None, chat_template=None,
                                     chat_template_kwargs={}, processing_class=trainer.processing_class)
    for prompts in (CHATS, ["a i q", "x1 b j"]):
        ids = tokenize_prompts(trainer, prompts)
        assert ids == [list(row) for row in GRPOTrainer._tokenize_prompts(trl_side, prompts)[0]]
        assert all(isinstance(t, int) for row in ids for t in row)
    assert tokenize_prompts(trainer, CHATS)[0] == [4, 37, 45, 53, 1, 5]  # <|user|> a i q <eos> <|assistant|>
    with pytest.raises(RolloutError, match="multimodal"):
        tokenize_prompts(trainer, [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]])


def record(ids: list[int], version: str = "3", status=RecordStatus.FINISHED) -> CompletionRecord:
    return CompletionRecord(request_id=f"r{len(ids)}", status=status, output_token_ids=[ids],
                            output_logprobs=[[-0.5] * len(ids)], finish_reasons=["length"],
                            meta_info={"weight_version": version})


def test_a_record_without_tokens_becomes_eos_kept_out_of_the_loss():
    out = to_trl_output([[4, 5], [4, 6]], [record([9, 10, 1]), record([])], eos_token_id=1)
    assert out["completion_ids"] == [[9, 10, 1], [1]]  # TRL reads ids[-1] of each (grpo_trainer.py:2302)
    assert out["logprobs"] == [[-0.5, -0.5, -0.5], [0.0]]
    assert out["env_mask"] == [[1, 1, 1], [0]]  # (TRL's loss mask: the placeholder is not trained)
    assert out["weight_version"] == [3, 3]
    assert "env_mask" not in to_trl_output([[4]], [record([7])], eos_token_id=1)
    short = record([7, 8])
    short.output_logprobs = [[-0.1]]
    with pytest.raises(RolloutError, match="r2: the record's logprobs do not cover its 2 tokens"):
        to_trl_output([[4]], [short], eos_token_id=1)


def test_sharded_training_is_refused_by_name(tmp_path):
    trainer = StandInTrainer(build_model(0), config(tmp_path))
    trainer.accelerator.distributed_type = "DistributedType.FSDP"
    with pytest.raises(RolloutError, match="FSDP"):
        RedrollRollout()(CHATS, trainer)


def test_policy_tensors_carry_the_checkpoint_s_names():
    model = build_model(0)
    names = [name for name, _ in policy_tensors(model)]
    assert names == [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied to the embeddings: sent once, under their name
    wrapper = types.SimpleNamespace(named_parameters=lambda: [(f"module.{n}", p) for n, p in model.named_parameters()])
    assert [name for name, _ in policy_tensors(wrapper)] == names


@pytest.mark.slow
def test_records_that_fail_raise_naming_each_request_and_why(trl_fleet, tmp_path):
    rollout = RedrollRollout(trl_fleet.settings)
    try:
        # The transformers engine has no repetition penalty: each request is refused, and says so.
        trainer = StandInTrainer(build_model(0), config(tmp_path, repetition_penalty=1.1))
        with pytest.raises(RolloutError) as failed:
            rollout(CHATS, trainer)
        assert "2 of 2 requests did not finish" in str(failed.value)
        assert str(failed.value).count("sampling_params.repetition_penalty: not supported") == 2
        assert "trl-s0-r0-" in str(failed.value)  # (each named by its request_id)
        # A request for weights newer than the fleet's is refused too, not left waiting.
        trainer = StandInTrainer(build_model(0), config(tmp_path), step=10_000)
        rollout._pushed_step = 10_000  # (as if pushed: the fleet still serves step 0's)
        with pytest.raises(RolloutError, match="min_weight_version"):
            rollout(CHATS, trainer)
    finally:
        rollout.close()


@pytest.mark.slow
def test_a_peft_model_pushes_its_merged_weights_and_trains_on_apart(trl_fleet, tmp_path):
    peft = pytest.importorskip("peft")
    import torch

    model = peft.get_peft_model(build_model(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # (a trained adapter: B starts at zero)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    trainer = StandInTrainer(model, config(tmp_path), step=1)
    with RedrollRollout(trl_fleet.settings) as rollout:
        out = rollout(CHATS * 2, trainer)
        assert sorted(rollout.last_push.workers) and len(rollout.last_push.workers) == 2
    assert out["weight_version"] == [1] * 4
    for prompt, ids, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        want = teacher_forced_logprobs(model, prompt, ids, 1.0)  # the adapter applied on the fly
        assert max(abs(a - b) for a, b in zip(want, logprobs)) < 1e-4
    for name, param in model.named_parameters():  # unmerged again: training goes on with the adapter apart
        if name in base_before:
            assert torch.allclose(param, base_before[name], atol=1e-6), name  # (merge, then unmerge: rounding)
