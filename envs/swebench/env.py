"""SWE-Bench-Verified: fix a real GitHub issue in the repository's container with bash and an editor.

One episode = one instance (:mod:`.instances`) in its own container (:class:`.sandbox.DockerSandbox`,
no network, resource limits, non-root agent, removed at the end).  The actor calls one tool per turn
(:mod:`.tools`): ``bash`` (a command in the working tree, with a timeout and truncated output),
``str_replace_editor`` (view / create / str_replace / insert / undo_edit) or ``submit``.  A reply without
a well-formed tool call is an invalid action fed back; a tool's own error (no match, ambiguous match,
missing file) is normal feedback.

Reward (the paper's sparse outcome reward, Complementary RL section 4 / SWE-bench's "resolved"): at
``submit`` or at the step limit the working tree's diff against the base commit is taken and graded by
:func:`.grading.grade` (swebench's patch application, the instance's eval script and swebench's own log
grading), by default in a fresh container of the same image as swebench's harness does.  Reward 1.0 when
the instance is fully resolved, else 0.0; success = resolved.

Tasks: the instances of a task-list file (``task_list``, e.g. the one ``crl-bench swe filter`` writes;
the paper keeps 124 of the 500), else all instances with a warning saying so.  Train ids are ``0..n-1``
over that list; eval ids are ``EVAL_OFFSET + i`` over ``eval_task_list`` (default: the same list).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import warnings
from pathlib import Path
from typing import Any, ClassVar

from crl_bench.data import data_dir as resolve_data_dir
from crl_bench.env_api import ParsedAction, ReplyFormat, TextEnv, data_file_map

from .engine import docker_client, resolve_engine
from .grading import GradeResult, grade
from .images import ensure_image, local_images
from .instances import SWEInstance, default_instances_path, load_instances, load_task_list, select_instances
from .sandbox import ContainerWorkspace, DockerSandbox, ImageUnavailableError
from .tools import TOOLS_PROMPT, StrReplaceEditor, ToolCall, ToolCallError, ToolError, parse_tool_call

log = logging.getLogger(__name__)

EVAL_OFFSET = 1_000_000

SYSTEM_PROMPT = """\
You are a software engineer fixing an issue in a Python repository checked out at {workdir}, inside a \
sandbox without network access. Explore the code, reproduce the problem if you can, then change the \
source files so the issue is resolved (hidden tests will check it; do not edit existing tests). Keep \
changes minimal. Submit when you are done; your edits to the working tree are your answer.

