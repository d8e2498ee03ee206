"""Small envs shared by tests."""

from crl_bench.env_api import TextEnv


class CoinEnv(TextEnv):
    """One decision: 'heads' succeeds, 'tails' fails. A random policy gives mixed groups."""

    env_id = "test-coin"
    system_prompt = "Call the coin."
    splits = {"train": range(0, 100), "eval": range(100, 110)}

    def _reset_task(self, task):
        pass

    def _apply(self, action):
        win = action == "heads"
        return (1.0 if win else 0.0), True, win, "won" if win else "lost"

    def _observe(self, message=""):
        return f"A coin. {message}"

    def admissible_actions(self):
        return ["heads", "tails"]


def coin_config(method, **extra):
    """A tiny run of ``method`` on :class:`CoinEnv` (registered as ``test-coin``): the smoke preset with
    2 groups x 4 rollouts of at most 2 actions, distillation waited for, no merge pass, extractor
    batch 2; ``extra`` is one more config layer on top."""
    from crl_bench.config import build_config, preset_data

    return build_config([preset_data("smoke"), {
        "method": method,
        "rollout": {"mix": "test-coin", "max_steps": 2},
        "train": {"groups_per_step": 2, "group_size": 4, "lr": 1e-3},
        "model": {"gradient_checkpointing": False},
        "eval": {"episodes": 2},
        "experience": {"wait_distill": True, "merge": {"every": 0}},
        "extractor": {"batch_size": 2, "max_new_tokens": 24, "lr": 1e-3},
    }, extra])


class LessonWriterEngine:
    """An extractor engine that writes one ADD per extraction, its title and content a digest of the
    prompt's tokens: the same prompt gets the same lesson in any process, and every distillation adds
    to the bank. It stands in for an extractor able to write (a random tiny model writes nothing that
    parses) where what is tested is the bank's and the run's bookkeeping, not the lesson. Replies carry
    placeholder log-probs (-1.0 per token), as :class:`OracleExtractorEngine`'s do."""

    def __init__(self, tokenizer, prefill=""):
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.written = 0

    def generate(self, prompts, params, allowed=None):
        import hashlib

        from crl_bench.llm.base import Generation

        out = []
        for p in prompts:
            digest = hashlib.sha256(",".join(map(str, p)).encode()).hexdigest()[:10]
            text = (f"<ops>\n<op>ADD</op><title>Lesson {digest}</title>"
                    f"<content>Head for the stairs; seen in episode {digest}.</content>\n</ops>")
            text = text[len(self.prefill):] if text.startswith(self.prefill) else text
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.written += 1
            out.append(Generation(list(p), ids, [-1.0] * len(ids), text, "stop"))
        return out

    def sync_weights(self, model):
        pass


def install_lesson_writer(monkeypatch=None):
    """Make every extractor (:class:`~crl_bench.experience.extractor.Extractor`) built from now on in
    this process extract through a :class:`LessonWriterEngine`; with ``monkeypatch`` the change is
    undone after the test. A child process gets the same from :data:`LESSON_WRITER_CLI`, a Ray worker
    from ``runtime_env={"worker_process_setup_hook": "tests_helpers.install_lesson_writer"}``."""
    from crl_bench.experience.extractor import Extractor

    real_init = Extractor.__init__

    def init(self, engine, tokenizer, prompt_builder, *args, **kwargs):
        real_init(self, engine, tokenizer, prompt_builder, *args, **kwargs)
        self.engine = LessonWriterEngine(tokenizer, prompt_builder.prefill)

    if monkeypatch is not None:
        monkeypatch.setattr(Extractor, "__init__", init)
    else:
        Extractor.__init__ = init


#: ``python -c LESSON_WRITER_CLI <crl-bench args...>`` (with tests/ on PYTHONPATH): the CLI with
#: :func:`install_lesson_writer` in force.
LESSON_WRITER_CLI = """
import sys
from tests_helpers import install_lesson_writer
install_lesson_writer()
from crl_bench.cli import main
sys.exit(main(sys.argv[1:]))
"""


class OracleExtractorEngine:
    """An extractor engine for ``diag-vault`` that knows the codes: after a successful episode it writes
    one ADD naming the context's code (the lesson the episode holds), after a failure NONE.

    It reads the context and the outcome from the extractor's prompt (the last ``Task:`` and
    ``Outcome:`` lines, after the worked example), so it sees what a real extractor sees; replies carry
    placeholder log-probs (-1.0 per token), as the scripted engines of the unit tests do.
    """

    def __init__(self, real, prefill=""):
        self.real = real
        self.tokenizer = real.tokenizer
        self.prefill = prefill
        self.written = 0

    def reply(self, prompt_text):
        import re

        from crl_bench.envs.diag import CONTEXT_NAMES, EVAL_VARIANTS, N_CONTEXTS, VAULT_CODES, DiagVaultEnv

        tasks = re.findall(r"Task: Open the vault of the (.+?)\.", prompt_text)
        outcomes = re.findall(r"Outcome: (\w+)", prompt_text)
        if not tasks or not outcomes or outcomes[-1] != "success" or tasks[-1] not in CONTEXT_NAMES:
            return "<ops>\n<op>NONE</op>\n</ops>"
        ctx = CONTEXT_NAMES.index(tasks[-1])
        task = EVAL_VARIANTS.start * N_CONTEXTS + ctx          # a task id of this context in every split set
        lesson = DiagVaultEnv().lesson_for(task, [VAULT_CODES[ctx]])
        self.written += 1
        return f"<ops>\n<op>ADD</op><title>{tasks[-1]}</title><content>{lesson}</content>\n</ops>"

    def generate(self, prompts, params, allowed=None):
        from crl_bench.llm.base import Generation

        out = []
        for p in prompts:
            text = self.reply(self.tokenizer.decode(p))
            text = text[len(self.prefill):] if text.startswith(self.prefill) else text
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-1.0] * len(ids), text, "stop"))
        return out

    def sync_weights(self, model):
        self.real.sync_weights(model)


