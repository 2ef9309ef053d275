"""Tasks: a loader, a prompt, a grader and a step splitter, looked up by name (prompt formats: vineppo.prompts).

Adding a task is one new module that calls `register(Task(...))` (vineppo.tasks.base), imported below.
"""

from vineppo.tasks import arith, gsm8k, math  # noqa: F401  (each registers its task)
from vineppo.tasks.base import (BOXED_ANSWER, DATA_HELP, DEFAULT_PROMPT, HASH_ANSWER, TASKS, Example, Task, get_task,
                                register)

__all__ = ["BOXED_ANSWER", "DATA_HELP", "DEFAULT_PROMPT", "HASH_ANSWER", "TASKS", "Example", "Task", "get_task",
           "register"]
