"""Data-parallel updates (trainer/data_parallel.py): N gloo workers on Ray give the one-process update.

Each test builds the same batch twice: once through the in-process :class:`PolicyUpdater`, once
through :class:`DataParallelUpdater` with 2 workers, from identical starting weights, and compares the
updated weights and the returned statistics.  The batch has several sequences of different lengths
(multi-turn ones, which ``seq-mean-token-mean`` weighs as one), mixed advantages (zeros skipped),
several micro-batches per optimiser step (an odd number, so the ranks' shares differ) and prompts that
share a prefix (the shared-prefix forward).  The SGD test would fail if the ranks' gradients were
averaged instead of summed (Adam's first steps are nearly scale invariant; SGD's are not).
"""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from crl_bench.llm.weight_channel import ChannelReceiver
from crl_bench.trainer.losses import cispo_loss
from crl_bench.trainer.policy import PolicyUpdater, TokenSample, build_batch, sequence_logprobs
from crl_bench.trainer.rank_placement import NOSET_VISIBLE_DEVICES, RankPlacement, release, reserve, scheduling

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")          # one Ray cluster at a time (tests/test_ray_backend.py)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for this module's tests (shut down after them)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _batch(tokenizer, model, n_seq: int = 5) -> list[TokenSample]:
    """``n_seq`` sequences (episodes), some with two turns, one with advantage 0, prompts sharing a
    system-prompt prefix, behaviour log-probs slightly off the model's (ratios != 1)."""
    system = tokenizer.encode("<|im_start|>system\nYou play a text game. Answer with one action.<|im_end|>\n")
    tasks = ["Go north.", "Open the red door and take the key.", "Look.", "Find the exit of the maze.",
             "Pick up the gold coin near the wall.", "Wait."]
    answers = ["north", "open door", "look", "west", "pick up coin", "wait", "east", "south"]
    advs = [1.0, -1.0, 0.5, 0.0, -0.5, 2.0]
    gen = torch.Generator().manual_seed(1)
    out = []
    for k in range(n_seq):
        turns = 2 if k % 2 == 0 else 1
        for t in range(turns):
            prompt = system + tokenizer.encode(f"<|im_start|>user\n{tasks[k % len(tasks)]} turn {t}<|im_end|>\n"
                                               "<|im_start|>assistant\n<answer>")
            resp = tokenizer.encode(f"{answers[(k + t) % len(answers)]}</answer>")
            b = build_batch([TokenSample(prompt, resp, [0.0] * len(resp), 0.0)], tokenizer.pad_token_id)
            with torch.no_grad():
                lp = sequence_logprobs(model, b)[0]
            noise = 0.05 * torch.randn(lp.shape, generator=gen)
            out.append(TokenSample(prompt, resp, (lp + noise).tolist(), advs[k % len(advs)], sequence=k))
    return out


