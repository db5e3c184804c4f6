"""TRL's trainers generate through redroll.

``GRPOTrainer`` (TRL 1.16) takes an outside generator as ``rollout_func``::

    from redroll.integrations.trl import RedrollRollout
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                          rollout_func=RedrollRollout())     # settings from REDROLL_* as every redroll process

Each call pushes the trainer's weights to the fleet when the training step changed (the main
process pushes, every process then waits at the trainer's barrier), submits one request per
prompt with the trainer's sampling settings and ``min_weight_version`` = the step, and returns
TRL's dict: ``prompt_ids``, ``completion_ids``, ``logprobs`` and ``weight_version`` (each
record's, an extra field that reaches the reward functions). With ``use_vllm=False`` TRL itself
pushes no weights and applies no importance-sampling correction, so this push and the
``min_weight_version`` bound are what keep the samples on-policy.

TRL's async GRPO (``trl.experimental.async_grpo``) takes its weight sync as an injected object with
five methods; :class:`RedrollWeightTransfer` is one, over the same weight push::

    AsyncGRPOTrainer(model=path, ..., weight_transfer=RedrollWeightTransfer())

What the TRL sources at 1.16.0 are relied on for (``trl/``-relative ``file:line``) is cited where
it is used. TRL, torch and transformers are imported only when a call needs them.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterable, Iterator

from redroll.producer.sync import SyncProducer
from redroll.shared.errors import RedrollError
from redroll.shared.settings import Settings
from redroll.shared.types import CompletionRecord, RecordStatus

__all__ = ["RedrollRollout", "RedrollWeightTransfer", "RolloutError", "policy_tensors"]

SHOWN_FAILURES = 8
"""How many failed requests a :class:`RolloutError` names one by one."""


class RolloutError(RedrollError, RuntimeError):
    """A rollout could not be completed: the message names each request_id that did not finish
    and why (nothing is silently dropped), or the setting that cannot work."""


# ---------------------------------------------------------------- the fleet: one producer, one weight push


class _Fleet:
    """One :class:`SyncProducer` and its weight-sync group, shared by a rollout function and a
    weight transfer of the same run. Started on first use, in the process that uses it."""

    def __init__(self, settings: Settings | None, sync_options: dict[str, Any]):
        self._settings = settings
        self._sync_options = sync_options
        self.producer: SyncProducer | None = None
        self._sync: Any = None

    def start(self) -> SyncProducer:
        if self.producer is None:
            self.producer = SyncProducer(self._settings or Settings.from_env())
        return self.producer

    def push(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> Any:
        """Broadcast the tensors to every live worker as weight version ``version``; returns when
        each serves it. A push that reached no worker raises: requests would wait for ever."""
        producer = self.start()
        if self._sync is None:
            self._sync = producer.weight_sync(**self._sync_options).__enter__()
        report = self._sync.push(named_tensors, str(version))
        if not report.workers:
            raise RolloutError(f"the weight push of version {version} reached no worker: start `redroll worker` "
                               "processes on this namespace before training")
        return report

    def close(self) -> None:
        sync, self._sync = self._sync, None
        producer, self.producer = self.producer, None
        if sync is not None:
            sync.__exit__(None, None, None)
        if producer is not None:
            producer.close()


def _sync_options(backend: str, mode: str, push_timeout_s: float) -> dict[str, Any]:
    return {"backend": backend, "mode": mode, "timeout_s": push_timeout_s}


# ---------------------------------------------------------------- the trainer's weights, by checkpoint name


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def policy_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every parameter of ``model`` under its base checkpoint's name, the
    names the workers' copy of the model has: wrappers' prefixes (``module.``, gradient
    checkpointing) dropped; for a PEFT model (whose adapter the caller merged, see
    :func:`_merged`) the ``base_model.model.`` prefix and ``.base_layer`` dropped and the adapter's
    own tensors skipped, as TRL names them for vLLM (experimental/async_grpo/async_grpo_trainer.py:663-694).
    Tied weights appear once, under the first name (``named_parameters`` de-duplicates them)."""
    peft = _is_peft(model)
    prefix = getattr(model, "prefix", "lora_") if peft else None
    for name, param in model.named_parameters():
        name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
        if peft:
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if prefix in name or "original_module" in name:
                continue
            name = name.replace("modules_to_save.default.", "")
        yield name, param.detach()


