"""Tasks: a loader, a prompt, a grader and a step splitter, looked up by name (prompt formats: vineppo.models.prompts).

Adding a task is one new module that calls `register(Task(...))` (vineppo.tasks.base), imported below; a user's
own task needs no module: `custom` reads a data set, reward functions and a step splitter (vineppo.tasks.custom).
"""

from vineppo.tasks import arith, custom, gsm8k, math  # noqa: F401  (each registers its task)
from vineppo.tasks.base import (BOXED_ANSWER, DATA_HELP, DEFAULT_PROMPT, HASH_ANSWER, TASKS, Example, Task, get_task,
                                register)

__all__ = ["BOXED_ANSWER", "DATA_HELP", "DEFAULT_PROMPT", "HASH_ANSWER", "TASKS", "Example", "Task", "get_task",
           "register"]