def _compare(tokenizer, model, samples, *, sgd: bool = False, sharding: str = "ddp", updates: int = 1,
             rtol: float = 1e-5, atol: float | None = None, **kw):
    """Run ``updates`` updates in-process and with 2 workers from the same weights; assert equal
    weights and statistics; return (single stats, data-parallel stats, data-parallel updater, the
    single-process updater).

    Tolerances: the gradient sum runs in another order than one process's accumulation (float
    rounding, ~1e-7 relative to the largest terms summed).  SGD moves weights by ``lr * g``, so they
    agree to that.  AdamW's first step is ``lr * g / (|g| + eps)``: where terms of ~1e-3 cancel to a
    ``|g|`` near ``eps`` (1e-8), their rounding (~1e-10) decides that element's step, anywhere between
    ``-lr`` and ``lr``.  So for AdamW the summed gradient is compared tightly through the first moment
    (``exp_avg = 0.1 g`` after one step), and the weights with ``atol = lr / 100`` where the step is
    set by the gradient (``|g| >= 1e-6``, 100 ``eps``; the step's sensitivity to ``g`` is then at most
    ``lr * eps / |g|**2 = 1e4 lr``) and within ``2 lr`` per optimiser step elsewhere.
    """
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    def opt(m):
        params = [p for p in m.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.5) if sgd else torch.optim.AdamW(params, lr=1e-3)

    atol = atol if atol is not None else (1e-6 if sgd else 1e-5)
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    single = PolicyUpdater(m1, opt(m1), tokenizer.pad_token_id, **kw)
    dp = DataParallelUpdater(m2, opt(m2), tokenizer.pad_token_id, workers=2, sharding=sharding, threads=1,
                             timeout_s=300, **kw)
    try:
        before = {n: p.detach().clone() for n, p in m2.named_parameters()}
        optimizer_steps = 0
        for _ in range(updates):
            s1 = single.update(samples)
            optimizer_steps += int(s1["optimizer_steps"])
            s2 = dp.update(samples)
            assert set(s1) == set(s2)
            for k in s1:
                assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k
        assert s1["optimizer_steps"] >= 1
        p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
        assert any(not torch.equal(before[n], p2[n]) for n in p2)           # the driver got new weights
        if sgd:
            for n in p1:
                torch.testing.assert_close(p2[n], p1[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
            return s1, s2, dp, single
        state1, state2 = single.optimizer.state_dict()["state"], dp.optimizer.state_dict()["state"]
        trained = [(n, q) for n, q in m1.named_parameters() if q.requires_grad]    # opt()'s order
        lr = single.optimizer.param_groups[0]["lr"]
        for i, (n, q1) in enumerate(trained):
            q2 = p2[n]
            g1, g2 = state1[i]["exp_avg"], state2[i]["exp_avg"]         # 0.1 * the summed, clipped gradient
            torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-5 * float(g1.abs().max()),
                                       msg=lambda m, n=n: f"exp_avg of {n}: {m}")
            set_by_g = g1.abs() >= 1e-7                                   # |g| >= 1e-6
            torch.testing.assert_close(q2[set_by_g], q1[set_by_g], rtol=rtol, atol=atol,
                                       msg=lambda m, n=n: f"{n}: {m}")
            assert float((q2 - q1).detach().abs().max()) <= 2 * lr * optimizer_steps + 1e-6, n
        return s1, s2, dp, single
    except BaseException:
        dp.close()
        raise


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_ddp_update_equals_single_process(ray_session, tokenizer, tiny_model, loss_agg):
    """AdamW, one optimiser step of 7 micro-batches of one sample (4 on rank 0, 3 on rank 1; each
    through the shared-prefix forward, whose prefix is the prompt but its last token), old log-probs
    folded from the training forward; also the optimiser state a checkpoint saves."""
    samples = _batch(tokenizer, tiny_model)
    s1, s2, dp, single = _compare(tokenizer, tiny_model, samples, micro_batch_size=1, loss_agg=loss_agg,
                                  recompute_old_logprobs=True, min_shared_prefix=4)
    try:
        assert s1["shared_prefix_tokens"] == 0          # micro-batches of 1: nothing saved
        assert s1["behaviour_logprob_abs_diff"] > 0.01
        assert s1["trained_samples"] == sum(s.advantage != 0 for s in samples) == 7
        assert "behaviour_logprob_abs_diff" in s2
        opt_state = dp.optimizer.state_dict()
        assert sorted(opt_state["state"]) == list(range(len(list(tiny_model.parameters()))))
        assert opt_state["state"][0]["exp_avg"].abs().sum() > 0
        ref = single.optimizer.state_dict()["state"]
        for i, st in ref.items():                       # exp_avg = 0.1 * the summed, clipped gradient
            scale = float(st["exp_avg"].abs().max())
            torch.testing.assert_close(opt_state["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-4,
                                       atol=1e-5 * scale)
    finally:
        dp.close()


@pytest.mark.slow
def test_ddp_sums_gradients_sgd_several_steps(ray_session, tokenizer, tiny_model):
    """SGD without clipping (weights scale with the gradient), 2 epochs x 2 mini-batches, micro-batches
    of 2 with shared prefixes, separate recomputation of the old log-probs, CISPO: two updates."""
    samples = _batch(tokenizer, tiny_model, n_seq=6)
    s1, s2, dp, _ = _compare(tokenizer, tiny_model, samples, sgd=True, updates=2, micro_batch_size=2,
                          mini_batches=2, epochs=2, max_grad_norm=0.0, loss_fn=cispo_loss,
                          loss_kwargs={"eps_low": 0.1, "eps_high": 0.1}, loss_agg="seq-mean-token-mean",
                          recompute_old_logprobs=True, min_shared_prefix=4)
    dp.close()
    assert s1["optimizer_steps"] == 4 and s1["shared_prefix_tokens"] > 0
    assert "behaviour_ratio_std" in s1


@pytest.mark.slow
def test_ddp_whole_episode_sequences_equal_single_process(ray_session, tokenizer, tiny_model):
    """Multi-turn episodes trained as one sequence each (the environment's tokens masked), 2 mini-
    batches so the old log-probs are recomputed apart (split over the ranks, gathered): the workers
    take the one-process update, and the drift is measured on the actor's tokens only."""
    from crl_bench.llm.base import SamplingParams
    from crl_bench.llm.hf_engine import HFEngine
    from crl_bench.rollout import EnvPool, EpisodeSpec, PromptBuilder, RolloutRunner
    from crl_bench.trainer.policy import episode_samples

    runner = RolloutRunner(HFEngine(tiny_model, tokenizer), PromptBuilder(tokenizer, layout="multiturn"),
                           EnvPool(max_steps=3), SamplingParams(temperature=1.0, max_new_tokens=6),
                           constrained=False)
    torch.manual_seed(0)
    trajs = runner.collect([EpisodeSpec("sokoban", t, group_id=t) for t in range(4)])
    counts: dict[str, int] = {}
    samples = episode_samples(trajs, [1.0, -1.0, 0.5, -0.5], counts=counts)
    assert counts["episode_sequences"] == 4 and all(s.loss_mask is not None for s in samples)
    s1, _, dp, _ = _compare(tokenizer, tiny_model, samples, micro_batch_size=1, mini_batches=2,
                            recompute_old_logprobs=True, loss_agg="seq-mean-token-mean")
    dp.close()
    assert s1["trained_tokens"] == sum(t.response_tokens for t in trajs)
    assert s1["behaviour_logprob_abs_diff"] < 1e-3        # the sampler's log-probs, actor tokens only


@pytest.mark.slow
def test_ddp_fewer_micro_batches_than_workers(ray_session, tokenizer, tiny_model):
    """One micro-batch per step: rank 1 joins the gradient sum with a zero-weight dummy; the warm-up
    scheduler built on the driver's optimiser (as Trainer builds it) is rebuilt on the workers (lr
    reported as in one process)."""
    from crl_bench.trainer.policy import linear_warmup

    samples = _batch(tokenizer, tiny_model, n_seq=3)
    m1, m2 = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)
    single = PolicyUpdater(m1, o1, tokenizer.pad_token_id, micro_batch_size=8, mini_batches=2,
                           scheduler=linear_warmup(o1, 4))
    with DataParallelUpdater(m2, o2, tokenizer.pad_token_id, micro_batch_size=8, mini_batches=2, workers=2,
                             threads=1, timeout_s=300, scheduler=linear_warmup(o2, 4)) as dp:
        for _ in range(2):
            s1, s2 = single.update(samples), dp.update(samples)
            for k in s1:
                assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k
        assert s2["lr"] == pytest.approx(1e-3 * 4 / 4) and dp.scheduler.state_dict()["last_epoch"] == 4
        assert [d.split(" ")[0] for d in dp.rank_devices()] == ["cpu", "cpu"]      # gloo ranks on the CPU
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ddp_resume_from_state_dict(ray_session, tokenizer, tiny_model):
    """A checkpoint of a data-parallel run (the driver's weights, the workers' optimiser, the driver's
    generator) loaded into a fresh data-parallel updater continues exactly like the original."""
    from crl_bench.llm.weights import load_trainable, trainable_state
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    samples = _batch(tokenizer, tiny_model, n_seq=4)
    kw = dict(micro_batch_size=2, mini_batches=2, workers=2, threads=1, timeout_s=300)
    m1, m2 = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    with DataParallelUpdater(m1, torch.optim.AdamW(m1.parameters(), lr=1e-3), tokenizer.pad_token_id, **kw) as a:
        a.update(samples)
        weights, state = {n: t.clone() for n, t in trainable_state(m1).items()}, a.state_dict()
        with DataParallelUpdater(m2, torch.optim.AdamW(m2.parameters(), lr=1e-3), tokenizer.pad_token_id,
                                 seed=7, **kw) as b:
            load_trainable(m2, weights, "actor")
            b.load_state_dict(state)
            sa, sb = a.update(samples), b.update(samples)
    assert sa == pytest.approx(sb, rel=1e-6, abs=1e-9)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


@pytest.mark.slow
def test_fsdp_update_equals_single_process(ray_session, tokenizer, tiny_model):
    """FSDP2 (``fully_shard`` per decoder layer and the root, gloo on CPU): the same weights and
    statistics as one process without the shared-prefix forward (FSDP runs the plain one), and the
    full optimiser state gathered in torch.optim's integer-id form."""
    samples = _batch(tokenizer, tiny_model)
    s1, s2, dp, single = _compare(tokenizer, tiny_model, samples, sharding="fsdp", micro_batch_size=2,
                          loss_agg="seq-mean-token-mean", share_prefix=False, recompute_old_logprobs=True,
                          max_grad_norm=0.5)
    try:
        state = dp.optimizer.state_dict()
        n = len(list(tiny_model.parameters()))
        assert sorted(state["state"]) == list(range(n))
        assert state["param_groups"][0]["params"] == list(range(n))
        ref = single.optimizer.state_dict()["state"]
        for i, st in ref.items():
            torch.testing.assert_close(state["state"][i]["exp_avg"], st["exp_avg"], rtol=1e-4,
                                       atol=1e-5 * float(st["exp_avg"].abs().max()))
        dp.optimizer.load_state_dict(state)            # the full state goes back into the shards
        again = dp.optimizer.state_dict()
        for i, st in state["state"].items():
            torch.testing.assert_close(again["state"][i]["exp_avg_sq"], st["exp_avg_sq"], rtol=0, atol=0)
        _direct_sync_then_refresh(dp, samples)
    finally:
        dp.close()


class _Worker(ChannelReceiver):
    """A stand-in vLLM worker on the weight channel: keeps what ``load_weights`` gets."""

    def __init__(self) -> None:
        self.got: list[tuple[str, torch.Tensor]] = []
        model = SimpleNamespace(load_weights=lambda weights: self.got.extend(weights))
        self.model_runner = SimpleNamespace(model=model)

    def crl_sync_mode(self) -> str:
        return "load"


class _Engine:
    """A stand-in engine whose one worker runs in this process (as vLLM's in-process engine does)."""

    dtype = "float32"
    tensor_parallel_size = 1

    def __init__(self) -> None:
        self.worker, self.llm = _Worker(), self

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]


