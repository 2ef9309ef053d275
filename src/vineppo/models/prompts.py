"""Prompt formats: how a problem becomes the model's input, and its reference solution the SFT target.

- `plain`: `Problem:\\n<problem>\\n\\nSolution:`; target ` <solution>` + EOS (the tiny model's format).
- `chat`: the tokenizer's chat template with one user turn (the task's instruction, which names its answer
  format, then the problem) and the generation prompt. The target is the assistant turn as the template
  writes it, up to and including its end-of-turn token. Encoded without adding special tokens: the
  template writes its own BOS, so there is never a second one.
- `fewshot:N`: N solved train problems in the plain format (solution, blank line), then the problem in the
  plain format. The task's stop string `\\n\\nProblem:` ends a response that goes on to a new problem.
- `auto`: the format recorded in the model folder (`vineppo.json`, written by `vineppo sft` and by training
  checkpoints), else `chat` when the tokenizer has a chat template, else `plain`; for every task, `custom`
  included. A `custom` task whose prompts are chat turns is always `chat`.

A `custom` task's chat prompt is its data's own turns (`Task.chat_turns`); a text prompt in `chat` is one user
turn with the text alone (the task has no instruction).
"""

from __future__ import annotations

import json
from pathlib import Path

from vineppo.core.config import FORMAT
from vineppo.core.errors import UserError
from vineppo.tasks import Example, Task

SAVED = "vineppo.json"  # in a model folder: {"prompt_format": ..., "dtype": ...}
DTYPES = ("float32", "bfloat16", "float16")
HELP = "plain, chat, fewshot:N or auto (default: the model folder's recorded format, else chat if the " \
       "tokenizer has a chat template, else plain; a custom task's chat-turn prompts: chat)"




def check_format(spec: str) -> str:
    """`spec` if it names a format, else a UserError naming --prompt-format."""
    if FORMAT.fullmatch(spec):
        return spec
    raise UserError(f"--prompt-format {spec!r}: use plain, chat, fewshot:N (N >= 1) or auto")


def saved_record(model: str | Path | None) -> dict:
    """What a model folder's `vineppo.json` records (prompt_format; dtype for a run's checkpoint), or {}."""
    path = Path(str(model)) / SAVED if model is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
        check_format(record["prompt_format"])
        if record.get("dtype") not in (None, *DTYPES):
            raise ValueError(record["dtype"])
        return record
    except (ValueError, KeyError, TypeError, UserError):
        raise UserError(f"{path}: expected {{\"prompt_format\": \"plain|chat|fewshot:N\"}} and optionally "
                        f"\"dtype\": one of {', '.join(DTYPES)}") from None


def saved_format(model: str | Path | None) -> str | None:
    """The prompt format recorded in a model folder, or None."""
    return saved_record(model).get("prompt_format")


def saved_dtype(model: str | Path | None) -> str | None:
    """The dtype a run's checkpoint trained in (its forward passes: bf16 under bf16 autocast), or None."""
    return saved_record(model).get("dtype")


def save_format(folder: str | Path, fmt: str, dtype: str | None = None) -> None:
    """Record the prompt format a model was trained with in its folder (and, for a run's checkpoint, the dtype its
    forward passes ran in: `vineppo eval` loads it so by default)."""
    record = {"prompt_format": fmt} | ({"dtype": dtype} if dtype else {})
    (Path(folder) / SAVED).write_text(json.dumps(record) + "\n")