@contextlib.contextmanager
def _merged(model: Any) -> Iterator[Any]:
    """A PEFT model with its adapter merged into the base weights for the block (unmerged after,
    whatever happens: training goes on with the adapter apart); any other model as it is."""
    if not _is_peft(model):
        yield model
        return
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()


def _refuse_sharded(accelerator: Any) -> None:
    """The push sends the main process's own full copy of the weights: sharded training has none."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "FSDP" in kind:
        raise RolloutError("FSDP shards the weights across processes: RedrollRollout pushes the main process's "
                           "full copy and supports single-process and DDP training only")
    if "DEEPSPEED" in kind:
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        if getattr(plugin, "zero_stage", 0) == 3:
            raise RolloutError("DeepSpeed ZeRO-3 shards the weights across processes: RedrollRollout pushes the "
                               "main process's full copy and supports ZeRO stages 0-2")


# ---------------------------------------------------------------- GRPOTrainer(rollout_func=...)


class RedrollRollout:
    """A rollout function for TRL's ``GRPOTrainer(rollout_func=...)`` (TRL 1.16,
    ``trl/trainer/grpo_trainer.py:130``: called as ``rollout_func(prompts, trainer)``, :2210).

    ``settings``: where the fleet is (default: ``Settings.from_env()``, the ``REDROLL_*``
    variables). ``timeout_s``: how long one call waits for its records (default: as long as it
    takes; on expiry the outstanding requests are aborted and :class:`RolloutError` names them).
    ``backend``, ``mode``, ``push_timeout_s``: the weight push's (``producer.weight_sync``: gloo for
    CPU tensors, nccl for GPU ones; ``in_place`` swaps between two decode steps). ``seeded``:
    each request gets a sampling seed derived from the trainer's ``args.seed``, the call and the
    prompt's place, so a rerun samples the same way (False: random seeds).
    """

    def __init__(self, settings: Settings | None = None, *, timeout_s: float | None = None,
                 backend: str = "gloo", mode: str = "in_place", push_timeout_s: float = 60.0,
                 seeded: bool = True):
        self.timeout_s = timeout_s
        self.seeded = seeded
        self._fleet = _Fleet(settings, _sync_options(backend, mode, push_timeout_s))
        self._pushed_step: int | None = None
        self._calls = 0
        self.last_push: Any = None
        """The :class:`~redroll.producer.weight_sync.PushReport` of the latest push (main process)."""

    # -- what TRL calls

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        step = int(trainer.state.global_step)
        prompt_ids = tokenize_prompts(trainer, prompts)  # (what cannot work is refused before any push)
        sampling = sampling_params(trainer)
        self._push_if_stepped(trainer, step)
        accelerator = trainer.accelerator
        call = self._calls
        self._calls += 1
        tag = f"trl-s{step}-r{accelerator.process_index}-{uuid.uuid4().hex[:10]}"
        requests = [dict(request_id=f"{tag}-{i}", input_ids=ids, return_logprob=True, min_weight_version=step,
                         sampling_params={**sampling, **self._seed(trainer, call, accelerator.process_index, i)})
                    for i, ids in enumerate(prompt_ids)]
        records = self._generate(requests)
        return to_trl_output(prompt_ids, records, eos_token_id=trainer.eos_token_ids[0])

    # -- the parts

    def _push_if_stepped(self, trainer: Any, step: int) -> None:
        """The main process pushes the trainer's weights as version ``step`` when the step changed
        (the first call pushes too: the fleet serves these weights from then on); every process
        then waits for the others, so no request of the step is queued before its weights."""
        if step == self._pushed_step:
            return
        accelerator = trainer.accelerator
        if accelerator.is_main_process:
            _refuse_sharded(accelerator)
            model = accelerator.unwrap_model(trainer.model_wrapped)
            with _merged(model):
                self.last_push = self._fleet.push(policy_tensors(model), step)
        accelerator.wait_for_everyone()
        self._pushed_step = step

    def _seed(self, trainer: Any, call: int, rank: int, index: int) -> dict[str, int]:
        if not self.seeded:
            return {}
        digest = hashlib.blake2b(f"{trainer.args.seed}:{call}:{rank}:{index}".encode(), digest_size=8).digest()
        return {"sampling_seed": int.from_bytes(digest, "big") >> 1}

    def _generate(self, requests: list[dict[str, Any]]) -> list[CompletionRecord]:
        producer = self._fleet.start()
        futures = producer.submit_many(requests)
        ids = [r["request_id"] for r in requests]
        records: list[CompletionRecord] = []
        try:
            for fut in futures:
                records.append(fut.result(self.timeout_s))
        except FutureTimeout:
            late = [rid for rid, fut in zip(ids, futures) if not fut.done()]
            producer.abort(late)
            raise RolloutError(f"{len(late)} of {len(ids)} requests had no record after {self.timeout_s}s "
                               f"(aborted): {_listed(late)}") from None
        failed = [f"{rec.request_id}: {rec.status.value}: {rec.error or 'no reason given'}"
                  for rec in records if rec.status is not RecordStatus.FINISHED]
        if failed:
            raise RolloutError(f"{len(failed)} of {len(records)} requests did not finish: {_listed(failed)}")
        return records

    def weight_transfer(self) -> "RedrollWeightTransfer":
        """A weight transfer for TRL's async GRPO on this rollout function's producer and push."""
        return RedrollWeightTransfer(fleet=self._fleet)

    def close(self) -> None:
        """Close the producer (its thread and connections); the next call starts a new one."""
        self._fleet.close()

    def __enter__(self) -> "RedrollRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _listed(items: list[str]) -> str:
    shown = "; ".join(items[:SHOWN_FAILURES])
    return shown + (f"; and {len(items) - SHOWN_FAILURES} more" if len(items) > SHOWN_FAILURES else "")


def tokenize_prompts(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """The prompts' token ids exactly as TRL tokenizes them for its own generators
    (grpo_trainer.py:1684-1760): chat prompts through the processing class's chat template with
    the trainer's ``tools``, ``chat_template`` and ``chat_template_kwargs``, text as it is.
    ``return_dict=True`` is asked for: transformers 5's ``apply_chat_template(tokenize=True)``
    returns a dict by default, 4's a list."""
    processing = trainer.processing_class
    if not prompts:
        return []
    if _is_chat(prompts[0]):
        for prompt in prompts:
            for message in prompt:
                content = message.get("content")
                if isinstance(content, list) and any(part.get("type") != "text" for part in content):
                    raise RolloutError("prompt: RedrollRollout sends token ids only; multimodal content "
                                       "(images, audio) is not supported")
        tokenized = processing.apply_chat_template(
            conversation=prompts, tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=True,
            return_dict=True, **(getattr(trainer, "chat_template_kwargs", None) or {}))
        ids = tokenized["input_ids"]
    else:
        ids = processing(text=list(prompts))["input_ids"]
    return [list(map(int, row)) for row in ids]


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def sampling_params(trainer: Any) -> dict[str, Any]:
    """The trainer's sampling settings as redroll's ``sampling_params`` (GRPOConfig's
    ``temperature``, ``top_p``, ``top_k`` (0 = off in TRL, -1 in redroll), ``min_p`` (None = off),
    ``repetition_penalty``, ``max_completion_length``), stopping on the trainer's EOS ids (which
    TRL judges truncation by, grpo_trainer.py:2301-2302). ``generation_kwargs`` reach only TRL's own
    generators: set, they are refused rather than ignored."""
    args = trainer.args
    if getattr(args, "generation_kwargs", None):
        raise RolloutError(f"generation_kwargs: not supported by RedrollRollout (got {sorted(args.generation_kwargs)}); "
                           "use GRPOConfig's temperature, top_p, top_k, min_p, repetition_penalty")
    top_k = args.top_k if args.top_k is not None else 0
    return {"max_new_tokens": int(args.max_completion_length), "temperature": float(args.temperature),
            "top_p": float(args.top_p), "top_k": int(top_k) if top_k > 0 else -1,
            "min_p": float(args.min_p or 0.0), "repetition_penalty": float(args.repetition_penalty),
            "stop_token_ids": [int(t) for t in trainer.eos_token_ids]}