def _direct_sync_then_refresh(dp, samples):
    """``devices.weight_sync: direct`` on two FSDP2 ranks: after an update the driver's copy stays behind, the
    engine's worker receives every rank-gathered tensor in order (a second sync over the same channel too), and
    ``refresh_model`` brings the driver's copy to exactly what was sent (through the full state dict, another
    path than the channel's gathers)."""
    from crl_bench.llm.weight_channel import DirectWeightSync

    engine = _Engine()
    sync = DirectWeightSync(dp, engine)
    dp.weights_to_driver = False
    try:
        before = {n: p.detach().clone() for n, p in dp.model.named_parameters()}
        dp.update(samples)
        assert dp.model_stale
        assert all(torch.equal(before[n], p) for n, p in dp.model.named_parameters())
        for _ in range(2):
            engine.worker.got.clear()
            sent = sync.sync()
            tied = [n for n, _ in dp.model.named_parameters(remove_duplicate=False)]      # as state_dict names them
            assert [n for n, _ in engine.worker.got] == tied
            assert sent == sum(t.numel() * 4 for _, t in engine.worker.got)
        dp.refresh_model()
        assert not dp.model_stale
        params = dict(dp.model.named_parameters(remove_duplicate=False))
        for n, t in engine.worker.got:
            assert torch.equal(t, params[n].detach()), n
        assert any(not torch.equal(before[n], p) for n, p in params.items())
    finally:
        sync.close()
        dp.weights_to_driver = True