def run_in_threads(work, threads: int, join_timeout: float) -> list[BaseException]:
    """Run ``work(seed)`` for seeds ``0 .. threads - 1``, each in its own thread, and return the
    exceptions they raised (empty when every one finished cleanly). ``join_timeout`` (seconds) bounds
    a hang; a thread still alive after it is reported as a ``TimeoutError``."""
    import threading

    errors: list[BaseException] = []

    def guarded(seed: int) -> None:
        try:
            work(seed)
        except Exception as exc:  # noqa: BLE001 - a worker thread hands any failure to the test
            errors.append(exc)

    started = [threading.Thread(target=guarded, args=(s,)) for s in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(join_timeout)
    errors += [TimeoutError(f"{t.name} still running after {join_timeout} s") for t in started if t.is_alive()]
    return errors



class FolderServer:
    """Serves the files of ``root`` over HTTP on 127.0.0.1 (a stand-in for a data set's public source)
    and records the paths it was asked for in ``requests``. ``url`` is its base URL; ``close()`` stops it.
    Also a context manager."""

    def __init__(self, root):
        import http.server
        import threading

        server = self
        self.requests: list[str] = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(root), **k)

            def log_message(self, *a, **k):
                server.requests.append(self.path)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ScriptedReplies:
    """An engine whose reply to each prompt is ``reply(decoded prompt)``; records the decoded prompts.
    Replies carry placeholder log-probs (-1.0 per token), as the other scripted engines of the tests."""

    def __init__(self, tokenizer, reply):
        self.tokenizer = tokenizer
        self.reply = reply
        self.prompts: list[str] = []

    def generate(self, prompts, params, allowed=None):
        from crl_bench.llm.base import Generation

        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            self.prompts.append(text)
            reply = self.reply(text)
            ids = self.tokenizer.encode(reply, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-1.0] * len(ids), reply, "stop"))
        return out


def replay_from_checkpoint(make, tmp_path, computed):
    """Two steps of ``make(tmp_path / "a")``, a checkpoint, two more; then a trainer ``make(tmp_path /
    "b")`` restored from the checkpoint takes two steps. Asserts that both pairs of steps have equal
    ``computed(metrics)`` and the same episodes (task, subgroup, reward, what they were shown) and
    that the actors end equal; returns the two trainers, closed, for checks of their run folders."""
    import torch

    from crl_bench.trainer.checkpoint import load_checkpoint, restore_run_files, save_checkpoint

    a = make(tmp_path / "a")
    for _ in range(2):
        a.train_step()
    ckpt = save_checkpoint(a, a.writer.dir, keep=2)
    after = [a.train_step() for _ in range(2)]
    a.experience.flush()
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    restore_run_files(b_dir, ckpt, has_bank=True)
    b = make(b_dir)
    load_checkpoint(b, ckpt)
    again = [b.train_step() for _ in range(2)]
    b.experience.flush()
    for x, y in zip(after, again):
        assert computed(x.metrics) == computed(y.metrics)
        assert [(t.task, t.subgroup, t.reward, t.guidance) for t in x.trajectories] == \
               [(t.task, t.subgroup, t.reward, t.guidance) for t in y.trajectories]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    a.close()
    b.close()
    return a, b


class PromptHashEngine:
    """An actor engine whose reply depends on the prompt alone: it picks an allowed reply by a digest of
    the prompt's ids (``left</answer>`` where nothing is allowed), so the same prompt gets the same
    reply in any batch, and records each call's batch size in ``batches``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.batches: list[int] = []

    def generate(self, prompts, params, allowed=None):
        import hashlib

        from crl_bench.llm.base import Generation

        self.batches.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            options = (allowed[i] if allowed is not None and allowed[i] else ["left</answer>"])
            digest = int(hashlib.sha256(str(list(p)).encode()).hexdigest(), 16)
            text = options[digest % len(options)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Generation(list(p), ids, [-0.5] * len(ids), text, "stop"))
        return out


def write_evaluated_run(writer, cfg, ev):
    """Write ``writer``'s run folder as a run of ``cfg`` with no training step whose final evaluation is
    ``ev`` (config.yaml with ``train.steps`` 0, versions.json, eval.json): what ``build_summary`` reads."""
    written = cfg.to_dict()
    written["train"]["steps"] = 0
    writer.write_config(written)
    writer.write_versions()
    writer.write_json("eval.json", ev)