def record_version(record: CompletionRecord) -> int | str | None:
    """The weight version a record was generated with (an int when the version is one)."""
    version = record.meta_info.get("weight_version")
    return int(version) if isinstance(version, str) and version.isdigit() else version


def to_trl_output(prompt_ids: list[list[int]], records: list[CompletionRecord], *,
                  eos_token_id: int) -> dict[str, Any]:
    """TRL's rollout dict from finished records, one per prompt, in order.

    A record without a token becomes ``[eos_token_id]`` with logprob 0.0 and an ``env_mask`` of
    0 for it: TRL reads ``completion_ids[-1]`` of every completion (grpo_trainer.py:2302, an
    empty one raises IndexError), and ``env_mask`` (:2270-2272) keeps the placeholder out of the
    loss. Engines include the EOS they stop on, so this happens only for a zero-token budget."""
    completions, logprobs, masks, versions = [], [], [], []
    for record in records:
        ids = list(record.output_token_ids[0]) if record.output_token_ids else []
        lps = list(record.output_logprobs[0]) if record.output_logprobs else None
        if ids and (lps is None or len(lps) != len(ids)):
            raise RolloutError(f"{record.request_id}: the record's logprobs do not cover its {len(ids)} tokens")
        if ids:
            completions.append(ids)
            logprobs.append(lps)
            masks.append([1] * len(ids))
        else:
            completions.append([eos_token_id])
            logprobs.append([0.0])
            masks.append([0])
        versions.append(record_version(record))
    out = {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs, "weight_version": versions}
    if any(mask == [0] for mask in masks):
        out["env_mask"] = masks
    return out