@pytest.mark.slow
def test_default_model_ddp_update_equals_single_process(ray_session, default_model_dir, tokenizer):
    """The real default model (float32), 2 gloo workers, one update of a small batch."""
    from crl_bench.llm.hf_engine import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(default_model_dir), "float32")
    samples = _batch(tokenizer, model, n_seq=3)
    _, _, dp, _ = _compare(tokenizer, model, samples, micro_batch_size=2, recompute_old_logprobs=True,
                           loss_agg="seq-mean-token-mean")
    dp.close()


def test_validation(tiny_model, tokenizer):
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    opt = torch.optim.AdamW(tiny_model.parameters())
    with pytest.raises(ValueError):
        DataParallelUpdater(tiny_model, opt, tokenizer.pad_token_id, workers=0)
    with pytest.raises(ValueError):
        DataParallelUpdater(tiny_model, opt, tokenizer.pad_token_id, sharding="zero3")


@pytest.mark.slow
def test_not_enough_ray_cpus_is_an_error_not_a_hang(ray_session, tiny_model, tokenizer):
    from crl_bench.trainer.data_parallel import DataParallelUpdater

    opt = torch.optim.AdamW(tiny_model.parameters())
    with pytest.raises(RuntimeError, match="not enough free Ray resources"):
        DataParallelUpdater(tiny_model, opt, tokenizer.pad_token_id, workers=2, threads=1, num_cpus=64)