class Prompter:
    """Token ids of prompts (and SFT targets) for one task, tokenizer and prompt format."""

    def __init__(self, task: Task, tokenizer, spec: str | None = "auto", model: str | Path | None = None,
                 data: str | None = None, seed: int = 0):
        self.task, self.tokenizer = task, tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        fmt = check_format(spec or "auto")
        if fmt == "auto":
            fmt = task.auto_format(saved_format(model)) or ("chat" if has_template else "plain")
        if fmt == "chat" and not has_template:
            raise UserError(f"--prompt-format chat: the tokenizer of {model or 'this model'} has no chat template; "
                            f"use plain or fewshot:N")
        self.format = fmt
        self.n_shots = int(fmt.split(":")[1]) if fmt.startswith("fewshot:") else 0
        # the first train problems, one spare for when the problem itself is one of them
        self.shots: list[Example] = task.load("train", data, seed)[: self.n_shots + 1] if self.n_shots else []
        if len(self.shots) < self.n_shots:
            raise UserError(f"--prompt-format {fmt}: task {task.name!r} has only {len(self.shots)} train problems")

    @property
    def tool_format(self) -> str:
        """How a task's tools reach the model: `template` (the chat template's tools= and tool turns) or `plain` (a
        system text that shows the call markup; results inline): --tool-format, auto choosing template for a chat
        prompt whose template mentions tools."""
        agent = self.task.agent
        if agent is None or not agent.tools:
            return "plain"
        knows = self.format == "chat" and "tool" in (getattr(self.tokenizer, "chat_template", None) or "")
        return "template" if agent.format == "template" or (agent.format == "auto" and knows) else "plain"

    def text(self, ex: Example, extra: str = "", join: str | None = None) -> str:
        """The prompt as text; `extra` (an environment's first observation) ends its last user turn, after `join`
        (None: a blank line in chat, a line break outside it; TRL's environments: "")."""
        if self.format == "chat":
            return self._chat(ex, extra=extra, join="\n\n" if join is None else join)
        if self.task.chat_turns(ex) is not None:
            raise UserError(f"--prompt-format {self.format}: the prompt of {ex.id} is chat turns; use chat (or auto)")
        shots = [s for s in self.shots if s.problem != ex.problem][: self.n_shots]
        tools = self.task.agent.system_text() + "\n\n" if self.task.agent is not None and self.task.agent.tools else ""
        return tools + "".join(self.task.prompt(s) + self.task.target(s) + "\n\n" for s in shots) + \
            self.task.prompt(ex) + (("\n" if join is None else join) + extra if extra else "")

    def prompt(self, ex: Example, extra: str = "", join: str | None = None) -> list[int]:
        """Token ids of the prompt (with the tokenizer's own prefix, e.g. BOS, outside chat)."""
        return self.tokenizer(self.text(ex, extra, join), add_special_tokens=self.format != "chat")["input_ids"]

    def next_turn(self, messages: list[dict], ended_with: str) -> str:
        """The text between the end of a policy turn and its next turn, when `messages` end with the answer to it (a
        user turn: an observation; a tool turn): the chat template's closing of the turn (less `ended_with`, the end
        token the policy wrote), the answer's turn and the generation prompt; outside chat the answer on its line."""
        if self.format != "chat":
            return f"\n{messages[-1]['content']}\n"
        stub = [{"role": "user", "content": "?"}]  # the template's rendering of what follows does not depend on it
        kw = {"tools": [t.schema for t in self.task.agent.tools.values()]} if self.tool_format == "template" else {}
        before = self.tokenizer.apply_chat_template(stub + messages[:-1], tokenize=False, **kw)
        after = self.tokenizer.apply_chat_template(stub + messages, tokenize=False, add_generation_prompt=True, **kw)
        said = messages[-2]["content"]
        if not after.startswith(before) or said not in before:
            raise UserError("this chat template does not render a dialogue turn by turn; use --prompt-format plain")
        close = before[before.rindex(said) + len(said):]
        return close.removeprefix(ended_with) + after[len(before):]

    def encode(self, examples: list[Example]) -> list[list[int]]:
        """Token ids of the prompts of `examples`, tokenized as one batch (fast for a whole training set)."""
        return self.tokenizer([self.text(ex) for ex in examples], add_special_tokens=self.format != "chat")["input_ids"]

    def target(self, ex: Example) -> list[int]:
        """Token ids of the reference response, ending with the end-of-turn (or EOS) token: the SFT target."""
        tok = self.tokenizer
        if self.format != "chat":
            return tok(self.task.target(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt, full = self._chat(ex), self._chat(ex, ex.solution)
        if not full.startswith(prompt):
            raise UserError("--prompt-format chat: this chat template does not write the assistant turn after its "
                            "generation prompt; use plain or fewshot:N")
        ids = tok(full[len(prompt):].rstrip(), add_special_tokens=False)["input_ids"]
        return ids if ids and ids[-1] in tok.all_special_ids else ids + [tok.eos_token_id]

    def _chat(self, ex: Example, solution: str | None = None, extra: str = "", join: str = "\n\n") -> str:
        turns = self.task.chat_turns(ex) or [{"role": "user", "content": f"{self.task.instruction}\n\n{ex.problem}"
                                              if self.task.instruction else ex.problem}]
        if extra:
            turns = turns[:-1] + [{**turns[-1], "content": f"{turns[-1]['content']}{join}{extra}"}]
        kw = {}
        if self.tool_format == "template":
            kw["tools"] = [t.schema for t in self.task.agent.tools.values()]
        elif self.task.agent is not None and self.task.agent.tools:  # plain: the tools and the markup, as a system turn
            text = self.task.agent.system_text()
            turns = [{"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}] + turns[1:] \
                if turns[0]["role"] == "system" else [{"role": "system", "content": text}] + turns
        if solution is not None:
            turns = turns + [{"role": "assistant", "content": solution}]
        return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=solution is None, **kw)