# ---------------------------------------------------------------- AsyncGRPOTrainer(weight_transfer=...)


class RedrollWeightTransfer:
    """The ``weight_transfer`` of TRL's async GRPO (``WeightTransferProtocol``,
    trl/experimental/async_grpo/async_grpo_trainer.py:155-182), over redroll's weight push.

    TRL calls it on the main process only: ``init_weight_transfer()`` once, then for each sync
    ``pause()``, ``send_weights(iterator)``, ``resume()`` (:1751-1800), ``destroy()`` at the end.
    Each ``send_weights`` pushes the streamed ``(name, tensor)`` pairs to every live worker and
    returns once each serves them, as version ``first_version``, then one more per sync: the
    trainer's own ``model_version`` after that sync (it starts at 0 and counts syncs, :1797), so a
    worker's ``weight_version`` and the samples' ``model_version`` agree.

    ``pause``/``resume`` do nothing: a push in ``mode="in_place"`` (the default) swaps the weights
    between two decode steps while requests run, and every token records the version that made
    it; ``mode="quiesce"`` has each worker finish its requests in flight first. TRL streams
    tensors under the base checkpoint's names (a PEFT adapter already merged), which is what the
    workers' model has.
    """

    def __init__(self, settings: Settings | None = None, *, first_version: int = 1, backend: str = "gloo",
                 mode: str = "in_place", push_timeout_s: float = 60.0, fleet: _Fleet | None = None):
        self._owns_fleet = fleet is None
        self._fleet = fleet or _Fleet(settings, _sync_options(backend, mode, push_timeout_s))
        self.version = first_version - 1
        """The version of the latest push (``first_version - 1`` before the first)."""
        self.reports: list[Any] = []

    def init_weight_transfer(self) -> None:
        self._fleet.start()

    def pause(self) -> None:
        return None

    def send_weights(self, iterator: Iterable[tuple[str, Any]]) -> None:
        version = self.version + 1
        self.reports.append(self._fleet.push(iterator, version))
        self.version = version

    def resume(self) -> None:
        return None

    def destroy(self) -> None:
        if self._owns_fleet:
            self._fleet.close()