@ray.remote
class _Where:
    """An actor that says which placement group it is in and whether Ray left its visible devices alone."""

    def where(self):
        ctx = ray.get_runtime_context()
        return ctx.get_placement_group_id(), os.environ.get(NOSET_VISIBLE_DEVICES)


def test_ranks_given_gpus_are_reserved_in_a_placement_group_each_in_its_bundle(ray_session):
    # CPU bundles stand in for the GPU shares a CUDA machine reserves (trainer/rank_placement.py)
    p = RankPlacement({"num_cpus": 0.25, "runtime_env": {"env_vars": {NOSET_VISIBLE_DEVICES: "1"}}},
                      [None, None], [{"CPU": 0.25}, {"CPU": 0.25}])
    group = reserve(p, timeout_s=600)          # bounds, not timings: a loaded machine starts workers slowly
    try:
        rank1 = _Where.options(**p.options, **scheduling(group, 1)).remote()
        assert ray.get(rank1.where.remote(), timeout=600) == (group.id.hex(), "1")
        ray.kill(rank1)
    finally:
        release(group)
    assert scheduling(None, 0) == {} and reserve(RankPlacement({}, [None])) is None
    with pytest.raises(RuntimeError, match=r"could not reserve .*'CPU': 64.0.* within 1 s"):
        reserve(RankPlacement({"num_cpus": 64}, [None], [{"CPU": 64.0}]), timeout_s=1)


@ray.remote(num_cpus=1)
class _Holder:
    """An actor that only holds a CPU of the Ray cluster."""

    def ping(self) -> bool:
        return True


def test_cpus_held_by_a_closing_actor_are_waited_for(ray_session):
    """Ray frees a killed actor's CPUs a moment after ``ray.kill``; a second updater built right after
    the first closed can see 1 of 2 CPUs free, and without a wait it would fail. Held CPUs that come back within the
    wait are waited for; CPUs that stay held are an error naming what is free after the wait."""
    import threading

    from crl_bench.trainer.rank_placement import wait_for_resources

    # start from a cluster with every CPU free: the previous test's actors may still be handing theirs
    # back, and one coming back during the 0.5 s wait below would make the first call succeed
    total = ray.cluster_resources().get("CPU", 0.0)
    wait_for_resources({"CPU": total, "GPU": 0.0}, 60.0)
    free = ray.available_resources().get("CPU", 0.0)
    assert free == total
    holders = [_Holder.remote() for _ in range(int(free) - 1)]
    try:
        ray.get([h.ping.remote() for h in holders])
        with pytest.raises(RuntimeError, match=r"CPU needs 2, 1 free after waiting 0.5 s"):
            wait_for_resources({"CPU": 2.0, "GPU": 0.0}, 0.5)
        timer = threading.Timer(1.0, lambda: [ray.kill(h) for h in holders])
        timer.start()
        wait_for_resources({"CPU": 2.0, "GPU": 0.0}, 60.0)
        timer.join()
    finally:                     # a failure above must not leave CPUs held for the module's later tests
        for h in holders:
            ray.kill(h)
    with pytest.raises(RuntimeError, match=r"CPU needs 64, \d+ in the cluster"):
        wait_for_resources({"CPU": 64.0, "GPU": 0.0}, 60.0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "complementary"])