{tools}"""


class SWEBenchEnv(TextEnv):
    """SWE-Bench-Verified env; see the module docstring.

    Args:
        max_steps: tool calls per episode (graded at the last one).
        instances: a ``.parquet``/``.jsonl``/``.json`` instance file (default SWE-bench Verified in the
            data dir). data_dir: the data dir for the default file.
        task_list: file of instance ids to train on (default: every instance, with a warning).
        eval_task_list: ids to evaluate on (default: the training list).
        workdir: the working tree in the image (``/testbed`` in swebench images).
        network: give the agent's container network access (default off).
        engine: the container engine, ``"docker"`` (default; ``$CRL_BENCH_SWE_ENGINE`` when set) or
            ``"podman"``: Podman's Docker-compatible API, rootless where run as a user; its socket is
            found, or its service started, as :mod:`.engine` says.
        memory_mb, cpus, pids, disk_mb: container limits (disk_mb: how much its files may grow; see
            :mod:`.sandbox`; rootless Podman may not enforce memory, cpus and pids: the sandbox warns).
            command_timeout_s: per bash command, seconds.
        max_output_chars: tool output kept per turn. non_root: run the agent as the ``agent`` user.
        pull: try pulling missing images. recipe_dir: a swebench task repository to build images from.
        check_images: at creation, fail unless at least one instance image can be obtained.
        grade_in: ``"fresh"`` (default, swebench's way: apply the diff in a new container) or ``"same"``
            (run the eval script in the agent's container). grade_network: network for the grading
            container (default off: the agent's patch runs there as root, and swebench images carry
            their environment; the eval script's ``pip install -e .`` then rebuilds from what the
            image holds or fails fast and the image's editable install is tested). eval_timeout_s:
            eval script limit.
        grade_empty_patch: run the tests even when the agent changed nothing (default off: reward 0).
        max_issue_chars: the issue text shown is cut to this many characters.
        prefill: text that opens each reply (steers a small model into the tool-call format).
        min_new_tokens: reply token budget per turn.

    Raises:
        DockerUnavailableError: no Docker daemon (PodmanUnavailableError, a subclass: no Podman API
        and none can be started). ValueError: an unknown ``engine`` or ``grade_in``.
        ImageUnavailableError (``check_images``): no instance image is present, pullable or buildable.
        DataMissingError: no instance file. KeyError: a task list names unknown instances.
    """

    env_id: ClassVar[str] = "swebench-verified"
    prefetch_resets: ClassVar[bool] = True
    reply_format: ClassVar[ReplyFormat] = ReplyFormat(
        instruction=("Reply with at most a few sentences of reasoning and then exactly one "
                     "<tool_call>{...}</tool_call>."),
        prefill='<tool_call>{"name": "', min_new_tokens=384, stop=("</tool_call>",))

    def __init__(self, max_steps: int = 50, instances: str | None = None, data_dir: str | None = None,
                 task_list: str | None = None, eval_task_list: str | None = None, workdir: str = "/testbed",
                 network: bool = False, engine: str | None = None, memory_mb: int = 4096, cpus: float = 2.0,
                 pids: int = 1024,
                 disk_mb: int = 4096,
                 command_timeout_s: float = 120.0, max_output_chars: int = 8000, non_root: bool = True,
                 pull: bool = True, recipe_dir: str | None = None, check_images: bool = True,
                 grade_in: str = "fresh", grade_network: bool = False, eval_timeout_s: float = 1800.0,
                 grade_empty_patch: bool = False, max_issue_chars: int = 6000,
                 prefill: str = '<tool_call>{"name": "', min_new_tokens: int = 384,
                 render_mode: str | None = "ansi") -> None:
        super().__init__(max_steps=max_steps, render_mode=render_mode)
        if grade_in not in ("fresh", "same"):
            raise ValueError(f"swebench: grade_in must be 'fresh' or 'same', got {grade_in!r}")
        self.engine = resolve_engine(engine)
        everything = load_instances(instances, data_dir)
        self._data_root = resolve_data_dir(data_dir)
        self._data_paths = [Path(instances) if instances else default_instances_path(data_dir)]
        self._data_paths += [Path(f) for f in (task_list, eval_task_list) if f]
        if task_list:
            self.train_instances = select_instances(everything, load_task_list(task_list))
        else:
            self.train_instances = everything
            warnings.warn(f"swebench-verified: no task_list given, using all {len(everything)} instances "
                          f"(the paper trains on those `crl-bench swe filter` keeps)", stacklevel=2)
        self.eval_instances = (select_instances(everything, load_task_list(eval_task_list))
                               if eval_task_list else self.train_instances)
        self.splits = {"train": range(len(self.train_instances)),
                       "eval": range(EVAL_OFFSET, EVAL_OFFSET + len(self.eval_instances))}
        self.workdir = workdir
        self.sandbox_kw = dict(workdir=workdir, memory_mb=memory_mb, cpus=cpus, pids=pids, disk_mb=disk_mb,
                               command_timeout_s=command_timeout_s, max_output_chars=max_output_chars)
        self.non_root, self.network = non_root, network
        self.pull, self.recipe_dir = pull, recipe_dir
        self.grade_in, self.grade_network = grade_in, grade_network
        self.eval_timeout_s, self.grade_empty_patch = float(eval_timeout_s), bool(grade_empty_patch)
        self.max_issue_chars = int(max_issue_chars)
        # the constructor's prefill and budget: an instance attribute, which the rollout reads
        self.reply_format = dataclasses.replace(type(self).reply_format, prefill=prefill,
                                                min_new_tokens=int(min_new_tokens))
        self.system_prompt = SYSTEM_PROMPT.format(workdir=workdir, tools=TOOLS_PROMPT.replace("/repo", workdir))
        self.client = docker_client(engine=self.engine)
        if check_images:
            self._check_images()
        self.instance: SWEInstance | None = None
        self.sb: DockerSandbox | None = None
        self.editor: StrReplaceEditor | None = None
        self._job: threading.Thread | None = None
        self._job_result: Any = None
        self._job_error: BaseException | None = None
        self._call: ToolCall | None = None
        self.grade_result: GradeResult | None = None
        self.patch = ""
        self._submitted = False

    def _check_images(self) -> None:
        wanted = {i.image: i for i in self.train_instances + self.eval_instances}
        have = local_images(self.client)
        if any(img in have for img in wanted):
            return
        first = self.train_instances[0] if self.train_instances else self.eval_instances[0]
        try:
            ensure_image(first.image, first.instance_id, self.client, pull=self.pull, recipe_dir=self.recipe_dir)
        except ImageUnavailableError as e:
            raise ImageUnavailableError(
                f"swebench-verified: none of the {len(wanted)} instance images is present locally, and the "
                f"first one cannot be obtained: {e}") from None

    # ---- tasks ------------------------------------------------------------------------------------
    def data_files(self) -> dict[str, Path]:
        """The instance file and the task-list files given (``task_list``, ``eval_task_list``), named
        relative to the data dir when inside it, else by absolute path (:meth:`TextEnv.data_files`)."""
        return data_file_map(self._data_root, self._data_paths)

    def instance_of(self, task: int) -> SWEInstance:
        """The instance of task id ``task``.  Raises KeyError for an unknown id."""
        if 0 <= task < len(self.train_instances):
            return self.train_instances[task]
        if 0 <= task - EVAL_OFFSET < len(self.eval_instances):
            return self.eval_instances[task - EVAL_OFFSET]
        raise KeyError(f"swebench-verified: unknown task id {task}")

    def task_fingerprint(self, task: int) -> dict[str, Any]:
        """The SWE-bench instance of task id ``task``: id, repo, base commit, the sha256 of its problem
        statement and of its test patch, and the tests that grade it (:meth:`TextEnv.task_fingerprint`;
        no container is started). Raises ``KeyError`` for an unknown id."""
        inst = self.instance_of(self.check_task(task))
        return {"instance_id": inst.instance_id, "repo": inst.repo, "base_commit": inst.base_commit,
                "problem_statement_sha256": hashlib.sha256(inst.problem_statement.encode()).hexdigest(),
                "test_patch_sha256": hashlib.sha256(inst.test_patch.encode()).hexdigest(),
                "fail_to_pass": list(inst.fail_to_pass), "pass_to_pass": list(inst.pass_to_pass)}

    def task_prompt(self) -> str:
        inst = self.instance
        if inst is None:
            return ""
        text = inst.problem_statement.strip()
        if len(text) > self.max_issue_chars:
            text = text[:self.max_issue_chars] + "\n[... issue text cut ...]"
        return f"Resolve this issue of {inst.repo} ({inst.instance_id}):\n{text}"

    # ---- background jobs (container start, tool calls) so that many envs progress at once ---------
    def _run_job(self, fn) -> None:
        self._job_result, self._job_error = None, None

        def target() -> None:
            try:
                self._job_result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in _wait_job
                self._job_error = e

        self._job = threading.Thread(target=target, daemon=True)
        self._job.start()

    def _wait_job(self) -> Any:
        if self._job is not None:
            self._job.join()
            self._job = None
        if self._job_error is not None:
            err, self._job_error = self._job_error, None
            raise err
        return self._job_result

    def _new_sandbox(self, inst: SWEInstance, network: bool, non_root: bool) -> DockerSandbox:
        ensure_image(inst.image, inst.instance_id, self.client, pull=self.pull, recipe_dir=self.recipe_dir)
        return DockerSandbox(inst.image, client=self.client, network=network, non_root=non_root,
                             **self.sandbox_kw).start()

    # ---- TextEnv hooks ----------------------------------------------------------------------------
    def _submit_reset(self, task: int) -> None:
        self._close_sandbox()
        inst = self.instance_of(task)
        self._run_job(lambda: self._new_sandbox(inst, self.network, self.non_root))

    def _reset_task(self, task: int) -> None:
        if self._job is None:                                 # reset() without reset_async()
            self._submit_reset(task)
        self.instance = self.instance_of(task)
        self.sb = self._wait_job()
        self.editor = StrReplaceEditor(ContainerWorkspace(self.sb))
        self.grade_result, self.patch, self._submitted = None, "", False

    def parse_action(self, reply: str) -> ParsedAction:
        text = reply if isinstance(reply, str) else str(reply)
        try:
            call = parse_tool_call(text)
        except ToolCallError as e:
            return ParsedAction(None, text.strip()[:200], str(e))
        self._call = call
        return ParsedAction(_label(call), text)

    def _submit_apply(self, action: str) -> None:
        call = self._call
        self._run_job(lambda: self._tool(call))

    def _tool(self, call: ToolCall) -> tuple[bool, str]:
        """Run one tool call; ``(submitted, feedback text)``."""
        if call.name == "submit":
            return True, ""
        if call.name == "bash":
            r = self.sb.exec(call.args["command"])
            if r.timed_out:
                head = f"bash: the command ran past {self.sb.command_timeout_s:g} s and was killed"
            else:
                head = f"bash: exit code {r.exit_code}"
            notes = "".join(f"\n{n}" for n in r.notes)
            return False, f"{head}\n{r.output if r.output.strip() else '(no output)'}{notes}"
        args = dict(call.args)
        command, path = args.pop("command"), args.pop("path")
        try:
            out = self.editor.run(command, path, **args)
            return False, f"str_replace_editor {command}: done\n{out}"
        except ToolError as e:
            return False, f"str_replace_editor {command}: error: {e}"

    def _apply(self, action: str) -> tuple[float, bool, bool, str]:
        submitted, message = self._wait_job()
        if submitted:
            self._submitted = True
            self._finish()
            return self._reward(), True, self.grade_result.resolved, self._grade_message()
        return 0.0, False, False, message

    def truncation_reward(self) -> float:
        """The step limit ends the episode: grade the working tree as at ``submit``."""
        if self.grade_result is None:
            self._finish()
            self._success = self.grade_result.resolved
            return self._reward()
        return 0.0

    def _reward(self) -> float:
        return 1.0 if self.grade_result is not None and self.grade_result.resolved else 0.0

    def _finish(self) -> None:
        inst = self.instance
        try:
            self.patch = self.sb.diff(inst.base_commit)
        except Exception as e:  # noqa: BLE001 - the episode's container is broken: no answer
            self.grade_result = GradeResult(error=f"could not read the working tree: {e}")
            self._close_sandbox()
            return
        if not self.patch.strip() and not self.grade_empty_patch:
            self.grade_result = GradeResult(error="no changes to grade")
        elif self.grade_in == "same":
            self.grade_result = grade(self.sb, inst, self.patch, self.eval_timeout_s, apply=False)
        else:
            self._close_sandbox()
            try:
                judge = self._new_sandbox(inst, self.grade_network, non_root=False)
            except Exception as e:  # noqa: BLE001 - any start failure is an ungraded episode, not a crash
                self.grade_result = GradeResult(error=f"could not start the grading container: {e}")
            else:
                try:
                    self.grade_result = grade(judge, inst, self.patch, self.eval_timeout_s)
                finally:
                    judge.close()
        self._close_sandbox()

    def _grade_message(self) -> str:
        g = self.grade_result
        if g is None:
            return ""
        head = "Submitted" if self._submitted else "Step limit reached, the working tree was graded"
        if g.resolved:
            return f"{head}: the issue is resolved (all tests pass)."
        why = g.error or "some FAIL_TO_PASS / PASS_TO_PASS tests fail"
        return f"{head}: the issue is not resolved ({why})."

    def _observe(self, message: str = "") -> str:
        if self.instance is None:
            return ""
        if self.grade_result is not None:
            graded = self._grade_message()
            message = f"{message}\n{graded}" if message and graded not in message else graded
        if not message:
            inst = self.instance
            return (f"The repository {inst.repo} is checked out at {self.workdir} (commit "
                    f"{inst.base_commit[:12]}). Start by exploring it.")
        first, _, rest = message.partition("\n")
        return f"Last: {first}" + (f"\n{rest}" if rest else "")

    def extra_info(self) -> dict[str, Any]:
        """``instance_id``; once graded, ``grade`` (resolved, patch applied, timed out, error, seconds,
        per-test status) and ``patch`` (the agent's diff)."""
        info: dict[str, Any] = {}
        if self.instance is not None:
            info["instance_id"] = self.instance.instance_id
        g = self.grade_result
        if g is not None:
            info["grade"] = {"resolved": g.resolved, "patch_applied": g.patch_applied, "timed_out": g.timed_out,
                             "error": g.error, "seconds": round(g.seconds, 3),
                             "tests_status": g.report.get("tests_status", {})}
            info["patch"] = self.patch
        return info

    # ---- cleanup ----------------------------------------------------------------------------------
    def _close_sandbox(self) -> None:
        if self._job is not None:                 # a reset or tool call still under way: let it end first
            try:
                res = self._wait_job()
                if isinstance(res, DockerSandbox) and res is not self.sb:
                    res.close()
            except BaseException:  # noqa: BLE001 - its error no longer matters
                pass
        if self.sb is not None:
            self.sb.close()
            self.sb = None

    def close(self) -> None:
        """Remove the episode's container."""
        self._close_sandbox()
        super().close()


def _label(call: ToolCall) -> str:
    """A short one-line name of a tool call for the prompt's action history."""
    if call.name == "bash":
        cmd = " ".join(call.args["command"].split())
        return "bash: " + (cmd if len(cmd) <= 80 else cmd[:77] + "...")
    if call.name == "str_replace_editor":
        return f"str_replace_editor {call.args['command']} {call.args['path']}"
    return call.name


__all__ = ["SWEBenchEnv", "EVAL_OFFSET"]
