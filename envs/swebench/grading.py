"""Grading a candidate patch the way SWE-bench does, with swebench's own functions.

Follows ``swebench.harness.run_evaluation.run_instance`` (swebench 5.x): in a container of the instance
image the candidate patch is applied with the same chain of commands (``GIT_APPLY_CMDS``, restoring a
clean tree between attempts), the instance's eval script (``make_test_spec(row).eval_script``, which also
records the test command's exit status) runs as root under a timeout, and the log is graded by
``swebench.harness.grading.get_eval_report``: resolved only when every FAIL_TO_PASS and PASS_TO_PASS test
passes (``ResolvedStatus.FULL``).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from .instances import SWEInstance
from .sandbox import DockerSandbox, SandboxError

PATCH_FILE = "/tmp/crl_patch.diff"      # swebench uses /tmp/patch.diff; ours must not clash with a repo file
EVAL_FILE = "/eval.sh"


@dataclass
class GradeResult:
    """Outcome of grading one patch.

    Attributes:
        resolved: swebench's verdict (the reward is 1.0 exactly when this holds).
        patch_applied: the patch applied (an empty patch counts as applied).
        timed_out: the eval script ran past its timeout (then not resolved).
        report: swebench's per-instance report (``tests_status`` included) or ``{}``.
        log: the eval script's output (the graded log). error: why grading could not finish.
        seconds: wall time of applying and testing.
    """

    resolved: bool = False
    patch_applied: bool = False
    timed_out: bool = False
    report: dict[str, Any] = field(default_factory=dict)
    log: str = ""
    error: str = ""
    seconds: float = 0.0


def apply_patch(sb: DockerSandbox, patch: str) -> tuple[bool, str]:
    """Apply ``patch`` in the sandbox's working tree as swebench's harness does; ``(applied, output)``."""
    from swebench.harness.run_evaluation import GIT_APPLY_CMDS

    if not patch.strip():
        return True, "(empty patch)"
    sb.write_file(PATCH_FILE, patch.encode("utf-8"), owner=(0, 0))
    out = ""
    for attempt, cmd in enumerate(GIT_APPLY_CMDS):
        if attempt:
            sb.exec("git checkout -- . ; git clean -fd", user="root", timeout_s=300)
        r = sb.exec(f"{cmd} {PATCH_FILE}", user="root", timeout_s=300)
        out = r.output
        if r.exit_code == 0:
            return True, out
    r = sb.exec(f"git apply --check --reverse {PATCH_FILE}", user="root", timeout_s=300)
    return r.exit_code == 0, out


def run_eval(sb: DockerSandbox, instance: SWEInstance, timeout_s: float) -> tuple[str, bool]:
    """Run the instance's eval script in ``sb`` as root; ``(log, timed_out)``."""
    from swebench.harness.utils import make_test_spec

    script = make_test_spec(instance.row).eval_script
    sb.write_file(EVAL_FILE, script.encode("utf-8"), mode=0o755, owner=(0, 0))
    r = sb.exec(f"/bin/bash {EVAL_FILE}", timeout_s=timeout_s, user="root", truncate=False)
    return r.output, r.timed_out


def grade_log(instance: SWEInstance, log: str, patch: str | None) -> dict[str, Any]:
    """swebench's report of ``log`` for ``instance`` (``get_eval_report`` on a temporary log file)."""
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    spec = make_test_spec(instance.row)
    fd, path = tempfile.mkstemp(prefix="crl-swe-", suffix=".log")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(log)
        pred = {"instance_id": instance.instance_id, "model_name_or_path": "crl-bench", "model_patch": patch}
        return get_eval_report(spec, pred, path, include_tests_status=True)[instance.instance_id]
    finally:
        os.remove(path)


def grade(sb: DockerSandbox, instance: SWEInstance, patch: str, timeout_s: float = 1800.0,
          apply: bool = True) -> GradeResult:
    """Apply ``patch`` (unless ``apply`` is off: the tree already holds it), run the eval script and grade.

    ``sb`` must be a started sandbox of the instance image; it is left running (the caller closes it).
    Never raises for a failing patch or test run; a sandbox failure is reported in ``error``.
    """
    t0 = time.perf_counter()
    res = GradeResult()
    try:
        if apply:
            res.patch_applied, out = apply_patch(sb, patch)
            if not res.patch_applied:
                res.error, res.log = "the patch does not apply", out
                return res
        else:
            res.patch_applied = True
        res.log, res.timed_out = run_eval(sb, instance, timeout_s)
        if res.timed_out:
            res.error = f"the tests ran past {timeout_s:g} s"
            return res
        res.report = grade_log(instance, res.log, patch)
        res.resolved = bool(res.report.get("resolved"))
    except SandboxError as e:
        res.error = str(e)
    finally:
        res.seconds = time.perf_counter() - t0
    return res