def test_trainer_with_two_workers_takes_the_one_process_steps(ray_session, tokenizer, tiny_model, tmp_path, method):
    """``train.workers=2`` in the real loop: two steps give the one-process trainer's metrics and
    weights (actor and, for complementary, the CISPO-trained extractor), and a checkpoint's optimiser
    state comes from the workers."""
    from tests_helpers import CoinEnv, coin_config

    from crl_bench.env_api import register_env
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.trainer.checkpoint import save_checkpoint
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    runs = {}
    for workers in (1, 2):
        cfg = coin_config(method, train={"workers": workers, "seed": 1}, model={"dtype": "float32"},
                          experience={"recency_window_s": 0}, extractor={"reward": "binary"})
        tr = Trainer(cfg, model=copy.deepcopy(tiny_model), tokenizer=tokenizer, embedder=HashEmbedder(64),
                     extractor_model=copy.deepcopy(tiny_model))
        try:
            metrics = [tr.train_step().metrics for _ in range(3)]
            tr.writer = None
            if workers == 2:
                from crl_bench.trainer.data_parallel import DataParallelUpdater

                assert isinstance(tr.updater, DataParallelUpdater)
                ckpt = save_checkpoint(tr, tmp_path, keep=1)
                state = torch.load(ckpt / "trainer.pt", weights_only=True)["optimizer"]["state"]
                assert state                                      # the workers' AdamW state was saved
            runs[workers] = (metrics, [p.detach().clone() for p in tr.model.parameters()],
                             [p.detach().clone() for p in tr.experience.model.parameters()] if tr.experience else [])
        finally:
            tr.close()
    (m1, w1, x1), (m2, w2, x2) = runs[1], runs[2]
    assert any(m.get("optimizer_steps") for m in m1)
    for a, b in zip(m1, m2):
        for key in ("success_rate", "reward_mean", "groups_with_signal", "optimizer_steps", "trained_tokens"):
            assert a.get(key) == b.get(key), key
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for p, q in zip(w1, w2):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    for p, q in zip(x1, x2):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_a_call_to_every_worker_puts_its_argument_in_the_object_store_once(monkeypatch):
    # a resumed optimizer state (61 GB for a 7B actor) goes to every rank: one copy in Ray's object store
    # and one reference per worker, not one copy per call
    import ray

    from crl_bench.trainer.data_parallel import DataParallelUpdater

    puts: list[object] = []

    def put(value):
        puts.append(value)
        return ("ref", len(puts))

    got: list[tuple] = []

    class Method:
        def remote(self, *args):
            got.append(args)
            return args

    class Actor:
        load_optimizer_state = Method()

    monkeypatch.setattr(ray, "put", put)
    updater = object.__new__(DataParallelUpdater)
    updater._actors = [Actor(), Actor(), Actor()]
    updater.gather = lambda refs: [0.5 for _ in refs]
    state = {"state": {0: {"exp_avg": torch.zeros(3)}}}
    assert updater.call_rank0("load_optimizer_state", state) == 0.5
    assert puts == [state] and got == [(("ref", 1),)] * 3


@pytest.mark.parametrize("sharding, expected", [("fsdp", [("ref", 1), None, None]), ("ddp", [("ref", 1)] * 3)])
def test_a_full_state_reaches_only_rank_0_under_fsdp(monkeypatch, sharding, expected):
    # FSDP ranks take a resumed state from rank 0 by broadcast (broadcast_from_rank0): the other ranks get
    # None and never deserialise the whole 61 GB; DDP replicas each need it, from one stored copy
    import ray

    from crl_bench.trainer.data_parallel import DataParallelUpdater

    got: list = []

    class Method:
        def remote(self, arg):
            got.append(arg)
            return arg

    class Actor:
        load_weights = Method()

    monkeypatch.setattr(ray, "put", lambda value: ("ref", 1))
    updater = object.__new__(DataParallelUpdater)
    updater._actors, updater.sharding = [Actor(), Actor(), Actor()], sharding
    updater.gather = lambda refs: refs
    updater.call_full_state("load_weights", {"w": torch.zeros(2)})
    assert got == expected
