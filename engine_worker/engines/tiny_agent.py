"""Tiny agent checkpoints, built in code: the tiny Llama of :mod:`.tiny_checkpoint` with a chat
template of a real tool-calling family, and (optionally) weights trained until it says given replies.

* ``save_agent_checkpoint(directory, family)``: the byte-level BPE tokenizer with the family's
  special tokens added (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>`` for
  ``hermes``; ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``, ``<|python_tag|>``
  for ``llama3_json``), its end-of-turn token as end of sequence, and a chat template in the
  family's format (:data:`TEMPLATES`: ChatML with Qwen 2.5's ``<tool_call>`` instructions; Llama
  3.1's headers and JSON calls). Random weights: what the structured-output and session tests run.
* ``scripted=[(messages, tools, reply), ...]``: the output layer is then fitted (a second or two on
  the CPU) until greedy decoding of each prompt, as the template renders it, gives its reply and
  the end-of-turn token. A tiny random model never calls a tool on its own:
  this one does, through the real template, the real engine and the real parser, because it
  learned to say exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from redroll.engine_worker.engines.tiny_checkpoint import SPECIAL_TOKENS, _train_tokenizer, build_tiny_llama

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool['function'] | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for tc in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ tc['function']['arguments'] }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML turns closed by ``<|im_end|>\\n``, tools in the system turn, calls as ``<tool_call>`` JSON
(Qwen 2.5's format, shortened)."""

LLAMA3_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' or tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{% if tools %}Answer with a JSON function call {\"name\": NAME, \"parameters\": ARGS}. Tools: "
    "{{ tools | map(attribute='function') | list | tojson }}{% endif %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m['tool_calls'] %}{\"name\": \"{{ tc['function']['name'] }}\", \"parameters\": "
    "{{ tc['function']['arguments'] }}}{% endfor %}<|eot_id|>"
    "{% elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3.1's headers, turns closed by ``<|eot_id|>``, calls as a JSON object, tool results as
``ipython`` turns (shortened)."""

TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE}
FAMILY_TOKENS = {"hermes": ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
                 "llama3_json": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")}
END_OF_TURN = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>"}

Script = Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]]
"""(messages, tools, the reply the model says to them) per scripted turn."""


def agent_tokenizer(family: str) -> Any:
    """The byte-level BPE tokenizer with ``family``'s special tokens and template; end of sequence
    is the family's end-of-turn token."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), bos_token="<bos>",
                                        eos_token=END_OF_TURN[family], pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(FAMILY_TOKENS[family])})
    tokenizer.chat_template = TEMPLATES[family]
    return tokenizer


def save_agent_checkpoint(directory: str | Path, family: str, seed: int = 0, *, scripted: Script = (),
                          max_steps: int = 3000) -> Path:
    """Write a ``family`` checkpoint into ``directory`` (see the module's doc); with ``scripted``,
    trained until greedy decoding says each reply (RuntimeError if ``max_steps`` do not get there)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = agent_tokenizer(family)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    eos = tokenizer.eos_token_id
    model = build_tiny_llama(len(tokenizer), ids[0], eos, ids[2], seed=seed)
    if scripted:
        _teach(model, tokenizer, scripted, max_steps)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "redroll-tiny.json").write_text(json.dumps({"seed": seed, "family": family, "scripted": len(scripted)}))
    return out.resolve()


def _examples(tokenizer: Any, scripted: Script) -> list[tuple[list[int], list[int]]]:
    """(prompt ids as the template renders them, reply ids + end of turn) per scripted turn."""
    out = []
    for messages, tools, reply in scripted:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if hasattr(prompt, "input_ids") or isinstance(prompt, dict):
            prompt = prompt["input_ids"]
        target = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((list(prompt), target))
    return out


def _teach(model: Any, tokenizer: Any, scripted: Script, max_steps: int) -> None:
    """Train the output layer (``lm_head``) on the replies' positions until greedy decoding of
    every prompt gives its reply exactly, by a margin of 4 in logits. The body of the network stays
    random: its last hidden states at those positions are computed once (teacher forcing), and the
    output layer, a linear map of them, is fitted by Adam on the cross-entropy (a convex problem:
    a second or two on the CPU)."""
    import torch

    examples = _examples(tokenizer, scripted)
    features, targets = [], []
    with torch.no_grad():
        for prompt, target in examples:
            sequence = torch.tensor([prompt + target[:-1]])
            hidden = model.model(input_ids=sequence).last_hidden_state[0]
            features.append(hidden[len(prompt) - 1:])
            targets.append(torch.tensor(target))
    x, y = torch.cat(features), torch.cat(targets)
    weight = model.lm_head.weight
    optimizer = torch.optim.Adam([weight], lr=0.05)
    for _step in range(max_steps):
        logits = x @ weight.T
        loss = torch.nn.functional.cross_entropy(logits, y)
        with torch.no_grad():
            chosen = logits.gather(1, y.unsqueeze(1)).squeeze(1)
            rival = logits.scatter(1, y.unsqueeze(1), float("-inf")).max(dim=1).values
            if bool((chosen - rival > 4.0).all()):
                break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise RuntimeError(f"the tiny model did not learn its replies in {max_steps} steps (loss {float(loss):.4f})")
    weight.requires_grad_(False)


__all__ = ["END_OF_TURN", "FAMILY_TOKENS", "HERMES_TEMPLATE", "LLAMA3_TEMPLATE", "TEMPLATES", "agent_tokenizer",
           "save_agent_checkpoint"]
