"""Instances as processes (gloo, 2 ranks): migration over point-to-point sends gives exactly the tokens of one
instance without migration (KV transfer and re-prefill in one run each, and KV transfer with speculative
decoding); a dying instance gives its peer a
clear InstanceFailure within the group's timeout, never a hang."""

import os
import signal
from datetime import timedelta

import pytest
import torch

from rlhfuse.core.types import PromptBatch
from rlhfuse.generation import GenerationEngine, SamplingParams, requests_for
from rlhfuse.models import ModelConfig, Transformer
from rlhfuse.testing.data import assert_same_rollout
from rlhfuse.testing.processes import spawn_ranks

EOS, PAD, MAX_NEW = 2, 0, 16
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.95, stop_token_ids=(EOS, 6, 14))
LONG = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.95, stop_token_ids=(EOS,))


def _model():
    torch.manual_seed(0)
    config = ModelConfig.tiny(
        vocab_size=24, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    return Transformer(config, head="lm").eval()


def _prompt_batch():
    g = torch.Generator().manual_seed(1)
    rows = [[1, *torch.randint(3, 24, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()]
            for _ in range(6)]  # fmt: skip
    width = max(map(len, rows))
    ids = torch.full((6, width), PAD)
    mask = torch.zeros((6, width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return PromptBatch(ids, mask, torch.arange(6))


def _requests():
    return requests_for(_prompt_batch(), samples_per_prompt=4, seed=3, iteration=1)


def _worker(rank, port, out_dir, mechanisms, threshold, die_rank):
    import torch.distributed as dist

    from rlhfuse.distributed import exit_finished
    from rlhfuse.generation.distributed import DistributedCoordinator, InstanceFailure, gather_finished
    from rlhfuse.testing.processes import leave_after_success

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    try:
        for run in mechanisms:  # one process group for every run: process start-up dominates the test
            mechanism, _, speculative = run.partition("+")  # "kv+ngram": KV migration, speculative decoding
            engine = GenerationEngine(
                _model(),
                LONG,
                num_slots=24,
                max_len=6 + LONG.max_new_tokens,
                speculative=speculative or "off",
            )
            coordinator = DistributedCoordinator(engine, bs_max=24, mechanism=mechanism, timeout_s=10)
            done = []
            for sample in coordinator.run(_requests(), threshold=threshold):
                done.append(sample)
                if rank == die_rank:
                    os._exit(3)  # a crash mid-generation, no goodbye
            everything = gather_finished(done)
            report = coordinator.report
            torch.save(
                {
                    "tokens": {r.row: r.tokens for r in everything},
                    "moved": report.samples_moved,
                    "mechanism": report.mechanism,
                    "destinations": report.destinations,
                    "accepted": engine.stats.spec_accepted,
                },
                os.path.join(out_dir, f"{run}-rank{rank}.pt"),
            )
    except InstanceFailure as err:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(str(err))
        exit_finished()  # its peer died: no barrier to agree at
    leave_after_success()


def _launch(tmp_path, mechanisms, threshold, die_rank=-1, timeout=90):
    """The two ranks' exit codes."""
    codes = spawn_ranks(_worker, str(tmp_path), mechanisms, threshold, die_rank, timeout_s=timeout)
    assert -signal.SIGKILL not in codes, "a generation process hung"
    return codes


def _serial_tokens():
    engine = GenerationEngine(_model(), LONG, num_slots=24, max_len=6 + LONG.max_new_tokens)
    engine.add(_requests())
    done = []
    while engine.has_work():
        done += engine.step()
    return {r.row: r.tokens for r in done}


@pytest.mark.timeout(180)
def test_two_processes_migrate_and_keep_every_token(tmp_path):
    # Rt = the batch (BSmax 24: one destination): the migration starts as soon as rank 0 has heard from its peer
    # (the ranks do not step in lockstep), long before the samples (EOS only, up to 40 tokens) are done
    assert _launch(tmp_path, ("kv", "reprefill", "kv+ngram"), threshold=24) == [0, 0]
    expected = _serial_tokens()
    for run in ("kv", "reprefill", "kv+ngram"):
        mechanism = run.partition("+")[0]
        for rank in range(2):
            result = torch.load(tmp_path / f"{run}-rank{rank}.pt")
            assert result["tokens"] == expected
            assert result["mechanism"] == mechanism and result["moved"] > 0 and result["destinations"] == 1
    # speculative decoding with migration between processes: drafts were accepted, the tokens are the same
    assert sum(torch.load(tmp_path / f"kv+ngram-rank{rank}.pt")["accepted"] for rank in range(2)) > 0


@pytest.mark.timeout(120)
def test_a_dying_instance_gives_a_clear_error_not_a_hang(tmp_path):
    assert _launch(tmp_path, ("kv",), threshold=6, die_rank=1, timeout=60)[1] == 3
    message = (tmp_path / "rank0.err").read_text()
    assert "generation instance 0 of 2" in message and "another generation process probably died" in message


def _inferencer():
    from rlhfuse.core.inference import InferencerConfig
    from rlhfuse.trainer.strategies.plain.inference import ModelInferencer

    torch.manual_seed(7)
    config = _model().config
    ref, critic, reward = (
        Transformer(config),
        Transformer(config, head="value"),
        Transformer(config, head="value"),
    )
    return ModelInferencer(
        InferencerConfig(truncated_score=None),
        actor=_model(),
        ref=ref.eval(),
        critic=critic.eval(),
        reward_model=reward.eval(),
        rewards=None,
        tokenizer=None,
        temperature=1.0,
    )


def _fusion_worker(rank, port, out_dir):
    import torch.distributed as dist

    from rlhfuse.generation import CostProfile
    from rlhfuse.generation.fusion import fused_generate_infer
    from rlhfuse.testing.processes import leave_after_success

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    inferencer = _inferencer()
    # the early run migrates at once (Rt = the batch; BSmax 24: one destination), its samples long (EOS only, up
    # to 40 tokens): the other rank's samples move, and the freed rank then takes the destination's finished ones
    for name, threshold, bs_max in (("serial", 0, 16), ("fused", 6, 16), ("early", 24, 24)):
        params = LONG if name == "early" else PARAMS
        engine = GenerationEngine(_model(), params, num_slots=24, max_len=6 + params.max_new_tokens)
        result = fused_generate_infer(
            engine, inferencer, _requests(), threshold=threshold, bs_max=bs_max, mechanism="kv", micro_batch=4,
            infer_tokens=40,
        )  # fmt: skip
        torch.save({"experience": result.experience, "freed": result.report.freed, "moved": result.report.samples_moved,
                    "stolen": result.stolen, "profile": CostProfile.fit([engine.stats]),
                    "migrations": engine.stats.migrations}, os.path.join(out_dir, f"{name}-rank{rank}.pt"))  # fmt: skip
    # the trainer's generator on the same world: one instance per rank, the whole rollout on every rank
    from rlhfuse.core.sampling import SamplingConfig
    from rlhfuse.generation import EngineGenerator, FixedThreshold, GenerationConfig, InstanceSetup
    from rlhfuse.generation.generator import EnginePool

    sampling = SamplingConfig(max_new_tokens=MAX_NEW, top_p=0.95, stop_token_ids=[6, 14])
    config = GenerationConfig(name="engine", sampling=sampling, instances=2)
    setup = InstanceSetup(EOS, PAD, samples_per_prompt=4, seed=3, policy=FixedThreshold(6), bs_max=16)
    gen = EngineGenerator(EnginePool(_model(), config.engine), config, setup, mechanism="kv")
    (rollout,) = gen.generate(_prompt_batch(), iteration=1)
    assert gen.is_distributed()
    moved = gen.migration.samples_moved  # generate(): DistributedCoordinator (the count watch, no lockstep)
    # what the trainer calls: generation fused with inference, the same Experience on every rank
    experience, timings = gen.fused_rollout(
        _prompt_batch(), iteration=1, inferencer=inferencer, micro_batch=4
    )
    torch.save({"rollout": rollout, "moved": moved, "metrics": gen.generation_stats().metrics(),
                "experience": experience, "timings": timings.metrics()},
               os.path.join(out_dir, f"generator-rank{rank}.pt"))  # fmt: skip
    leave_after_success()


@pytest.mark.timeout(180)
def test_freed_instance_infers_streamed_samples_with_serial_results(tmp_path):
    """Also: EngineGenerator on a 2-rank world generates one instance per rank, equal to the oracle."""
    assert spawn_ranks(_fusion_worker, str(tmp_path), timeout_s=120) == [0, 0]
    # the single-process oracle: generate everything, then one inference pass over the whole rollout
    from rlhfuse.generation import to_rollout

    engine = GenerationEngine(_model(), PARAMS, num_slots=24, max_len=6 + MAX_NEW)
    engine.add(_requests())
    done = []
    while engine.has_work():
        done += engine.step()
    with torch.no_grad():
        oracle = _inferencer().infer(to_rollout(sorted(done, key=lambda r: r.row), PAD))
    short_oracle = oracle
    for rank in range(2):
        got = torch.load(tmp_path / f"generator-rank{rank}.pt", weights_only=False)
        # the ranks decide the same moves; whether any move depends on their speeds (no lockstep)
        assert got["moved"] == torch.load(tmp_path / "generator-rank0.pt", weights_only=False)["moved"]
        assert got["metrics"]["migration/destinations"] <= 1
        assert_same_rollout(got["rollout"], oracle.rollout)
        assert_same_rollout(got["experience"].rollout, oracle.rollout)
        for field in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
            torch.testing.assert_close(
                getattr(got["experience"], field), getattr(oracle, field), atol=1e-5, rtol=1e-5
            )
        assert got["timings"]["time/generation_inference"] >= got["timings"]["time/generation"] > 0
    # running batch sizes and tokens/s are gathered over both instances: the same numbers on both ranks
    metrics = [
        torch.load(tmp_path / f"generator-rank{r}.pt", weights_only=False)["metrics"] for r in range(2)
    ]
    for key in ("generation/batch_size_p50", "generation/tokens_per_s"):
        assert metrics[0][key] == metrics[1][key] > 0, key
    # the ranks do not step in lockstep: which rank holds the tail when Rt samples remain, and whether rank 0
    # sees the total reach Rt before every sample is done (then nothing migrates), depends on their speeds
    for name in ("fused", "early"):
        runs = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
        assert len(runs[0]["freed"]) <= 1 and runs[0]["freed"] == runs[1]["freed"]
    # migrating at once (the other rank's samples move unless it had already finished them all, when rank 0's
    # first count arrived late): the freed rank then infers samples the destination finished
    early = [torch.load(tmp_path / f"early-rank{r}.pt", weights_only=False) for r in range(2)]
    (freed,) = early[0]["freed"]
    assert early[0]["moved"] == early[1]["moved"]
    assert early[freed]["stolen"] > 0 and early[1 - freed]["stolen"] == 0
    # what the Rt tuner reads of a fused run (the destination decoded batches of many sizes): measured
    # inference, the count watch per step, the migration
    assert early[0]["migrations"] == early[1]["migrations"] == 1
    profile = early[1 - freed]["profile"]
    assert profile.inference_measured and profile.inference_s_per_token > 0
    assert profile.migration_s > 0 and profile.lockstep_s >= 0
    engine = GenerationEngine(_model(), LONG, num_slots=24, max_len=6 + LONG.max_new_tokens)
    engine.add(_requests())
    done = []
    while engine.has_work():
        done += engine.step()
    with torch.no_grad():
        long_oracle = _inferencer().infer(to_rollout(sorted(done, key=lambda r: r.row), PAD))
    for name in ("serial", "fused", "early"):
        oracle = long_oracle if name == "early" else short_oracle
        for rank in range(2):
            exp = torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=False)["experience"]
            assert_same_rollout(exp.rollout, oracle.rollout, label=name)
            for field in ("logprobs_BR", "ref_logprobs_BR", "values_BR", "scores_B"):
                torch.testing.assert_close(getattr(exp, field), getattr(oracle, field), atol=1e-5, rtol=1e-5)
