"""What a task is: `Example`, `Task` and the registry the task modules add themselves to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from vineppo.core.errors import UserError
from vineppo.core.grading import lenient_gsm8k

DEFAULT_PROMPT = "Problem:\n{problem}\n\nSolution:"
# Chat prompts open with the task's instruction, which names the answer format its grader reads.
HASH_ANSWER = "Solve the problem step by step. Write the final answer on the last line in the form '#### <number>'."
BOXED_ANSWER = "Solve the problem step by step. Put the final answer in \\boxed{}."
# --data's help in every command that loads a task.
DATA_HELP = ("data file for tasks that read one (gsm8k, math; custom: JSONL, JSON, CSV, Parquet or hub:NAME[:CONFIG]), "
             "or arith's knobs, e.g. 'premature=0' (vineppo.tasks.arith)")


@dataclass(frozen=True)
class Example:
    """One problem: its id, text, reference solution (the SFT target) and reference final answer."""

    id: str  # unique in its data set (a custom task's: where the row is, e.g. train.jsonl:3)
    problem: str
    solution: str
    answer: str  # what the grader compares with ("" where the reward functions read the row instead: custom)


@dataclass(frozen=True)
class Task:
    """Everything the trainer needs to know about a data set."""

    name: str
    # load(split, path, seed) -> examples; path None means the task's default source (hub or generator).
    load: Callable[[str, str | None, int], list[Example]]
    # grade(completion, reference_answer) -> 1.0 or 0.0; never raises. What `score` calls per completion (None: a
    # task that scores batches itself, as `custom` does).
    grade: Callable[[str, str], float] | None
    # split_steps(response) -> steps whose concatenation is exactly the response.
    split_steps: Callable[[str], list[str]]
    prompt_template: str = DEFAULT_PROMPT
    instruction: str = HASH_ANSWER  # the chat prompt's instruction: how to solve and how to write the answer
    splits: tuple[str, ...] = ("train", "validation", "test")
    # Text that ends a response besides the tokenizer's EOS (a model that starts a new problem).
    stop: tuple[str, ...] = ("\n\nProblem:",)
    # lenient(completion, reference_answer) -> 1.0 or 0.0: `vineppo eval`'s lenient score, never the reward (None:
    # the strict one).
    lenient: Callable[[str, str], float] | None = lenient_gsm8k
    # Extra keyword knobs the loader accepts (documented per task).
    options: dict = field(default_factory=dict)
    # extract(completion) -> the answer the grader would compare, or None when it finds none (strict
    # parsability, right or wrong); None when the task has no extractor.
    extract: Callable[[str], str | None] | None = None
    # behaviour(example, completion) -> one of `behaviours`: how the response went about the problem (for
    # `eval` and the in-run metrics; never the reward); None when the task names no behaviours.
    behaviour: Callable[[Example, str], str] | None = None
    behaviours: tuple[str, ...] = ()
    step_tokens: int = 0  # > 0: a response's steps are runs of this many tokens, not `split_steps` (custom tokens:N)
    preset: str | None = None  # the preset `vineppo train --task NAME` uses without --config ("": TrainConfig's
    # defaults; None: none, --config is required)
    cpu_preset: str | None = None  # the preset used instead of `preset` on a CPU (None: `preset` everywhere)
    agent: Any = None  # the tools and environment of a multi-turn task (vineppo.tasks.agent.AgentSpec); None: one turn
    step_turns: bool = False  # a response's steps are its turns (--steps turns), not `split_steps`

    def score(self, examples: list[Example], texts: list[str], token_ids: list[list[int]]) -> list[float | None]:
        """The reward of each finished completion texts[i] (token ids token_ids[i]) of examples[i], None where there
        is none; the trainer, eval and the analyses call this, once per batch. Default: `grade` per completion."""
        return [self.grade(text, ex.answer) for ex, text in zip(examples, texts)]

    def row(self, example: Example) -> dict:
        """The example as a row of named columns (what an environment's reset reads)."""
        return {"id": example.id, "prompt": example.problem, "answer": example.answer}

    def preset_on(self, device: str) -> str | None:
        """The preset a run without --config uses on `device` (cpu, cuda, ...): `cpu_preset` on a CPU if it has one,
        else `preset`."""
        return self.cpu_preset if device == "cpu" and self.cpu_preset is not None else self.preset

    def reward_log(self) -> Any:
        """What a task's reward functions log besides the reward (custom: vineppo.core.rewards.RewardLog), else None."""
        return None

    def configured(self, settings: Any) -> Task:
        """The task for a command's settings (its flags, or a TrainConfig): itself; `custom` reads its own."""
        return self

    def chat_turns(self, example: Example) -> list[dict] | None:
        """The chat turns of an example's prompt when its data gives them (custom), else None: the chat prompt
        is one user turn, the instruction then the problem."""
        return None

    def auto_format(self, recorded: str | None) -> str | None:
        """The prompt format `auto` picks, given the one recorded with the model: that one (None: chat when the
        tokenizer has a template, else plain); `custom` chooses by its data."""
        return recorded

    def solved(self, reward: float | None) -> bool:
        """Whether a response with this reward counts as solved in pass@1 and pass@k."""
        return reward is not None and reward >= 1.0

    def prompt(self, example: Example) -> str:
        """The prompt text for one example."""
        return self.prompt_template.format(problem=example.problem)

    def response_steps(self, text: str) -> list[str]:
        """A sampled response's steps (`split_steps`), a stop string and what follows it joined to the last step.

        The stop string ends the response like EOS: a Monte Carlo state at it, or inside it, would be continued
        past the point where sampling stopped (the stop string is matched in generated text only), so its value
        would not be the value of the response that ended there."""
        cut = min((i for i in (text.find(s) for s in self.stop if s) if i >= 0), default=len(text))
        steps = self.split_steps(text[:cut]) if cut else []
        if cut < len(text):
            steps = steps[:-1] + [(steps[-1] if steps else "") + text[cut:]]
        return steps

    def target(self, example: Example) -> str:
        """The SFT target: the response text that follows the prompt."""
        return " " + example.solution


TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add a task to the registry under its name."""
    TASKS[task.name] = task
    return task


def get_task(name: str, settings: Any = None) -> Task:
    """The registered task called `name` for a command's settings (`Task.configured`), or a UserError listing the
    known ones."""
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name].configured(settings)
