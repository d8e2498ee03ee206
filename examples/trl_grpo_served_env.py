"""Train a model with TRL's GRPOTrainer on a crl-bench env served over OpenEnv (docs/serving.md).

    crl-bench serve sokoban --max-sessions 16 &
    python examples/trl_grpo_served_env.py --url http://127.0.0.1:8000 --model Qwen/Qwen2.5-0.5B-Instruct

Each dataset row names a task id (``--tasks N`` ids from ``--first-task``, ``--num-generations`` rows
each, so one GRPO group shares a task). TRL (>= 0.29: ``environment_factory``) makes one environment
object per generation and calls its ``reset(**row)``; the model acts by calling the ``act`` tool; the
reward is the episode's return on the server. The model's chat template must be one whose tool calls
TRL parses (Qwen2.5/3, Llama 3.x, ...): ``--chat-template NAME`` puts one shipped with TRL
(``trl/chat_templates/NAME.jinja``, e.g. ``qwen2_5`` for a ChatML model such as our default
SmolLM2) on the tokenizer. ``--max-sessions`` of the server must be at least the generation batch size.
Needs trl and openenv-core (the ``test`` extra has both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

INSTRUCTION = ("You are playing a text game. Each turn, call the `act` tool with exactly one of the valid actions "
               "the observation lists; the game tells you what happened. Reach the goal in as few actions as you can.")


def environment_class(url: str) -> type:
    """A TRL environment class whose instances each hold one OpenEnv session of the server at ``url``."""
    from openenv.core.generic_client import GenericEnvClient

    class ServedEnvironment:
        """One rollout's env: a session of the served crl-bench env."""

        def __init__(self) -> None:
            self.client = GenericEnvClient(base_url=url).sync()
            self.client.connect()
            self.reward = 0.0
            self.done = True

        def reset(self, task: int | None = None, split: str | None = None, **row: Any) -> str:
            """Start the row's task; returns the env's rules and first observation (appended to the prompt)."""
            kwargs = {k: v for k, v in (("task", task), ("split", split)) if v is not None}
            result = self.client.reset(**kwargs)
            self.reward, self.done = 0.0, result.done
            obs = result.observation
            return f"\n\n{obs['system_prompt']}\n\n{obs['text']}"

        def act(self, action: str) -> str:
            """Take one action in the game.

            Args:
                action: one of the valid actions the last observation lists.

            Returns:
                The next observation of the game.
            """
            if self.done:
                raise ValueError("The episode is over.")
            result = self.client.step({"reply": f"<answer>{action}</answer>"})
            self.reward += float(result.reward or 0.0)
            self.done = result.done
            return result.observation["text"] + ("\nThe episode is over." if result.done else "")

    return ServedEnvironment


def episode_return(environments: list, **kwargs: Any) -> list[float]:
    """GRPO's reward of each generation: the return of its episode on the server."""
    return [e.reward for e in environments]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse the options, train, and return TRL's log history (one dict per logged step)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server `crl-bench serve` printed")
    p.add_argument("--model", required=True, help="a Hugging Face model name or folder")
    p.add_argument("--chat-template", help="a chat template shipped with TRL, e.g. qwen2_5 (default: the model's)")
    p.add_argument("--split", help="the split of the tasks (default: the served split)")
    p.add_argument("--first-task", type=int, default=0)
    p.add_argument("--tasks", type=int, default=16, help="task ids first-task .. first-task+tasks-1")
    p.add_argument("--num-generations", type=int, default=4, help="GRPO group size")
    p.add_argument("--max-steps", type=int, default=50, help="training steps")
    p.add_argument("--max-completion-length", type=int, default=512, help="tokens of all turns together")
    p.add_argument("--max-tool-calls", type=int, default=10, help="actions per episode")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--output-dir", default="trl-served-env")
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat_template:
        import trl

        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" /
                                   f"{args.chat_template}.jinja").read_text()
    tasks = [args.first_task + i for i in range(args.tasks)]
    rows: dict[str, list] = {"prompt": [[{"role": "user", "content": INSTRUCTION}] for _ in tasks], "task": tasks}
    if args.split:
        rows["split"] = [args.split] * len(tasks)
    config = GRPOConfig(output_dir=args.output_dir, num_generations=args.num_generations,
                        per_device_train_batch_size=args.num_generations, max_steps=args.max_steps,
                        max_completion_length=args.max_completion_length,
                        max_tool_calling_iterations=args.max_tool_calls, learning_rate=args.learning_rate,
                        logging_steps=1, report_to="none", save_strategy="no",
                        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    trainer = GRPOTrainer(model=args.model, processing_class=tokenizer, reward_funcs=episode_return,
                          train_dataset=Dataset.from_dict(rows), args=config,
                          environment_factory=environment_class(args.url))
    trainer.train()
    return trainer.state.log_history


if __name__ == "__main__":
    history = main()
    print(history[-1] if history else "no steps logged", file=sys.stdout)
